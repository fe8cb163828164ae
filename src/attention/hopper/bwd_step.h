// The Hopper backward's consumer operations that both tilings share (bwd_consumer.h, the d <= 128
// tiling; bwd_split_kernel.h, the split one): the consumers' barrier arrivals, P^T from S^T (with
// a block mask's element predicate), the dQ tile's stores, and the dK/dV epilogue.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <type_traits>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "src/attention/bwd_params.h"
#include "src/attention/hopper/bwd_tile.h"
#include "src/attention/hopper/element_lookups.h"
#include "src/attention/hopper/online_softmax.h"
#include "src/attention/portable/bwd_kernel.h"
#include "src/attention/portable/warp_mma.h"
#include "src/block_sparse/block_sparse_params.h"
#include "src/common/bulk_copy.h"
#include "src/common/quad_transpose.h"
#include "src/common/turn_semaphore.h"

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

}  // namespace flare::hopper
