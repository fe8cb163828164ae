// Hopper attention backward (sm_90a): warp-specialized, TMA-fed, wgmma-computed.
//
// A CTA owns kBlockN keys of one (sequence, q head). Warp 0 of the producer warpgroup loads K and
// V once, then, per query block that sees these keys, Q, dO and the block's row statistics (LSE
// in log2 units, rowsum(dO o O)) into a ring of stages. Each consumer warpgroup owns 64 keys and,
// per query block of kBlockM rows (64, or 128 at head dims up to 64),
//
//     S^T = K Q^T,  dP^T = V dO^T                     (wgmma, shared x shared; both issued)
//     P^T = exp2(S^T scale log2e - LSE log2e)          (while dP^T is on the tensor cores)
//     dV += P^T dO                                     (wgmma, P^T from registers; issued)
//     dS^T = P^T (dP^T - rowsum(dO o O))               (while dV is on the tensor cores; to
//                                                       shared memory)
//     dK += dS^T Q                                     (wgmma, dS^T from registers)
//     dQ[:, half w] = dS K[:, half w]                  (wgmma, shared x shared, both warpgroups'
//                                                       keys; 128-row steps: dQ[half w, :])
//
// dQ (unscaled: the conversion applies the softmax scale) goes to a shared fp32 tile (kDqBufs of
// them, alternating by step), handed on once the next step's S^T and dP^T are issued; one thread
// of producer warp 1 + (step mod W) (W writers: Cfg::kDqWriters, deterministic kDetDqWriters) adds
// it into dq_accum with one bulk reduction (cp.reduce.async.bulk), so the consumers never wait on
// global memory. In deterministic mode that writer waits for the query block's turn (a semaphore
// per (sequence, head, query block); turns and walks from src/scheduling/dq_turns.h, the grid in
// its tile order) and hands the turn on once its add is complete; W writers keep W such handoffs
// in flight. dK (scaled) and dV leave registers at the end: stored, or added into fp32
// accumulators under GQA (in q-head order when deterministic). The pre-pass (dpsum and the padded
// statistics) and dsinks are the portable backward's.
//
// With a block mask (kSparse) the query steps come from the CTA's kv block's transposed lists (the
// q blocks that see it: partial ones first, with the element predicate, then full ones), each q
// block q_block_size / 64 steps (list_steps.h); a listed block out of range (device lists are not
// validated) or a step past the sequence is computed fully masked and adds nothing. Deterministic
// mode follows the mask's plan (dq_write_order.h) as the portable kernel does: a 1D grid in the
// plan's schedule, CTA x key slice x % key_slices of the tile at position x / key_slices, its walk
// the plan's, each 64-row step's dQ added on that step's semaphore at the plan's turn (a step that
// adds nothing, and a CTA without keys, still take their turns), GQA's dK/dV at the plan's turn.
//
// The producer is bwd_producer.h's, the consumers bwd_consumer.h's (their step operations, shared
// with the split tiling, bwd_step.h's), the dQ writers bwd_dq_writer.h's; the parameters and a
// CTA's tile and walk are bwd_tile.h's.
#pragma once

#include <cuda_runtime.h>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include "src/attention/bwd_params.h"
#include "src/attention/hopper/bwd_config.h"
#include "src/attention/hopper/bwd_consumer.h"
#include "src/attention/hopper/bwd_dq_writer.h"
#include "src/attention/hopper/bwd_layouts.h"
#include "src/attention/hopper/bwd_producer.h"
#include "src/attention/hopper/bwd_split_layouts.h"
#include "src/attention/hopper/bwd_step.h"
#include "src/attention/hopper/bwd_tile.h"
#include "src/attention/hopper/smem_struct.h"
#include "src/attention/hopper/stage_ring.h"

namespace flare::hopper {

template <typename Cfg, typename T, int kWriters_ = Cfg::kDqWriters>
struct BwdSmem {
  using L = BwdLayouts<Cfg, T>;
  static constexpr int kWriters = kWriters_;  // dQ writer threads
  cute::array_aligned<typename L::Elem, cute::cosize_v<typename L::SmemK>, 1024> k;
  cute::array_aligned<typename L::Elem, cute::cosize_v<typename L::SmemK>, 1024> v;
  cute::array_aligned<typename L::Elem, cute::cosize_v<typename L::SmemQ>, 1024> q;
  cute::array_aligned<typename L::Elem, cute::cosize_v<typename L::SmemQ>, 1024> dout;
  cute::array_aligned<typename L::Elem, cute::cosize_v<typename L::SmemDS>, 1024> ds[2];
  cute::array_aligned<float, Cfg::kBlockM * Cfg::kHeadDim, 128> dq[Cfg::kDqBufs];  // step it's dQ tile in dq[it % kDqBufs], fp32, thread order
  cute::array_aligned<float, Cfg::kStages * 2 * Cfg::kBlockM, 16> stats;  // [stage][LSE log2, dpsum][row]
  uint64_t kv_full;
  StageBarriers<Cfg::kStages> qdo_ring;  // a stage holds Q, dO and the row statistics of one query block
  // Step it's dQ tile: written by the 8 consumer warps (dq_full of its writer, it % kWriters) /
  // read by the bulk add (dq_empty of its tile, it % kDqBufs).
  uint64_t dq_full[kWriters], dq_empty[Cfg::kDqBufs];
};

template <typename Cfg, typename T>
constexpr int hopper_bwd_smem_bytes() {
  constexpr size_t ord = sizeof(BwdSmem<Cfg, T, Cfg::kDqWriters>), det = sizeof(BwdSmem<Cfg, T, Cfg::kDetDqWriters>);
  return static_cast<int>(ord > det ? ord : det) + 1024;
}

// Writer j's share (producer warp 1 + j) of the d <= 128 tiling's dQ tiles.
template <typename Cfg, typename Smem>
__device__ __forceinline__ DqWriterPart bwd_dq_writer_part(Smem& sm, int j) {
  DqWriterPart part;
  part.smem = sm.dq[0].data();
  part.tile_floats = static_cast<int>(sizeof(sm.dq[0]) / sizeof(float));
  part.tiles = Cfg::kDqBufs;
  part.full = &sm.dq_full[j];
  part.empty = sm.dq_empty;
  part.first_step = j;
  part.step_stride = Smem::kWriters;
  part.bytes = Cfg::kBlockM * Cfg::kHeadDim * sizeof(float);
  return part;
}

// kWriters: the dQ writer threads, Cfg::kDqWriters or, for the deterministic mode, kDetDqWriters.
template <typename Cfg, typename T, bool kSparse = false, int kWriters = Cfg::kDqWriters>
__global__ void __launch_bounds__(Cfg::kThreads, 1) hopper_bwd_kernel(const __grid_constant__ HopperBwdParams<Cfg, T> hp) {
  extern __shared__ unsigned char smem_raw[];
  auto& sm = smem_struct<BwdSmem<Cfg, T, kWriters>>(smem_raw);
  const int warp = threadIdx.x / 32, wg = warp / 4;
  if (threadIdx.x == 32) {  // the tensor maps fetched while the barriers are set up
    cute::prefetch_tma_descriptor(hp.tma_q.get_tma_descriptor());
    cute::prefetch_tma_descriptor(hp.tma_do.get_tma_descriptor());
    cute::prefetch_tma_descriptor(hp.tma_k.get_tma_descriptor());
    cute::prefetch_tma_descriptor(hp.tma_v.get_tma_descriptor());
    cute::prefetch_tma_descriptor(hp.tma_stats.get_tma_descriptor());
  }
  if (threadIdx.x == 0) {
    cutlass::arch::ClusterTransactionBarrier::init(&sm.kv_full, 1);
    sm.qdo_ring.init(kBwdArrivalsPerWG * Cfg::kConsumerWGs);
    for (int i = 0; i < kWriters; ++i)
      cutlass::arch::ClusterBarrier::init(&sm.dq_full[i], kBwdArrivalsPerWG * Cfg::kConsumerWGs);
    for (int i = 0; i < Cfg::kDqBufs; ++i) cutlass::arch::ClusterBarrier::init(&sm.dq_empty[i], 1);
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();
  const BwdTileT<kSparse> tile = bwd_tile_of<Cfg, kSparse>(hp);
  if (tile.keys <= 0) {
    if constexpr (kSparse) {
      if (hp.p.deterministic && threadIdx.x == 0) pass_sparse_turns(hp, tile);
    }
    return;
  }
  if (wg == 0) {
    cutlass::arch::warpgroup_reg_dealloc<Cfg::kProducerRegs>();
    if (warp == 0 && tile.steps() > 0 && cute::elect_one_sync()) bwd_produce<Cfg, T>(hp, sm, tile);
#if FLARE_HOPPER_BWD_EXPERIMENT == 2
    if (warp == 1) {  // releases the dQ tile without adding it
      for (int it = 0; it < tile.steps(); ++it) {
        cutlass::arch::ClusterBarrier::wait(&sm.dq_full[it % kWriters], (it / kWriters) & 1);
        if (threadIdx.x % 32 == 0) cutlass::arch::ClusterBarrier::arrive(&sm.dq_empty[it % Cfg::kDqBufs]);
      }
    }
#else
    if (warp >= 1 && warp <= kWriters && cute::elect_one_sync())
      bwd_write_dq<Cfg>(hp, tile, bwd_dq_writer_part<Cfg>(sm, warp - 1));
#endif
  } else {
    cutlass::arch::warpgroup_reg_alloc<Cfg::kConsumerRegs>();
    bwd_consume<Cfg, T>(hp, sm, tile, threadIdx.x - 128);
  }
}

// A split tile's dK (scaled) and dV from their fp32 sums in dkv_tail (sched::tail_split; no GQA)
// to the outputs: one CTA per split tile, two elements a thread at a time.
template <typename Cfg, typename T>
__global__ void hopper_dkv_tail_convert_kernel(const detail::BwdKernelParams P) {
  const detail::FwdKernelParams& p = P.fwd;
  const sched::TileCoord c = ordinary_bwd_tile(P, P.tail.whole + blockIdx.x);
  const int h = c.head, b = c.batch;
  const detail::SeqInfo seq = detail::seq_info(p, b);
  const int col0 = c.block * Cfg::kBlockN;
  const int keys = seq.seqlen_k - col0 < Cfg::kBlockN ? seq.seqlen_k - col0 : Cfg::kBlockN;
  const float* dk = P.dkv_tail + int64_t{blockIdx.x} * Cfg::kBlockN * p.head_dim;
  const float* dv = dk + P.tail.tiles * Cfg::kBlockN * p.head_dim;
  for (int e = 2 * threadIdx.x; e < keys * p.head_dim; e += 2 * blockDim.x) {
    const int key = e / p.head_dim, col = e % p.head_dim;  // head dims are even: a pair stays in its row
    T* dkp = static_cast<T*>(P.dk) + detail::row_offset(P.dk_str, b, seq.k_start + col0 + key, h) + col;
    T* dvp = static_cast<T*>(P.dv) + detail::row_offset(P.dv_str, b, seq.k_start + col0 + key, h) + col;
    *reinterpret_cast<uint32_t*>(dkp) = portable::ElemTraits<T>::pack(dk[e], dk[e + 1]);
    *reinterpret_cast<uint32_t*>(dvp) = portable::ElemTraits<T>::pack(dv[e], dv[e + 1]);
  }
}

// Four floats of dq_accum at `at` in the first copy: their sum over the copies, in copy order.
// `copies`: bit r set where copy r holds adds (dq_accum_copies).
__device__ __forceinline__ float4 dq_accum_load4(const detail::BwdKernelParams& P, const float* at, uint32_t copies) {
  float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int r = 0; r < P.dq_replicas; ++r) {
    if (!(copies >> r & 1u)) continue;
    const float4 u = *reinterpret_cast<const float4*>(at + r * P.dq_replica_floats);
    v.x += u.x, v.y += u.y, v.z += u.z, v.w += u.w;
  }
  return v;
}

// The copies of dq_accum that hold adds, per dQ chain c (bits 4 c + r, copy r), for the 64-row
// query block m64 (`step_m64`: its step's first block, whose semaphores the chains use): every
// copy, unless the first turns stored (dq_first_stores), where a copy counts once its semaphore
// has moved (a copy no turn reached was never written).
template <typename Cfg>
__device__ __forceinline__ uint32_t dq_accum_copies(const detail::BwdKernelParams& P, int b, int h, int step_m64) {
  constexpr int kChains = hopper_bwd_dq_chains(Cfg::kHeadDim);
  static_assert(kChains <= 8, "4 bits a chain");
  if (!P.dq_first_stores) return ~0u;
  const int* sem = portable::dq_turn_semaphore(P, b, h, step_m64, kChains);
  uint32_t copies = 0;
  for (int c = 0; c < kChains; ++c)
    for (int r = 0; r < P.dq_replicas; ++r)
      if (sem[c + r * P.dq_replica_semaphores] > 0) copies |= 1u << (4 * c + r);
  return copies;
}
// Chain bits of `copies` for dQ column col.
template <typename Cfg>
__device__ __forceinline__ uint32_t dq_chain_copies(uint32_t copies, int col) {
  constexpr int kChains = hopper_bwd_dq_chains(Cfg::kHeadDim);
  return copies >> (4 * (col / (Cfg::kHeadDim / kChains))) & 0xFu;
}

// dQ from the tiles of dq_accum, times the softmax scale, to the output dtype through dq's strides:
// one CTA of the consumer warpgroups' size per (kBlockM-row query block, head, sequence); each thread reads
// its own elements back and finds their (row, column) through the dQ GEMM's partition (with 128-row
// steps a thread's rows lie in one 64-row block, whose tile it reads).
template <typename Cfg, typename T>
__global__ void __launch_bounds__(Cfg::kConsumerWGs * 128) hopper_dq_convert_kernel(const detail::BwdKernelParams P) {
  using namespace cute;
  using L = BwdLayoutsFor<Cfg, T>;
  const detail::FwdKernelParams& p = P.fwd;
  const int m = blockIdx.x, h = blockIdx.y, b = blockIdx.z, ct = threadIdx.x;
  const detail::SeqInfo seq = detail::seq_info(p, b);
  typename L::MmaDQ mma_dq;
  Tensor dq_coord = mma_dq.get_thread_slice(ct).partition_C(make_identity_tensor(Shape<typename L::BM, typename L::HD>{}));
  const int half = get<0>(dq_coord(0)) / detail::kRowStatsBlockM;  // the 64-row block of the thread's rows
  if (m * Cfg::kBlockM + half * detail::kRowStatsBlockM >= seq.seqlen_q) return;
  const float* tile = hopper_dq_tile<Cfg>(P, seq.q_start, b, h, m * Cfg::kRowBlocks + half);
  if (tile == nullptr) return;
  tile -= half * detail::kRowStatsBlockM * Cfg::kHeadDim;  // Cfg::dq_tile_offset counts from the step's first block
  const uint32_t copies = dq_accum_copies<Cfg>(P, b, h, m * Cfg::kRowBlocks);
  // As bwd_store_dkv: where dQ's rows are 16-byte aligned and the fragment has the accumulator's
  // rows, 16 x 16 blocks through the quad transpose (accumulator_piece), one 16-byte store a lane.
  T* dq0 = static_cast<T*>(P.dq) + detail::row_offset(P.dq_str, b, seq.q_start + m * Cfg::kBlockM, h);
  if (warp_has_accumulator_rows(dq_coord, rows_16b_aligned(dq0, P.dq_str.row))) {
    const int t4 = ct % 4, my_row = get<0>(dq_coord(0)) + 8 * (t4 / 2);
    const int my_col = get<1>(dq_coord(0)) - 2 * t4 + 8 * (t4 % 2);
    T* dst = dq0 + static_cast<int64_t>(my_row) * P.dq_str.row + my_col;
    const bool row_ok = m * Cfg::kBlockM + my_row < seq.seqlen_q;
    CUTE_UNROLL
    for (int blk = 0; blk < size(dq_coord) / 8; ++blk) {  // elements 8 blk .. 8 blk + 7, two float4
      const uint32_t chain = dq_chain_copies<Cfg>(copies, get<1>(dq_coord(8 * blk)));
      const float4 lo = dq_accum_load4(P, tile + Cfg::dq_tile_offset(ct, 8 * blk), chain);
      const float4 hi = dq_accum_load4(P, tile + Cfg::dq_tile_offset(ct, 8 * blk + 4), chain);
      const float e[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
      const uint4 v = accumulator_piece<T>([&](int i) { return e[i % 8]; }, blk, p.scale, p.scale, t4);
      if (row_ok && my_col + 16 * blk < p.head_dim) *reinterpret_cast<uint4*>(dst + 16 * blk) = v;
    }
    return;
  }
  CUTE_UNROLL
  for (int i = 0; i < size(dq_coord); i += 4) {
    const float4 v =
        dq_accum_load4(P, tile + Cfg::dq_tile_offset(ct, i), dq_chain_copies<Cfg>(copies, get<1>(dq_coord(i))));
    const float vals[4] = {v.x, v.y, v.z, v.w};
    CUTE_UNROLL
    for (int e = 0; e < 4; e += 2) {
      const int q = m * Cfg::kBlockM + get<0>(dq_coord(i + e)), col = get<1>(dq_coord(i + e));
      if (q >= seq.seqlen_q || col >= p.head_dim) continue;
      T* dst = static_cast<T*>(P.dq) + detail::row_offset(P.dq_str, b, seq.q_start + q, h) + col;
      *reinterpret_cast<uint32_t*>(dst) = portable::ElemTraits<T>::pack(vals[e] * p.scale, vals[e + 1] * p.scale);
    }
  }
}

}  // namespace flare::hopper
