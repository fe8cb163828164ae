// The Hopper backward's consumer warpgroups in the d <= 128 tiling (bwd_kernel.h): per query step
// S^T, dP^T, P^T, dV, dS^T, dK and dQ (the step operations in bwd_step.h), and the build switches
// of their order.
#pragma once

#include <cute/tensor.hpp>
#include <cute/atom/copy_traits_sm90.hpp>
#include <cutlass/arch/barrier.h>

#include "src/attention/hopper/bwd_layouts.h"
#include "src/attention/hopper/bwd_step.h"
#include "src/attention/hopper/bwd_tile.h"
#include "src/attention/hopper/stage_ring.h"
#include "src/attention/hopper/wg_gemm.h"

// dK += dS^T Q with dS^T from registers (1), as dV's P^T, or from its shared-memory tile (0; the
// tile is written for dQ either way). Registers spare the tensor cores' shared-memory reads.
#ifndef FLARE_HOPPER_BWD_DK_RS
#define FLARE_HOPPER_BWD_DK_RS 1
#endif

// The order of a step's last two GEMMs: 1 = dQ, then dK, the dQ tile stored while dK runs; 0 =
// dK, then dQ, the tile stored after both (A/B builds).
#ifndef FLARE_HOPPER_BWD_DQ_FIRST
#define FLARE_HOPPER_BWD_DQ_FIRST 1
#endif

// A step's dQ tile made visible to its writer (the async-proxy fence and the arrive) at once (0),
// or after the next step's S^T and dP^T are issued (1), so that the fence's wait for the tile's
// stores does not hold the next step's GEMMs: ordinary d128 0.97-0.99 of at once, det 0.95-1.01
// (H200, bench/RESULTS.md, session 41).
#ifndef FLARE_HOPPER_BWD_DQ_PUBLISH_LATE
#define FLARE_HOPPER_BWD_DQ_PUBLISH_LATE 1
#endif
// With dQ first: a step's dK GEMM left running into the next step (1), whose wait for S^T retires
// it too (wgmma batches complete in order) and then releases its Q/dO stage, or waited for at the
// step's end (0). A/B builds (session 34 measured it before the late dQ hand-over: from registers
// ptxas serialized the wgmmas, from the dS tile, FLARE_HOPPER_BWD_DK_RS=0, d128 was level).
#ifndef FLARE_HOPPER_BWD_DK_OVERLAP
#define FLARE_HOPPER_BWD_DK_OVERLAP 0
#endif

namespace flare::hopper {

template <typename Cfg, typename T, typename Smem, typename Tile>
__device__ __forceinline__ void bwd_consume(const HopperBwdParams<Cfg, T>& hp, Smem& sm, const Tile& t, int ct) {
  using namespace cute;
  using L = BwdLayouts<Cfg, T>;
  using Elem = typename L::Elem;
  const detail::BwdKernelParams& P = hp.p;
  const detail::FwdKernelParams& p = P.fwd;
  const int lane = ct % 32;

  typename L::MmaSdP mma_sdp;
  typename L::MmaDKV mma_dkv;
  typename L::MmaDK mma_dk;
  typename L::MmaDQ mma_dq;
  auto thr_sdp = mma_sdp.get_thread_slice(ct);
  auto thr_dkv = mma_dkv.get_thread_slice(ct);
  auto thr_dk = mma_dk.get_thread_slice(ct);
  auto thr_dq = mma_dq.get_thread_slice(ct);
  Tensor sQ = make_tensor(make_smem_ptr(sm.q.data()), typename L::SmemQ{});
  Tensor sDO = make_tensor(make_smem_ptr(sm.dout.data()), typename L::SmemQ{});
  Tensor sQt = make_tensor(make_smem_ptr(sm.q.data()), typename L::SmemQt{});
  Tensor sDOt = make_tensor(make_smem_ptr(sm.dout.data()), typename L::SmemQt{});
  Tensor sK = make_tensor(make_smem_ptr(sm.k.data()), typename L::SmemK{});
  Tensor sV = make_tensor(make_smem_ptr(sm.v.data()), typename L::SmemK{});
  Tensor sKt = make_tensor(make_smem_ptr(sm.k.data()), typename L::SmemKt{});

  Tensor k_frag = thr_sdp.partition_fragment_A(sK);
  Tensor v_frag = thr_sdp.partition_fragment_A(sV);
  Tensor q_frag = thr_sdp.partition_fragment_B(sQ);    // (.., stage)
  Tensor do_frag = thr_sdp.partition_fragment_B(sDO);  // (.., stage)
  Tensor dot_frag = thr_dkv.partition_fragment_B(sDOt);
  Tensor qt_frag = thr_dk.partition_fragment_B(sQt);
  Tensor qt_frag_rs = thr_dkv.partition_fragment_B(sQt);  // FLARE_HOPPER_BWD_DK_RS
  Tensor kt_frag = thr_dq.partition_fragment_B(sKt);

  Tensor s_acc = partition_fragment_C(mma_sdp, Shape<typename L::BN, typename L::BM>{});
  Tensor dp_acc = partition_fragment_C(mma_sdp, Shape<typename L::BN, typename L::BM>{});
  Tensor dv_acc = partition_fragment_C(mma_dkv, Shape<typename L::BN, typename L::HD>{});
  Tensor dk_acc = partition_fragment_C(mma_dkv, Shape<typename L::BN, typename L::HD>{});
  Tensor dq_acc = partition_fragment_C(mma_dq, Shape<typename L::BM, typename L::HD>{});
  Tensor p_frag = make_tensor<Elem>(partition_shape_A(mma_dkv, Shape<typename L::BN, typename L::BM>{}));
  static_assert(decltype(size(s_acc))::value == decltype(size(p_frag))::value, "P^T mirrors S^T element for element");
  // dS^T leaves registers through stmatrix: each 8x8 block of the accumulator layout is 8 keys of
  // 8 consecutive query rows, 16 contiguous bytes of the q-contiguous dS tile.
  auto r2s_ds = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Elem>{}, mma_sdp);
  auto thr_r2s_ds = r2s_ds.get_thread_slice(ct);
  Tensor ds_reg = make_tensor<Elem>(shape(s_acc));
  Tensor ds_src = thr_r2s_ds.retile_S(ds_reg);
  Tensor ds_frag = make_tensor<Elem>(partition_shape_A(mma_dkv, Shape<typename L::BN, typename L::BM>{}));
  // Coordinates (key, q) of each S^T element and (q, column) of each dQ element, (key, column) of dK/dV.
  Tensor s_coord = thr_sdp.partition_C(make_identity_tensor(Shape<typename L::BN, typename L::BM>{}));
  Tensor dq_coord = thr_dq.partition_C(make_identity_tensor(Shape<typename L::BM, typename L::HD>{}));
  Tensor dkv_coord = thr_dkv.partition_C(make_identity_tensor(Shape<typename L::BN, typename L::HD>{}));
  clear(dv_acc);
  clear(dk_acc);
  constexpr int kN = decltype(size(s_acc))::value;  // S^T elements a thread holds

  if (t.steps() > 0) {
    cutlass::arch::ClusterTransactionBarrier::wait(&sm.kv_full, 0);
    RingPos pos;
    // The step's last GEMMs: dK early (the 128-row tiling), or dQ first and dK possibly left
    // running into the next step (kDkOverlap), which then releases this step's stage.
    constexpr bool kDkEarly = Cfg::kDkEarly && FLARE_HOPPER_BWD_DK_RS;
    constexpr bool kDkOverlap = FLARE_HOPPER_BWD_DK_OVERLAP && FLARE_HOPPER_BWD_DQ_FIRST && !kDkEarly;
    int prev_stage = 0;  // kDkOverlap: the stage whose dK GEMM may still run
    (void)prev_stage;
    // Step it's dQ tile, stored, made visible to its writer's bulk copies (FLARE_HOPPER_BWD_DQ_PUBLISH_LATE).
    auto publish_dq = [&](int it) {
      sm90::fence_proxy_async_shared();
      bwd_consumer_arrive(&sm.dq_full[it % Smem::kWriters], lane);
    };
    (void)publish_dq;
    // A dense walk's step count (the same in every thread) through a warp reduction, whose result
    // ptxas keeps in a uniform register: in a vector register it was spilled and reloaded every step
    // at d128 (the main loop's one LDL). The block-sparse kernel's count is kept without it (with it
    // two other registers spilled in its loop).
    const int steps = Tile::kSparse ? t.steps() : __reduce_max_sync(0xffffffffu, t.steps());
    for (int it = 0; it < steps; ++it) {
      const QStep step = t.step_at(it);
      const int q0 = step.m * Cfg::kBlockM;
      const float* lse_log2 = &sm.stats[pos.index * 2 * Cfg::kBlockM];
      const float* dpsum = lse_log2 + Cfg::kBlockM;
      uint32_t lookups = ~0u;
      if constexpr (Tile::kSparse) lookups = bwd_lookups<kN>(hp.bs.element, t, s_coord, q0, step.valid && step.element);
      sm.qdo_ring.wait_full(pos);
      wg_gemm<true>(mma_sdp, k_frag, q_frag(_, _, _, pos.index), s_acc);
      wg_gemm<true>(mma_sdp, v_frag, do_frag(_, _, _, pos.index), dp_acc);
#if FLARE_HOPPER_BWD_DQ_PUBLISH_LATE
      if (it > 0) publish_dq(it - 1);  // the previous step's tile
#endif
      wg_wait<1>(s_acc);
      if constexpr (kDkOverlap) {
        if (it > 0) {  // the previous step's dK is retired too
          cute::warpgroup_fence_operand(dk_acc);
          bwd_consumer_arrive(&sm.qdo_ring.empty[prev_stage], lane);
        }
      }

      // P^T while dP^T finishes, rounded once: the dV GEMM's operand and the factor of dS^T
      // (freeing S^T's registers before dS^T).
#if FLARE_HOPPER_BWD_EXPERIMENT == 1
      CUTE_UNROLL
      for (int i = 0; i < kN; i += 2) frag_pair(p_frag, i) = portable::ElemTraits<T>::pack(s_acc(i), s_acc(i + 1));
#else
      bwd_probs<Cfg, T>(s_acc, s_coord, lse_log2, p.scale_log2, t, q0, p_frag, step, &hp.bs.element, lookups);
#endif
#if FLARE_HOPPER_BWD_EXPERIMENT != 3
      wg_gemm<false>(mma_dkv, p_frag, dot_frag(_, _, _, pos.index), dv_acc);
#endif
      wg_wait<1>(dp_acc);

      // dS^T to shared memory while dV is on the tensor cores; dK and dQ read it there.
      CUTE_UNROLL
      for (int i = 0; i < kN; i += 2) {
#if FLARE_HOPPER_BWD_EXPERIMENT == 1
        frag_pair(ds_reg, i) = portable::ElemTraits<T>::pack(dp_acc(i), dp_acc(i + 1));
#else
        const float2 pv = portable::ElemTraits<T>::unpack(frag_pair(p_frag, i));
        const float2 dps = *reinterpret_cast<const float2*>(&dpsum[get<1>(s_coord(i))]);
        frag_pair(ds_reg, i) =
            portable::ElemTraits<T>::pack(pv.x * (dp_acc(i) - dps.x), pv.y * (dp_acc(i + 1) - dps.y));
#endif
      }
      copy(r2s_ds, ds_src, thr_r2s_ds.partition_D(make_tensor(make_smem_ptr(sm.ds[it % 2].data()), typename L::SmemDSt{})));
      if constexpr (FLARE_HOPPER_BWD_DK_RS) {
        CUTE_UNROLL
        for (int i = 0; i < kN; i += 2) frag_pair(ds_frag, i) = frag_pair(ds_reg, i);  // the dK GEMM's A operand
      }
      Tensor dst_desc = thr_dk.partition_fragment_A(make_tensor(make_smem_ptr(sm.ds[it % 2].data()), typename L::SmemDSt{}));
      Tensor ds_desc =
          thr_dq.partition_fragment_A(make_tensor(make_smem_ptr(sm.ds[it % 2].data()), typename L::SmemDS{}));
      auto issue_dk = [&] {
#if FLARE_HOPPER_BWD_EXPERIMENT != 3
        if constexpr (FLARE_HOPPER_BWD_DK_RS) {
          wg_gemm<false>(mma_dkv, ds_frag, qt_frag_rs(_, _, _, pos.index), dk_acc);
        } else {
          wg_gemm<false>(mma_dk, dst_desc, qt_frag(_, _, _, pos.index), dk_acc);
        }
#endif
      };
      if constexpr (kDkEarly) issue_dk();  // from registers: on the tensor cores while both dS tiles land
      cutlass::arch::fence_view_async_shared();
      consumers_sync();  // both warpgroups' dS are in
      // dQ into the shared tile once the writer has read the previous one, in thread order
      // (hopper_dq_tile_offset): 16-byte stores, consecutive threads consecutive.
      auto store_dq = [&] {
        const int buf = it % Cfg::kDqBufs;
        if (it >= Cfg::kDqBufs) cutlass::arch::ClusterBarrier::wait(&sm.dq_empty[buf], (it / Cfg::kDqBufs - 1) & 1);
        bwd_store_dq_tile<!FLARE_HOPPER_BWD_DQ_PUBLISH_LATE>(sm.dq[buf].data(), dq_acc,
                                                            [&](int i) { return Cfg::dq_tile_offset(ct, i); });
        if constexpr (!FLARE_HOPPER_BWD_DQ_PUBLISH_LATE) bwd_consumer_arrive(&sm.dq_full[it % Smem::kWriters], lane);
      };
      if constexpr (FLARE_HOPPER_BWD_DQ_FIRST && !kDkEarly) {
        // dQ first, and its tile stored while the dK GEMM runs.
#if FLARE_HOPPER_BWD_EXPERIMENT != 2
        wg_gemm<true>(mma_dq, ds_desc, kt_frag, dq_acc);
#endif
        issue_dk();
        wg_wait<1>(dq_acc);
        cute::warpgroup_fence_operand(dv_acc);
        store_dq();
        if constexpr (kDkOverlap) {
          prev_stage = pos.index;  // released once the next step's wait for S^T retires dK
        } else {
          wg_wait<0>(dk_acc);
          bwd_consumer_arrive(&sm.qdo_ring.empty[pos.index], lane);  // the stage is read
        }
        pos.template advance<Cfg::kStages>();
      } else {
        if constexpr (!kDkEarly) issue_dk();
#if FLARE_HOPPER_BWD_EXPERIMENT != 2
        wg_gemm<true>(mma_dq, ds_desc, kt_frag, dq_acc);
#endif
        wg_wait<0>(dq_acc);
        cute::warpgroup_fence_operand(dv_acc);
        cute::warpgroup_fence_operand(dk_acc);
        bwd_consumer_arrive(&sm.qdo_ring.empty[pos.index], lane);  // the stage is read
        pos.template advance<Cfg::kStages>();
        store_dq();
      }
    }
#if FLARE_HOPPER_BWD_DQ_PUBLISH_LATE
    publish_dq(steps - 1);
#endif
    if constexpr (kDkOverlap) {
      wg_wait<0>(dk_acc);
      bwd_consumer_arrive(&sm.qdo_ring.empty[prev_stage], lane);
    }
  }

  bwd_store_dkv<Cfg, T>(P, t, dk_acc, dv_acc, dkv_coord, ct);
}

}  // namespace flare::hopper
