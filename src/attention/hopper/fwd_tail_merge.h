// The Hopper forward's tail split, after the grid: the split tiles' parts (each a key range of its
// tile, fwd_grid.h) merged by their LSE into the output. And the one-CTA-per-tile grid's tile order
// that both the kernel and the merge read.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include <cute/config.hpp>

#include "src/attention/fwd_params.h"
#include "src/attention/hopper/fwd_grid.h"
#include "src/scheduling/tail_split.h"

namespace flare::hopper {

// Tile i of the one-CTA-per-tile grid's order: m block fastest, then head, then sequence (its 3D
// grid's blockIdx order; a tail split's 1D grid numbers its tiles so too).
template <typename Cfg>
__device__ __forceinline__ sched::TileCoord split_fwd_tile(const detail::FwdKernelParams& p, int64_t i) {
  const int m_blocks = (p.seqlen_q + Cfg::kBlockM - 1) / Cfg::kBlockM;
  sched::TileCoord c;
  c.block = static_cast<int>(i % m_blocks);
  c.head = static_cast<int>(i / m_blocks % p.heads);
  c.batch = static_cast<int>(i / m_blocks / p.heads);
  return c;
}

// A split tile's output: its parts' O merged by their LSE (out = sum_i e^(lse_i - lse) O_i, lse =
// log sum_i e^lse_i; parts that saw no key, lse +inf, weigh nothing), in the output dtype, and the
// LSE. A warp per row (kFwdMergeRows rows a CTA, grid: split tiles x row groups), lane l holding
// columns l, l + 32, ...: the parts' loads are independent and coalesced.
inline constexpr int kFwdMergeRows = 8;
template <typename Cfg, typename T>
__global__ void __launch_bounds__(32 * kFwdMergeRows)
    hopper_fwd_tail_merge_kernel(const detail::FwdKernelParams p, const sched::TailSplit tail, const float* partial) {
  constexpr int kCols = Cfg::kHeadDim / 32;
  static_assert(Cfg::kHeadDim % 32 == 0, "head dims of the Hopper forward are multiples of 32");
  using Slot = FwdPartSlot<Cfg>;
  const sched::TileCoord c = split_fwd_tile<Cfg>(p, tail.whole + blockIdx.x);
  const int h = c.head, b = c.batch;
  const int lane = threadIdx.x % 32, r = blockIdx.y * kFwdMergeRows + threadIdx.x / 32;
  const int row = c.block * Cfg::kBlockM + r;
  if (row >= p.seqlen_q) return;
  const float* slots = partial + int64_t{blockIdx.x} * tail.parts * Slot::kFloats;
  auto lse_of = [&](int q) { return slots[q * Slot::kFloats + Slot::kLse + r]; };
  float top = -INFINITY;
  for (int q = lane; q < tail.parts; q += 32) {
    const float l = lse_of(q);
    if (l != INFINITY) top = fmaxf(top, l);
  }
  for (int o = 16; o > 0; o /= 2) top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, o));
  float sum = 0.f, acc[kCols] = {};
  for (int q = 0; q < tail.parts; ++q) {
    const float l = lse_of(q);  // one address for the warp
    if (l == INFINITY) continue;
    const float w = __expf(l - top);
    sum += w;
    const float* o = slots + q * Slot::kFloats + r * Cfg::kHeadDim + lane;
    CUTE_UNROLL
    for (int c = 0; c < kCols; ++c) acc[c] += w * o[32 * c];
  }
  const float inv = sum > 0.f ? 1.f / sum : 0.f;
  T* out = static_cast<T*>(p.out) + detail::row_offset(p.out_str, b, row, h) + lane;
  CUTE_UNROLL
  for (int c = 0; c < kCols; ++c)
    if (lane + 32 * c < p.head_dim) out[32 * c] = static_cast<T>(acc[c] * inv);
  if (lane == 0 && p.lse != nullptr)
    p.lse[b * p.lse_batch_stride + h * p.lse_head_stride + row] = sum > 0.f ? top + logf(sum) : INFINITY;
}

}  // namespace flare::hopper
