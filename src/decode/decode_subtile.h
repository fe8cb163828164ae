// One warp's step over a 16-key sub-tile of the sm_90 decode kernels (decode_bulk_kernel.h,
// decode_key_groups_kernel.h), after its S = Q K^T: the mask, the online softmax and O += P V.
// The rows are the warp's m-tile (16 packed query rows), a thread's rows g and g + 8.
#pragma once

#include <cmath>
#include <cstdint>

#include "src/common/bulk_copy.h"
#include "src/decode/decode_kernel.h"

// Experiment switch (bench/RESULTS.md, session 43): 1 makes the sm_90 kernels' consumer warps skip
// every tile's math (they wait for each stage and release it), so a run times the load pipeline
// alone. Results are wrong with it; builds for measurement only.
#ifndef FLARE_DECODE_EXPERIMENT_SKIP_MATH
#define FLARE_DECODE_EXPERIMENT_SKIP_MATH 0
#endif

namespace flare::decode::device {

// V rows of a sub-tile at keys [kv_end, key0 + kN) were never copied (or were copied
// speculatively from past the sequence): zeroed, so that P = 0 multiplies zeros. R: the row
// stride of the stage in elements.
template <int kHeadDim, int kN, typename T>
__device__ __forceinline__ void zero_v_rows_past_end(T* v_chunk, int R, int key0, int kv_end, int lane) {
  if (key0 + kN <= kv_end) return;
  const int first_bad = kv_end - key0;
  for (int idx = lane; idx < (kN - first_bad) * (kHeadDim / 8); idx += 32) {
    const int r = first_bad + idx / (kHeadDim / 8), c = (idx % (kHeadDim / 8)) * 8;
    *reinterpret_cast<uint4*>(v_chunk + r * R + c) = make_uint4(0, 0, 0, 0);
  }
  sm90::fence_proxy_async_shared();  // before a later bulk copy refills the stage
  __syncwarp();
}

// v_at of softmax_pv_step for V rows at v_chunk with a row stride of R elements.
template <typename T>
struct StridedRows {
  const T* lane_row;  // this lane's row and column offset
  __device__ __forceinline__ StridedRows(const T* v_chunk, int R, int lane)
      : lane_row(v_chunk + (lane % 8 + ((lane / 8) % 2) * 8) * R + (lane / 16) * 8) {}
  __device__ __forceinline__ const T* operator()(int dp) const { return lane_row + 16 * dp; }
};

// S (sc: keys 0-7 and 8-15 of the sub-tile starting at key0) masked to each row's visible keys
// unless the sub-tile is `full`, folded into the rows' running max (log2 units) and sum, O
// rescaled where the max moved, and O += P V with V's 16 rows read by ldmatrix.trans: v_at(dp) is
// this lane's address for columns [16 dp, 16 dp + 16) (its row lane % 8 + 8 ((lane / 8) % 2),
// its 8 columns from 16 dp + 8 (lane / 16)).
template <int kDTiles, typename T, typename VAt>
__device__ __forceinline__ void softmax_pv_step(float (&sc)[2][4], bool full, int key0, int t, const RowBounds& rows,
                                                float scale_log2, float (&row_max)[2], float (&row_sum)[2],
                                                float (&o)[kDTiles][4], VAt&& v_at) {
  if (!full) {
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = key0 + 8 * j + 2 * t + (e % 2), i = e / 2;
        sc[j][e] = (key >= rows.lo[i] && key <= rows.last[i]) ? sc[j][e] : -INFINITY;
      }
  }
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    float mx = fmaxf(fmaxf(sc[0][2 * i], sc[0][2 * i + 1]), fmaxf(sc[1][2 * i], sc[1][2 * i + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float new_max = fmaxf(row_max[i], mx * scale_log2);
    const float base = new_max == -INFINITY ? 0.f : new_max;
    const float alpha = fast_exp2(row_max[i] - base);
    row_max[i] = new_max;
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      sc[j][2 * i] = fast_exp2(fmaf(sc[j][2 * i], scale_log2, -base));
      sc[j][2 * i + 1] = fast_exp2(fmaf(sc[j][2 * i + 1], scale_log2, -base));
      sum += sc[j][2 * i] + sc[j][2 * i + 1];
    }
    row_sum[i] = row_sum[i] * alpha + sum;
    if (__any_sync(0xffffffffu, alpha != 1.f)) {  // the max moved for some row: rescale O
#pragma unroll
      for (int dt = 0; dt < kDTiles; ++dt) {
        o[dt][2 * i] *= alpha;
        o[dt][2 * i + 1] *= alpha;
      }
    }
  }
  uint32_t pa[4];
  accum_to_a<T>(sc[0], sc[1], pa);
#pragma unroll
  for (int dp = 0; dp < kDTiles / 2; ++dp) {
    uint32_t bv[4];
    ldmatrix_x4_trans(bv, v_at(dp));
    mma_16x8x16<T>(o[2 * dp], pa, bv[0], bv[1]);
    mma_16x8x16<T>(o[2 * dp + 1], pa, bv[2], bv[3]);
  }
}

}  // namespace flare::decode::device
