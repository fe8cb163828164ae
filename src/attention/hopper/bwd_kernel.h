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
// The parameters and a CTA's tile and walk are bwd_tile.h's; the dQ writers, bwd_dq_writer.h's.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <type_traits>

#include <cute/tensor.hpp>
#include <cute/atom/copy_traits_sm90.hpp>
#include <cutlass/arch/reg_reconfig.h>

#include "src/attention/bwd_params.h"
#include "src/attention/hopper/bwd_config.h"
#include "src/attention/hopper/bwd_dq_writer.h"
#include "src/attention/hopper/bwd_layouts.h"
#include "src/attention/hopper/bwd_split_layouts.h"
#include "src/attention/hopper/bwd_tile.h"
#include "src/attention/hopper/element_lookups.h"
#include "src/attention/hopper/online_softmax.h"
#include "src/attention/hopper/smem_struct.h"
#include "src/attention/hopper/stage_ring.h"
#include "src/attention/hopper/wg_gemm.h"
#include "src/attention/portable/bwd_kernel.h"
#include "src/attention/portable/warp_mma.h"
#include "src/block_sparse/block_sparse_params.h"
#include "src/block_sparse/list_steps.h"
#include "src/common/bulk_copy.h"
#include "src/common/quad_transpose.h"
#include "src/common/turn_semaphore.h"

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

// The consumers' arrivals per warpgroup on a per-step barrier (a Q/dO stage's release, a dQ tile's
// full), and a consumer thread's part in one: lane 0 of each warp, after the warp's accesses.
// (Every thread arriving, as the forward's Q stage does, measured the same here: bench/RESULTS.md,
// session 33.)
inline constexpr int kBwdArrivalsPerWG = 4;
__device__ __forceinline__ void bwd_consumer_arrive(uint64_t* bar, int lane) {
  __syncwarp();  // every lane's accesses precede lane 0's arrive
  if (lane == 0) cutlass::arch::ClusterBarrier::arrive(bar);
}

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

// Producer warp 0 (one thread) of both backward tilings: K and V once, then per step of the walk
// `step_loads(m, q_src, q_dst, do_src, do_dst, stats_src, stats_block)`, which issues that query
// block's Q, dO and row statistics (stats_src's 64-row blocks from stats_block on) into the
// tiling's rings. The sources are (.., query block, piece) in pieces of
// L::QLoadShape (the whole head dim, or the split tiling's halves); q_dst is (.., L::SmemQ's last
// mode) and do_dst (.., SmemDO's). SmemDO: dO's shared-memory layout.
template <typename L, typename SmemDO, typename Params, typename Smem, typename Tile, typename StepLoads>
__device__ __forceinline__ void bwd_produce_tiles(const Params& hp, Smem& sm, const Tile& t, StepLoads&& step_loads) {
  using namespace cute;
  const detail::FwdKernelParams& p = hp.p.fwd;
  const bool varlen = p.cu_seqlens_q != nullptr;
  const int hk = t.h / p.group, bt = varlen ? 0 : t.b;
  Tensor mQ = domain_offset(make_coord(int32_t(t.seq.q_start), _0{}), hp.tma_q.get_tma_tensor(hp.shape_q)(_, _, t.h, bt));
  Tensor mDO = domain_offset(make_coord(int32_t(t.seq.q_start), _0{}), hp.tma_do.get_tma_tensor(hp.shape_q)(_, _, t.h, bt));
  Tensor mK = domain_offset(make_coord(int32_t(t.seq.k_start), _0{}), hp.tma_k.get_tma_tensor(hp.shape_k)(_, _, hk, bt));
  Tensor mV = domain_offset(make_coord(int32_t(t.seq.k_start), _0{}), hp.tma_v.get_tma_tensor(hp.shape_k)(_, _, hk, bt));
  Tensor gQ = local_tile(mQ, typename L::QLoadShape{}, make_coord(_, _));  // (BM, piece columns, m, piece)
  Tensor gDO = local_tile(mDO, typename L::QLoadShape{}, make_coord(_, _));
  Tensor gK = local_tile(mK, Shape<typename L::BN, typename L::HD>{}, make_coord(t.n, _0{}));
  Tensor gV = local_tile(mV, Shape<typename L::BN, typename L::HD>{}, make_coord(t.n, _0{}));
  Tensor sQ = make_tensor(make_smem_ptr(sm.q.data()), typename L::SmemQ{});
  Tensor sDO = make_tensor(make_smem_ptr(sm.dout.data()), SmemDO{});
  Tensor sK = make_tensor(make_smem_ptr(sm.k.data()), typename L::SmemK{});
  Tensor sV = make_tensor(make_smem_ptr(sm.v.data()), typename L::SmemK{});
  auto q_part = hp.tma_q.get_slice(_0{});
  auto do_part = hp.tma_do.get_slice(_0{});
  auto k_part = hp.tma_k.get_slice(_0{});
  auto v_part = hp.tma_v.get_slice(_0{});
  // Row statistics: block (b, h, m) of row_stats is column (b heads + h) num_m_blocks + m.
  auto stats_part = hp.tma_stats.get_slice(_0{});
  Tensor stats_src = stats_part.partition_S(
      local_tile(hp.tma_stats.get_tma_tensor(hp.shape_stats), Shape<typename L::StatsBlock, _1>{}, make_coord(_0{}, _)));
  const int stats_block0 = (t.b * p.heads + t.h) * hp.p.num_m_blocks;

  cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&sm.kv_full, 2 * L::kKBytes);
  copy(hp.tma_k.with(sm.kv_full), k_part.partition_S(gK), k_part.partition_D(sK));
  copy(hp.tma_v.with(sm.kv_full), v_part.partition_S(gV), v_part.partition_D(sV));
  Tensor q_src = q_part.partition_S(gQ);
  Tensor q_dst = q_part.partition_D(sQ);
  Tensor do_src = do_part.partition_S(gDO);
  Tensor do_dst = do_part.partition_D(sDO);
  for (int step = 0; step < t.steps(); ++step) {
    const int m = t.m_at(step);
    step_loads(m, q_src, q_dst, do_src, do_dst, stats_src, stats_block0 + m * L::kRowBlocks);
  }
}

// The d <= 128 tiling: Q, dO and the statistics share one ring of kStages stages.
template <typename Cfg, typename T, typename Smem, typename Tile>
__device__ __forceinline__ void bwd_produce(const HopperBwdParams<Cfg, T>& hp, Smem& sm, const Tile& t) {
  using namespace cute;
  using L = BwdLayouts<Cfg, T>;
  RingPos pos;
  auto stats_part = hp.tma_stats.get_slice(_0{});
  bwd_produce_tiles<L, typename L::SmemQ>(hp, sm, t, [&](int m, auto& q_src, auto& q_dst, auto& do_src, auto& do_dst,
                                                          auto& stats_src, int stats_block) {
    uint64_t& bar = sm.qdo_ring.acquire(pos, 2 * L::kQBytes + L::kStatsBytes);
    copy(hp.tma_q.with(bar), q_src(_, _, _, m, 0), q_dst(_, _, _, pos.index));
    copy(hp.tma_do.with(bar), do_src(_, _, _, m, 0), do_dst(_, _, _, pos.index));
    // [LSE of the step's rows, dpsum of its rows]: with two 64-row blocks, each block's halves apart.
    float* stage_stats = &sm.stats[pos.index * 2 * Cfg::kBlockM];
    CUTE_UNROLL
    for (int r = 0; r < L::kRowBlocks; ++r) {
      CUTE_UNROLL
      for (int piece = 0; piece < L::kStatsPieces; ++piece) {
        float* dst = stage_stats + (L::kStatsPieces == 1 ? 0 : piece * Cfg::kBlockM + r * detail::kRowStatsBlockM);
        copy(hp.tma_stats.with(bar), stats_src(_, _, _, (stats_block + r) * L::kStatsPieces + piece),
             stats_part.partition_D(make_tensor(make_smem_ptr(dst), typename L::SmemStats{})));
      }
    }
    pos.template advance<Cfg::kStages>();
  });
}

__device__ __forceinline__ void consumers_sync() { asm volatile("bar.sync 1, 256;" ::: "memory"); }

// Whether a thread's fragment, given by its coordinate tensor `coord` (row, column of each
// element), lies as a warp's rows of a wgmma accumulator (element 4 j + 2 r + c at row row0 + 8 r,
// column col0 + 8 j + c, with (row0, col0) = coord(0)), as accumulator_piece takes it: true only
// where the whole warp's does (the quad transpose's shuffles need the whole warp).
template <typename Coord>
__device__ __forceinline__ bool warp_has_accumulator_rows(const Coord& coord, bool ok) {
  using namespace cute;
  const int row0 = get<0>(coord(0)), col0 = get<1>(coord(0));
  ok = ok && size(coord) % 8 == 0;
  CUTE_UNROLL
  for (int i = 0; i < size(coord); i += 2)
    ok = ok && get<0>(coord(i)) == row0 + 8 * ((i / 2) % 2) && get<1>(coord(i)) == col0 + 8 * (i / 4);
  return __all_sync(0xffffffffu, ok);
}

// dK (scaled) and dV from the consumers' registers: stored, or added into the fp32 accumulators
// under GQA (in q-head order, one turn per head of the group, when deterministic; a block mask's
// plan gives the semaphore and turn). ct: the consumer thread (0..255); dkv_coord: the (key,
// column) of each accumulator element.
template <typename Cfg, typename T, typename Tile, typename AccK, typename AccV, typename Coord>
__device__ __forceinline__ void bwd_store_dkv(const detail::BwdKernelParams& P, const Tile& t, const AccK& dk_acc,
                                              const AccV& dv_acc, const Coord& dkv_coord, int ct) {
  using namespace cute;
  const detail::FwdKernelParams& p = P.fwd;
  const bool gqa = p.group > 1;
  const int hk = t.h / p.group;
  int* sem;
  int turn;
  if constexpr (Tile::kSparse) {
    sem = t.dkv_sem;
    turn = t.dkv_turn;
  } else {
    sem = (gqa && P.deterministic) ? P.dkv_semaphore + (int64_t{t.b} * p.heads_kv + hk) * P.num_n_blocks + t.n : nullptr;
    turn = t.h % p.group;
  }
  if (sem != nullptr) {
    if (ct == 0) device_sync::wait_for_turn(sem, turn);
    consumers_sync();
  }
  if (t.dkv_part != nullptr) {  // a split tile's part: fp32 sums, converted after the grid
    const int64_t dv_off = P.tail.tiles * Cfg::kBlockN * p.head_dim;
    CUTE_UNROLL
    for (int i = 0; i < size(dk_acc); i += 2) {
      const int key = get<0>(dkv_coord(i)), col = get<1>(dkv_coord(i));
      if (key >= t.keys || col >= p.head_dim) continue;
      float* at = t.dkv_part + key * p.head_dim + col;
      portable::red_add_f32x2(at, dk_acc(i) * p.scale, dk_acc(i + 1) * p.scale);
      portable::red_add_f32x2(at + dv_off, dv_acc(i), dv_acc(i + 1));
    }
    return;
  }
  // Without GQA, where the rows are 16-byte aligned and the fragment has the accumulator's rows,
  // each 16 x 16 block leaves through the quad transpose (accumulator_piece), one 16-byte store a
  // lane; elsewhere in 4-byte pairs.
  bool stored = false;
  if (!gqa) {
    T* dk0 = static_cast<T*>(P.dk) + detail::row_offset(P.dk_str, t.b, t.seq.k_start + t.col0, hk);
    T* dv0 = static_cast<T*>(P.dv) + detail::row_offset(P.dv_str, t.b, t.seq.k_start + t.col0, hk);
    if (warp_has_accumulator_rows(dkv_coord, rows_16b_aligned(dk0, P.dk_str.row) && rows_16b_aligned(dv0, P.dv_str.row))) {
      const int t4 = ct % 4, my_key = get<0>(dkv_coord(0)) + 8 * (t4 / 2);
      const int my_col = get<1>(dkv_coord(0)) - 2 * t4 + 8 * (t4 % 2);  // the quad's first column, then this lane's half
      T* dkr = dk0 + static_cast<int64_t>(my_key) * P.dk_str.row;
      T* dvr = dv0 + static_cast<int64_t>(my_key) * P.dv_str.row;
      CUTE_UNROLL
      for (int b = 0; b < size(dk_acc) / 8; ++b) {  // 16-column blocks
        const uint4 vk = accumulator_piece<T>([&](int i) { return dk_acc(i); }, b, p.scale, p.scale, t4);
        const uint4 vv = accumulator_piece<T>([&](int i) { return dv_acc(i); }, b, 1.f, 1.f, t4);
        if (my_key < t.keys && my_col + 16 * b < p.head_dim) {
          *reinterpret_cast<uint4*>(dkr + my_col + 16 * b) = vk;
          *reinterpret_cast<uint4*>(dvr + my_col + 16 * b) = vv;
        }
      }
      stored = true;
    }
  }
  if (!stored) {
    CUTE_UNROLL
    for (int i = 0; i < size(dk_acc); i += 2) {
      const int key = get<0>(dkv_coord(i)), col = get<1>(dkv_coord(i));
      if (key >= t.keys || col >= p.head_dim) continue;
      const float k0 = dk_acc(i) * p.scale, k1 = dk_acc(i + 1) * p.scale;
      const float v0 = dv_acc(i), v1 = dv_acc(i + 1);
      if (!gqa) {
        T* dkp = static_cast<T*>(P.dk) + detail::row_offset(P.dk_str, t.b, t.seq.k_start + t.col0 + key, hk) + col;
        T* dvp = static_cast<T*>(P.dv) + detail::row_offset(P.dv_str, t.b, t.seq.k_start + t.col0 + key, hk) + col;
        *reinterpret_cast<uint32_t*>(dkp) = portable::ElemTraits<T>::pack(k0, k1);
        *reinterpret_cast<uint32_t*>(dvp) = portable::ElemTraits<T>::pack(v0, v1);
      } else {
        const int64_t off = (detail::accum_row(p, t.b, t.seq.k_start, t.col0 + key, p.seqlen_k) * p.heads_kv + hk) * p.head_dim + col;
        portable::red_add_f32x2(P.dk_accum + off, k0, k1);
        portable::red_add_f32x2(P.dv_accum + off, v0, v1);
      }
    }
  }
  if (sem != nullptr) {
    __threadfence();
    consumers_sync();
    if (ct == 0) device_sync::pass_turn(sem);
  }
}

// A block mask's per-element lookups (doc ids, bit mask; element_lookups.h) for the thread's S^T
// fragment of the step at q0, a bit per fragment element (all set where the step has none).
// Element i = 4 j + 2 r + c is key row r, query column 8 j + c from the thread's first; keys and
// queries past the sequences read clamped rows (bwd_probs masks them). Computed before the step's
// GEMMs, while only dK and dV hold registers, and kept as one word.
template <int kN, typename Coord, typename Tile>
__device__ __forceinline__ uint32_t bwd_lookups(const block_sparse::ElementMaskParams& el, const Tile& t,
                                                const Coord& s_coord, int q0, bool element) {
  if (!element || !el.has_lookups()) return ~0u;
  int64_t keys[2];
  CUTE_UNROLL
  for (int r = 0; r < 2; ++r) {
    const int key = t.col0 + cute::get<0>(s_coord(2 * r));
    keys[r] = key < t.seq.seqlen_k ? key : t.seq.seqlen_k - 1;
  }
  uint32_t found[2];
  element_lookup_bits<kN / 4, false>(el, t.b, t.h, keys, int64_t{q0} + cute::get<1>(s_coord(0)), t.seq.seqlen_q,
                                     found);
  uint32_t spread = 0u;
  CUTE_UNROLL
  for (int i = 0; i < kN; ++i) spread |= ((found[(i / 2) % 2] >> (2 * (i / 4) + i % 2)) & 1u) << i;
  return spread;
}

// Two adjacent elements of a 16-bit register fragment as one 32-bit register, written and read
// through portable::ElemTraits<T>::pack / unpack. Element pairs (2k, 2k + 1) of a compact fragment
// share a register; written one element at a time, ptxas split each packed conversion into two
// 16-bit halves (a PRMT each) and widened them one by one again.
template <typename Frag>
__device__ __forceinline__ uint32_t& frag_pair(Frag& frag, int i) {
  return cute::recast<uint32_t>(frag)(i / 2);
}

// P^T = exp2(S^T scale log2e - LSE log2e), rounded to the input dtype into `p_out` (a fragment of
// the S^T accumulator's size, written in packed pairs: elements 2k and 2k + 1 are query columns
// q and q + 1 of one key, q even, so their statistics are one 8-byte load), masked on the partial
// tiles only: rows past the sequence have
// LSE = +inf, so P = 0 there without a mask. s_coord: the (key, q) of each accumulator element.
// A block mask's step (the sparse kernel): P = 0 on an invalid step, and on a partial block's the
// element predicate `element` too.
template <typename Cfg, typename T, typename AccS, typename Coord, typename FragP, typename Tile>
__device__ __forceinline__ void bwd_probs(const AccS& s_acc, const Coord& s_coord, const float* lse_log2,
                                          float scale_log2, const Tile& t, int q0, FragP& p_out,
                                          const QStep& step = QStep{},
                                          const block_sparse::ElementMaskParams* element = nullptr,
                                          uint32_t lookups = ~0u) {
  constexpr int kN = decltype(cute::size(s_acc))::value;
  static_assert(kN % 2 == 0, "element pairs");
  if (!step.valid) {
    CUTE_UNROLL
    for (int i = 0; i < kN; i += 2) frag_pair(p_out, i) = 0u;
    return;
  }
  if constexpr (Tile::kSparse) {
    if (element != nullptr && step.element) {
      // The structural predicates and the sequences' ends, a bit per element, and the lookups'
      // bits (the block-sparse kernel only: dense tiles may hold more than 32 elements a thread).
      static_assert(kN <= 32 && kN % 4 == 0, "a thread's S^T elements fit one mask word");
      uint32_t seen = ~0u;
      // Lookups alone (documents, bit masks) inside both sequences leave nothing structural to test.
      const bool lookups_only = !element->has_structural() && t.band.unmasked() &&
                                q0 + Cfg::kBlockM <= t.seq.seqlen_q && t.col0 + Cfg::kBlockN <= t.seq.seqlen_k;
      if (!lookups_only) {
        seen = 0u;
        if (element->diagonal_band_applies()) {
          // Causal and windows: a band of q - key, two compares an element (unrolled: each element's
          // offsets are constants), with the sequences' ends and the kernel's own band.
          const block_sparse::ElementMaskParams::DiagonalBand diag = element->diagonal_band();
          CUTE_UNROLL
          for (int i = 0; i < kN; ++i) {
            const int key = t.col0 + cute::get<0>(s_coord(i)), q = q0 + cute::get<1>(s_coord(i));
            if (key < t.seq.seqlen_k && q < t.seq.seqlen_q && t.band.visible(q, key) && diag.contains(q - key))
              seen |= 1u << i;
          }
        } else {
          // A prefix: the rows' intervals, a bit per element in a rolled loop.
#pragma unroll 2
          for (int i = 0; i < kN; ++i) {
            const int key = t.col0 + cute::get<0>(s_coord(i)), q = q0 + cute::get<1>(s_coord(i));
            if (key < t.seq.seqlen_k && q < t.seq.seqlen_q && t.band.visible(q, key) &&
                element->row_interval(q).contains(key))
              seen |= 1u << i;
          }
        }
      }
      seen &= lookups;
      CUTE_UNROLL
      for (int i = 0; i < kN; i += 2) {
        const float2 lse = *reinterpret_cast<const float2*>(&lse_log2[cute::get<1>(s_coord(i))]);
        const float p0 = fast_exp2(fmaf(s_acc(i), scale_log2, -lse.x));
        const float p1 = fast_exp2(fmaf(s_acc(i + 1), scale_log2, -lse.y));
        frag_pair(p_out, i) =
            portable::ElemTraits<T>::pack((seen >> i) & 1u ? p0 : 0.f, (seen >> (i + 1)) & 1u ? p1 : 0.f);
      }
      return;
    }
  }
  auto probs = [&](auto masked) {
    // Masked: the step's rows that each of the thread's two key rows sees (element i = 4 j + 2 r + c
    // is key row r), two compares an element.
    sched::Band::RowSpan rows[2];
    if constexpr (decltype(masked)::value) {
      CUTE_UNROLL
      for (int r = 0; r < 2; ++r) {
        const int key = t.col0 + cute::get<0>(s_coord(2 * r));
        rows[r] = key < t.seq.seqlen_k ? t.band.key_rows(key, q0, Cfg::kBlockM) : sched::Band::RowSpan{1, 0};
      }
    }
    CUTE_UNROLL
    for (int i = 0; i < kN; i += 2) {
      const int q_local = cute::get<1>(s_coord(i));
      const float2 lse = *reinterpret_cast<const float2*>(&lse_log2[q_local]);
      float p0 = fast_exp2(fmaf(s_acc(i), scale_log2, -lse.x));
      float p1 = fast_exp2(fmaf(s_acc(i + 1), scale_log2, -lse.y));
      if constexpr (decltype(masked)::value) {
        p0 = rows[(i / 2) % 2].contains(q_local) ? p0 : 0.f;
        p1 = rows[(i / 2) % 2].contains(q_local + 1) ? p1 : 0.f;
      }
      frag_pair(p_out, i) = portable::ElemTraits<T>::pack(p0, p1);
    }
  };
  // Two compares against the tile's precomputed span (sched::full_row_tiles) instead of
  // classifying each step: the forward's per-tile classification cost 3 % of its main loop.
  if (!t.full_rows.contains(q0)) {
    probs(std::true_type{});
  } else {
    probs(std::false_type{});
  }
}

// A consumer thread's dQ fragment (unscaled: the conversion out of dq_accum applies the softmax
// scale once) into a shared fp32 tile at the offsets `offset(i)` of its 16-byte groups, then
// (kFence) made visible to the bulk copies that read it.
template <bool kFence = true, typename AccDQ, typename Offset>
__device__ __forceinline__ void bwd_store_dq_tile(float* tile, const AccDQ& dq_acc, Offset&& offset) {
  CUTE_UNROLL
  for (int i = 0; i < cute::size(dq_acc); i += 4)
    *reinterpret_cast<float4*>(&tile[offset(i)]) = make_float4(dq_acc(i), dq_acc(i + 1), dq_acc(i + 2), dq_acc(i + 3));
  if constexpr (kFence) sm90::fence_proxy_async_shared();
}

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
