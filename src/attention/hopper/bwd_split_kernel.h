// Hopper attention backward for head dims above 128 (HopperBwdSplitConfig, sm_90a).
//
// A CTA owns 64 keys of one (sequence, q head). Their dK and dV (64 x 256 each) do not fit one
// warpgroup's registers, so the two consumer warpgroups split the head dim and the work of a
// query block of 64 rows (docs/hopper_bwd_d256.md):
//
//     warpgroup 0                                 warpgroup 1
//     S^T = K Q^T                                 dP^T = V dO^T                  (wgmma, k = head dim)
//     P^T = exp2(S^T scale log2e - LSE log2e)     waits for P^T
//       -> shared memory (stmatrix)  ---------->  P^T <- shared memory (ldmatrix)
//                                                 dS^T = P^T (dP^T - rowsum(dO o O))
//                                    <----------    -> shared memory (stmatrix)
//     dV[:, half w] += P^T dO[:, half w]          (wgmma, P^T from registers, both)
//     dK[:, half w] += dS^T Q[:, half w]          (wgmma, dS^T from shared memory, both)
//     dQ[:, half w]  = dS K[:, half w]            (wgmma, both)
//
// Q rides a ring of kQHalves half-tiles (64 rows by 128 columns; the row statistics with a
// block's first half), dO a ring of one. Warpgroup 0 multiplies S^T's first k half while the second
// Q half may still be landing; a half is released once its last reader is done: the second after
// S^T (warpgroup 0) and warpgroup 1's dK GEMM, the first after warpgroup 0's dK GEMM. With three
// halves the next block's first half is in before the step ends and its second loads under the dQ
// GEMM and the next S^T's first half. dO is released as soon as both dV GEMMs are done. Each
// warpgroup's dQ half goes out through its own 32 KB buffer; kDqWriters writer threads take the
// steps in turn, each adding both halves of its steps. In deterministic mode each half is ordered
// by its own semaphore per query block. The producer, the tile walk and the dK/dV epilogue are the
// d <= 128 kernel's (bwd_producer.h, bwd_step.h).
#pragma once

#include <cute/tensor.hpp>
#include <cute/atom/copy_traits_sm90.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include "src/attention/hopper/bwd_dq_writer.h"
#include "src/attention/hopper/bwd_producer.h"
#include "src/attention/hopper/bwd_split_layouts.h"
#include "src/attention/hopper/bwd_step.h"
#include "src/attention/hopper/bwd_tile.h"
#include "src/attention/hopper/smem_struct.h"
#include "src/attention/hopper/stage_ring.h"
#include "src/attention/hopper/wg_gemm.h"
#include "src/common/named_barrier.h"

namespace flare::hopper {

template <typename Cfg, typename T>
struct BwdSplitSmem {
  using L = BwdSplitLayouts<Cfg, T>;
  cute::array_aligned<typename L::Elem, cute::cosize_v<typename L::SmemK>, 1024> k;
  cute::array_aligned<typename L::Elem, cute::cosize_v<typename L::SmemK>, 1024> v;
  cute::array_aligned<typename L::Elem, cute::cosize_v<typename L::SmemQ>, 1024> q;
  cute::array_aligned<typename L::Elem, cute::cosize_v<typename L::SmemDO>, 1024> dout;
  cute::array_aligned<typename L::Elem, cute::cosize_v<typename L::SmemDS>, 1024> p;   // P^T, as dS^T
  cute::array_aligned<typename L::Elem, cute::cosize_v<typename L::SmemDS>, 1024> ds;
  static constexpr int kDqHalf = Cfg::kBlockM * Cfg::kHeadDim / 2;  // floats of one half of a step's dQ tile
  cute::array_aligned<float, 2 * kDqHalf, 128> dq;                 // warpgroup w's half at w kDqHalf
  cute::array_aligned<float, Cfg::kQHalves * 2 * Cfg::kBlockM, 16> stats;  // [slot][LSE log2, dpsum][row]
  uint64_t kv_full;
  StageBarriers<Cfg::kQHalves> q_ring;  // a Q half-tile (a first half: with its block's statistics)
  StageBarriers<1> do_ring;            // dO of one query block
  uint64_t dq_full[2 * Cfg::kDqWriters];  // [half w][writer j]: half w of a step of writer j written
                                          // (warpgroup w's 4 warps)
  uint64_t dq_empty[2];                // warpgroup w's buffer read (its previous half added)
  // Half `half` of step `it` written: the barrier of the writer that takes the step.
  __device__ __forceinline__ uint64_t* dq_full_of(int half, int it) {
    return &dq_full[half * Cfg::kDqWriters + it % Cfg::kDqWriters];
  }
};

template <typename Cfg, typename T>
constexpr int hopper_bwd_split_smem_bytes() {
  return static_cast<int>(sizeof(BwdSplitSmem<Cfg, T>)) + 1024;
}

// Named barriers between the two consumer warpgroups (1 is consumers_sync): P^T and dS^T in shared
// memory.
inline constexpr int kBarPReady = 2, kBarDsReady = 3;

// Producer warp 0 (one thread): K and V once, then per query block Q's first half with the
// statistics, dO (ring of one) and Q's second half, into the ring of kQHalves half-tiles. With three
// halves a block's first half takes the slot of the second half two blocks back (free early), its
// second half that of the previous block's first half (free after both dK GEMMs), so dO, freed
// after the dV GEMMs, goes between them.
template <typename Cfg, typename T>
__device__ __forceinline__ void bwd_split_produce(const HopperBwdParams<Cfg, T>& hp, BwdSplitSmem<Cfg, T>& sm,
                                                  const BwdTile& t) {
  using namespace cute;
  using L = BwdSplitLayouts<Cfg, T>;
  RingPos qpos, dpos;
  auto stats_part = hp.tma_stats.get_slice(_0{});
  bwd_produce_tiles<L, typename L::SmemDOHalves>(hp, sm, t, [&](int m, auto& q_src, auto& q_dst, auto& do_src,
                                                                auto& do_dst, auto& stats_src, int stats_block) {
    uint64_t& q0bar = sm.q_ring.acquire(qpos, L::kQHalfBytes + L::kStatsBytes);
    copy(hp.tma_q.with(q0bar), q_src(_, _, _, m, 0), q_dst(_, _, _, qpos.index));
    copy(hp.tma_stats.with(q0bar), stats_src(_, _, _, stats_block),
         stats_part.partition_D(make_tensor(make_smem_ptr(&sm.stats[qpos.index * 2 * Cfg::kBlockM]), typename L::SmemStats{})));
    qpos.template advance<Cfg::kQHalves>();
    uint64_t& dbar = sm.do_ring.acquire(dpos, L::kQBytes);
    copy(hp.tma_do.with(dbar), do_src(_, _, _, m, 0), do_dst(_, _, _, 0));
    copy(hp.tma_do.with(dbar), do_src(_, _, _, m, 1), do_dst(_, _, _, 1));
    dpos.template advance<1>();
    uint64_t& q1bar = sm.q_ring.acquire(qpos, L::kQHalfBytes);
    copy(hp.tma_q.with(q1bar), q_src(_, _, _, m, 1), q_dst(_, _, _, qpos.index));
    qpos.template advance<Cfg::kQHalves>();
  });
}

// Writer j of W = Cfg::kDqWriters (one thread of producer warp 1 + j) adds both halves of the
// tile's steps j, j + W, j + 2 W, ... In deterministic mode each add waits for its half's turn and
// the turns pass once the adds are performed; a writer's next step starts only after that, so W
// writers keep W handoffs per chain in flight, while the buffers, released as soon as the adds
// have read them, serve the next step's writer.
template <typename Cfg, typename T>
__device__ __forceinline__ void bwd_split_write_dq_steps(const HopperBwdParams<Cfg, T>& hp, BwdSplitSmem<Cfg, T>& sm,
                                                         const BwdTile& t, int j) {
  const detail::BwdKernelParams& P = hp.p;
  const sched::DqSequence dq_seq = sched::dq_sequence(hp.plan, t.seq.seqlen_q, t.seq.seqlen_k, t.b, t.h);
  const sched::DqTurnCursor turns = sched::dq_turn_cursor(hp.plan, dq_seq, t.b, t.h, t.n);
  constexpr uint32_t kBytes = Cfg::kBlockM * (Cfg::kHeadDim / 2) * sizeof(float);
  constexpr int kChains = hopper_bwd_dq_chains(Cfg::kHeadDim);  // the workspace's semaphores per query block
  static_assert(kChains == 2, "a turn chain per dQ half");
  for (int it = j; it < t.steps(); it += Cfg::kDqWriters) {
    const int k = it / Cfg::kDqWriters;  // writer j's k-th step
    const QStep step = t.step_at(it);
    int* sem = FLARE_HOPPER_BWD_EXPERIMENT == 5 ? nullptr
                                                : portable::dq_turn_semaphore(P, t.b, t.h, step.m, kChains);  // half h's chain: sem + h
    float* tile = step.valid ? hopper_dq_tile<Cfg>(P, t.seq.q_start, t.b, t.h, step.m) : nullptr;
    int turn = 0;
    if (sem != nullptr) {
      const DqReplica r = dq_replica(P, sched::dq_turn_at(turns, hp.plan, dq_seq, step.m));
      sem += r.semaphores, turn = r.turn;
      if (tile != nullptr) tile += r.floats;
    }
    const bool store = sem != nullptr && P.dq_first_stores && turn == 0;
    CUTE_UNROLL
    for (int half = 0; half < 2; ++half) {
      cutlass::arch::ClusterBarrier::wait(sm.dq_full_of(half, it), k & 1);
      if (sem != nullptr) wait_for_dq_turn(sem + half, turn);
      if (tile != nullptr)
        dq_tile_put(tile + half * (kBytes / sizeof(float)), sm.dq.data() + half * sm.kDqHalf, kBytes, store);
      sm90::bulk_commit_group();
    }
    sm90::bulk_wait_read<1>();
    cutlass::arch::ClusterBarrier::arrive(&sm.dq_empty[0]);
    sm90::bulk_wait_read<0>();
    cutlass::arch::ClusterBarrier::arrive(&sm.dq_empty[1]);
    if (sem != nullptr) pass_dq_turns(sem, kChains);
  }
}

// Consumer thread ct (0..255; warpgroup w = ct / 128).
template <typename Cfg, typename T>
__device__ __forceinline__ void bwd_split_consume(const HopperBwdParams<Cfg, T>& hp, BwdSplitSmem<Cfg, T>& sm,
                                                  const BwdTile& t, int ct) {
  using namespace cute;
  using L = BwdSplitLayouts<Cfg, T>;
  using Elem = typename L::Elem;
  const detail::BwdKernelParams& P = hp.p;
  const detail::FwdKernelParams& p = P.fwd;
  const int lane = ct % 32, w = ct / 128, wct = ct % 128;

  typename L::MmaSdP mma_sdp;
  typename L::MmaSHalf mma_s;
  typename L::MmaDV mma_dv;
  typename L::MmaDK mma_dk;
  typename L::MmaDQ mma_dq;
  auto thr_sdp = mma_sdp.get_thread_slice(wct);
  auto thr_s = mma_s.get_thread_slice(wct);
  auto thr_dv = mma_dv.get_thread_slice(ct);
  auto thr_dk = mma_dk.get_thread_slice(wct);
  auto thr_dq = mma_dq.get_thread_slice(ct);
  Tensor sQ = make_tensor(make_smem_ptr(sm.q.data()), typename L::SmemQ{});  // (q, half head dim, slot)
  Tensor sQt = make_tensor(make_smem_ptr(sm.q.data()), typename L::SmemQt{});
  Tensor sDO = make_tensor(make_smem_ptr(sm.dout.data()), typename L::SmemDO{});
  Tensor sDOt = make_tensor(make_smem_ptr(sm.dout.data()), typename L::SmemDOt{});
  Tensor sKh = make_tensor(make_smem_ptr(sm.k.data()), typename L::SmemKHalves{});  // (keys, half head dim, half)
  Tensor sV = make_tensor(make_smem_ptr(sm.v.data()), typename L::SmemK{});
  Tensor sKt = make_tensor(make_smem_ptr(sm.k.data()), typename L::SmemKt{});
  Tensor sPt = make_tensor(make_smem_ptr(sm.p.data()), typename L::SmemDSt{});
  Tensor sDSt = make_tensor(make_smem_ptr(sm.ds.data()), typename L::SmemDSt{});
  Tensor sDS = make_tensor(make_smem_ptr(sm.ds.data()), typename L::SmemDS{});

  // Warpgroup 0: S^T from K and Q, a head-dim half at a time; warpgroup 1: dP^T from V and dO.
  Tensor kh_frag = thr_s.partition_fragment_A(sKh);  // (.., half)
  Tensor k0_frag = kh_frag(_, _, _, 0);
  Tensor k1_frag = kh_frag(_, _, _, 1);
  Tensor q_frag = thr_s.partition_fragment_B(sQ);    // (.., slot)
  Tensor v_frag = thr_sdp.partition_fragment_A(sV);
  Tensor do_frag = thr_sdp.partition_fragment_B(sDO);
  Tensor dot_frag = thr_dv.partition_fragment_B(sDOt);
  Tensor qt_frag = thr_dk.partition_fragment_B(sQt);  // (.., slot)
  Tensor kt_frag = thr_dq.partition_fragment_B(sKt);
  Tensor dst_desc = thr_dk.partition_fragment_A(sDSt);
  Tensor ds_desc = thr_dq.partition_fragment_A(sDS);

  Tensor sdp_acc = partition_fragment_C(mma_sdp, Shape<typename L::BN, typename L::BM>{});
  Tensor dv_acc = partition_fragment_C(mma_dv, Shape<typename L::BN, typename L::HD>{});
  Tensor dk_acc = partition_fragment_C(mma_dv, Shape<typename L::BN, typename L::HD>{});
  Tensor dq_acc = partition_fragment_C(mma_dq, Shape<typename L::BM, typename L::HD>{});
  static_assert(decltype(size(dk_acc))::value ==
                    decltype(size(partition_fragment_C(mma_dk, Shape<typename L::BN, typename L::HalfHD>{})))::value,
                "dK's product fills the ColsSplit accumulator");
  Tensor p_frag = make_tensor<Elem>(partition_shape_A(mma_dv, Shape<typename L::BN, typename L::BM>{}));
  static_assert(decltype(size(sdp_acc))::value == decltype(size(p_frag))::value, "P^T mirrors S^T element for element");
  // P^T and dS^T leave registers through stmatrix (8 keys of 8 consecutive query rows: 16 bytes of
  // the q-contiguous tile); warpgroup 1 reads P^T back with ldmatrix into the same fragment layout.
  auto r2s = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Elem>{}, mma_sdp);
  auto s2r = make_tiled_copy_C(Copy_Atom<SM75_U32x4_LDSM_N, Elem>{}, mma_sdp);
  auto thr_r2s = r2s.get_thread_slice(wct);
  auto thr_s2r = s2r.get_thread_slice(wct);
  Tensor ew_reg = make_tensor<Elem>(shape(sdp_acc));  // P^T (warpgroup 0) or dS^T (warpgroup 1), rounded
  Tensor s_coord = thr_sdp.partition_C(make_identity_tensor(Shape<typename L::BN, typename L::BM>{}));
  Tensor dkv_coord = thr_dv.partition_C(make_identity_tensor(Shape<typename L::BN, typename L::HD>{}));
  clear(dv_acc);
  clear(dk_acc);
  constexpr int kN = decltype(size(sdp_acc))::value;

  if (t.steps() > 0) {
    cutlass::arch::ClusterTransactionBarrier::wait(&sm.kv_full, 0);
    RingPos qpos, dpos;
    for (int it = 0; it < t.steps(); ++it) {
      const int m = t.m_at(it);
      const int q0 = m * Cfg::kBlockM;
      const RingPos qa = qpos;  // the block's first Q half, with its statistics
      qpos.template advance<Cfg::kQHalves>();
      const RingPos qb = qpos;  // its second half
      qpos.template advance<Cfg::kQHalves>();
      const float* lse_log2 = &sm.stats[qa.index * 2 * Cfg::kBlockM];
      const float* dpsum = lse_log2 + Cfg::kBlockM;
      sm.q_ring.wait_full(qa);
      if (w == 0) {
        wg_gemm<true>(mma_s, k0_frag, q_frag(_, _, _, qa.index), sdp_acc);
        sm.q_ring.wait_full(qb);
        wg_gemm<false>(mma_s, k1_frag, q_frag(_, _, _, qb.index), sdp_acc);
        wg_wait<0>(sdp_acc);
        __syncwarp();
        if (lane == 0) sm.q_ring.release(qb);  // warpgroup 0 is done with the second half
        sm.do_ring.wait_full(dpos);
      } else {
        sm.do_ring.wait_full(dpos);
        wg_gemm<true>(mma_sdp, v_frag, do_frag, sdp_acc);
        wg_wait<0>(sdp_acc);
      }

      if (w == 0) {
        // P^T, rounded once: dV's operand here and dS^T's factor in warpgroup 1.
        bwd_probs<Cfg, T>(sdp_acc, s_coord, lse_log2, p.scale_log2, t, q0, ew_reg);
        copy(r2s, thr_r2s.retile_S(ew_reg), thr_r2s.partition_D(sPt));
        ::flare::device::named_arrive<kBarPReady>(256);
        CUTE_UNROLL
        for (int i = 0; i < kN; i += 2) frag_pair(p_frag, i) = frag_pair(ew_reg, i);
      } else {
        ::flare::device::named_sync<kBarPReady>(256);
        copy(s2r, thr_s2r.partition_S(sPt), thr_s2r.retile_D(ew_reg));
        CUTE_UNROLL
        for (int i = 0; i < kN; i += 2) {
          frag_pair(p_frag, i) = frag_pair(ew_reg, i);
          const float2 pv = portable::ElemTraits<T>::unpack(frag_pair(ew_reg, i));
          const float2 dps = *reinterpret_cast<const float2*>(&dpsum[get<1>(s_coord(i))]);
          frag_pair(ew_reg, i) =
              portable::ElemTraits<T>::pack(pv.x * (sdp_acc(i) - dps.x), pv.y * (sdp_acc(i + 1) - dps.y));
        }
        copy(r2s, thr_r2s.retile_S(ew_reg), thr_r2s.partition_D(sDSt));
        cutlass::arch::fence_view_async_shared();
        ::flare::device::named_arrive<kBarDsReady>(256);
        sm.q_ring.wait_full(qb);  // dK's half of Q
      }
      wg_gemm<false>(mma_dv, p_frag, dot_frag, dv_acc);
      if (w == 0) ::flare::device::named_sync<kBarDsReady>(256);  // dS^T is in shared memory
      wg_gemm<false>(mma_dk, dst_desc, qt_frag(_, _, _, w == 0 ? qa.index : qb.index), dk_acc);
      wg_gemm<true>(mma_dq, ds_desc, kt_frag, dq_acc);
      wg_wait<2>(dv_acc);  // dV done: dO is free
      __syncwarp();
      if (lane == 0) sm.do_ring.release(dpos);
      dpos.template advance<1>();
      wg_wait<1>(dk_acc);  // dK done: its Q half is free while the dQ GEMM runs
      __syncwarp();
      if (lane == 0) {
        sm.q_ring.release(qa);  // warpgroup 1 read the statistics only
        if (w == 1) sm.q_ring.release(qb);
      }
      wg_wait<0>(dq_acc);
      cute::warpgroup_fence_operand(dv_acc);
      cute::warpgroup_fence_operand(dk_acc);

      // dQ half w into its own buffer once its writer has read the previous step's.
      if (it > 0) cutlass::arch::ClusterBarrier::wait(&sm.dq_empty[w], (it - 1) & 1);
      bwd_store_dq_tile(sm.dq.data() + w * sm.kDqHalf, dq_acc,
                        [&](int i) { return detail::hopper_dq_tile_offset(128, wct, i); });
      __syncwarp();
      if (lane == 0) cutlass::arch::ClusterBarrier::arrive(sm.dq_full_of(w, it));
    }
  }
  bwd_store_dkv<Cfg, T>(P, t, dk_acc, dv_acc, dkv_coord, ct);
}

template <typename Cfg, typename T>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
    hopper_bwd_split_kernel(const __grid_constant__ HopperBwdParams<Cfg, T> hp) {
  extern __shared__ unsigned char smem_raw[];
  auto& sm = smem_struct<BwdSplitSmem<Cfg, T>>(smem_raw);
  const int warp = threadIdx.x / 32, wg = warp / 4;
  if (threadIdx.x == 0) {
    cutlass::arch::ClusterTransactionBarrier::init(&sm.kv_full, 1);
    sm.q_ring.init(4 * Cfg::kConsumerWGs);
    sm.do_ring.init(4 * Cfg::kConsumerWGs);
    for (int i = 0; i < 2 * Cfg::kDqWriters; ++i) cutlass::arch::ClusterBarrier::init(&sm.dq_full[i], 4);
    for (int i = 0; i < 2; ++i) cutlass::arch::ClusterBarrier::init(&sm.dq_empty[i], 1);
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();
  const BwdTile tile = bwd_tile_of<Cfg>(hp);
  if (tile.keys <= 0) return;
  if (wg == 0) {
    cutlass::arch::warpgroup_reg_dealloc<Cfg::kProducerRegs>();
    if (warp == 0 && tile.steps() > 0 && cute::elect_one_sync()) bwd_split_produce<Cfg, T>(hp, sm, tile);
    if (warp >= 1 && warp <= Cfg::kDqWriters && cute::elect_one_sync())
      bwd_split_write_dq_steps<Cfg, T>(hp, sm, tile, warp - 1);
  } else {
    cutlass::arch::warpgroup_reg_alloc<Cfg::kConsumerRegs>();
    bwd_split_consume<Cfg, T>(hp, sm, tile, threadIdx.x - 128);
  }
}

}  // namespace flare::hopper
