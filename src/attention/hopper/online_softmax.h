// Online softmax over a wgmma accumulator tile, in exp2 with the scale folded in.
//
// A thread of a consumer warpgroup holds two rows of the 64-row tile (quad_row and quad_row + 8);
// accumulator element i = 4 j + 2 r + c belongs to row r. The four threads of a quad share a row:
// the row max is reduced across the quad at every block, the row sum only at the end.
#pragma once

#include <cmath>
#include <cstdint>

#include "src/attention/portable/warp_mma.h"

namespace flare::hopper {

using portable::fast_exp2;
using portable::fast_tanh;

// 2^x on the FMA pipe, for the share of the softmax that would otherwise queue on the exp2 unit
// (16 results per clock and SM against 128 FMAs). x = n + f with n = round(x) and f in
// [-0.5, 0.5]: 2^f from a degree-3 polynomial (relative error 1.0e-4, under bf16's rounding of P),
// 2^n added to the exponent bits. x below -125 gives 0 (masked scores are -inf).
__device__ __forceinline__ float exp2_poly(float x) {
  constexpr float kRound = 12582912.f;  // 1.5 * 2^23: x + kRound holds round(x) in its low bits
  const float xc = fmaxf(x, -125.f);
  const float t = __fadd_rn(xc, kRound);
  const float f = __fsub_rn(xc, __fsub_rn(t, kRound));
  const float p = fmaf(fmaf(fmaf(0.0550088343f, f, 0.242210999f), f, 0.693282946f), f, 1.f);
  const int bits = __float_as_int(p) + (__float_as_int(t) << 23);
  return x < -125.f ? 0.f : __int_as_float(bits);
}

struct RowScale {
  float v[2];
  bool changed = true;  // false: both factors are 1 (the running max was kept), O needs no rescale
};

// Lazy rescaling: the running max moves only when a block's max exceeds it by more than this (in
// log2 units), so P stays below 2^kLazyRescaleLog2 and most blocks skip the rescale of O.
inline constexpr float kLazyRescaleLog2 = 8.f;

struct OnlineSoftmax {
  float max[2];  // running max, scaled log2 units
  float sum[2];  // this thread's share of the denominator

  // `start_max`: the sink logit in log2 units (or -inf); its exp2(0) = 1 joins the denominator once
  // per row, through the thread `count_sink` of each quad.
  __device__ __forceinline__ void init(float start_max, bool count_sink) {
    max[0] = max[1] = start_max;
    sum[0] = sum[1] = count_sink ? 1.f : 0.f;
  }

  // Scores (raw, masked with -inf) become probabilities exp2(s * scale - m) against the new
  // running max; returns the factor exp2(m_old - m_new) that O must be rescaled by. Every
  // kPolyEvery-th group of 8 columns takes exp2_poly instead of the exp2 unit (0: none). kLazy:
  // the running max is kept while no row of the warp outgrows it by kLazyRescaleLog2.
  template <int kPolyEvery = 0, bool kLazy = false, typename Frag>
  __device__ __forceinline__ RowScale update_scores(Frag& s, float scale) {
    constexpr int kN = decltype(cute::size(s))::value;
    RowScale alpha;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      // Max and sum as pairwise trees: a serial chain of 32 dependent FMNMX or FADD would sit on
      // the warpgroup's critical path between its S GEMM and its PV GEMM.
      float m[kN / 4];
#pragma unroll
      for (int j = 0; j < kN / 4; ++j) m[j] = fmaxf(s(4 * j + 2 * r), s(4 * j + 2 * r + 1));
#pragma unroll
      for (int w = 1; w < kN / 4; w *= 2)
#pragma unroll
        for (int j = 0; j + w < kN / 4; j += 2 * w) m[j] = fmaxf(m[j], m[j + w]);
      float mx = m[0];  // of the raw scores: the scale is positive
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      mx = fmaxf(max[r], mx * scale);
      if constexpr (kLazy) {
        // Warp-uniform: keep every row's max unless one of the warp's rows outgrew its own.
        const bool grew = mx > max[r] + kLazyRescaleLog2 || (max[r] == -INFINITY && mx != -INFINITY);
        if (!__any_sync(0xffffffffu, grew)) mx = max[r];
      }
      const float base = mx == -INFINITY ? 0.f : mx;  // rows with nothing visible yet
      alpha.v[r] = fast_exp2(max[r] - base);
      max[r] = mx;
      float part[kN / 4];
#pragma unroll
      for (int j = 0; j < kN / 4; ++j) {
        const int i = 4 * j + 2 * r;
        const float x0 = fmaf(s(i), scale, -base), x1 = fmaf(s(i + 1), scale, -base);
        if (kPolyEvery > 0 && j % (kPolyEvery > 0 ? kPolyEvery : 1) == 0) {
          s(i) = exp2_poly(x0);
          s(i + 1) = exp2_poly(x1);
        } else {
          s(i) = fast_exp2(x0);
          s(i + 1) = fast_exp2(x1);
        }
        part[j] = s(i) + s(i + 1);
      }
#pragma unroll
      for (int w = 1; w < kN / 4; w *= 2)
#pragma unroll
        for (int j = 0; j + w < kN / 4; j += 2 * w) part[j] += part[j + w];
      sum[r] = sum[r] * alpha.v[r] + part[0];
    }
    alpha.changed = !kLazy || __any_sync(0xffffffffu, alpha.v[0] != 1.f || alpha.v[1] != 1.f);
    return alpha;
  }

  template <typename Frag>
  __device__ __forceinline__ void rescale(Frag& o, const RowScale& alpha) const {
    constexpr int kN = decltype(cute::size(o))::value;
    if (!alpha.changed) return;  // warp-uniform
#pragma unroll
    for (int i = 0; i < kN; ++i) o(i) *= alpha.v[(i / 2) % 2];
  }

  // Reduces the sums across the quad; returns 1 / sum per row (0 for rows that saw nothing).
  __device__ __forceinline__ RowScale finish() {
    RowScale inv;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      sum[r] += __shfl_xor_sync(0xffffffffu, sum[r], 1);
      sum[r] += __shfl_xor_sync(0xffffffffu, sum[r], 2);
      inv.v[r] = sum[r] > 0.f ? 1.f / sum[r] : 0.f;
    }
    return inv;
  }

  // Natural-log LSE of row r after finish(); +inf for rows that saw nothing.
  __device__ __forceinline__ float lse(int r) const {
    return sum[r] > 0.f ? (max[r] + log2f(sum[r])) * static_cast<float>(M_LN2) : INFINITY;
  }
};

}  // namespace flare::hopper
