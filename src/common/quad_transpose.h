// Rows of an MMA accumulator tile as 16-byte pieces. In the m16n8 accumulator layout (mma.sync's
// C fragment, and each warp's rows of a wgmma accumulator) the four lanes of a quad hold a row's
// 8 columns two apiece; stored as they lie that is four 4-byte stores a row, each filling half
// of a 32-byte sector. Two xor shuffles of 2 x 2 word blocks, then two of the off-diagonal blocks,
// give each lane one row's 8 columns instead: a 16x16 tile leaves in one 16-byte store a lane.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "src/attention/portable/warp_mma.h"  // ElemTraits

namespace flare {

// Whether rows starting at `base`, `row_stride` elements apart, take 16-byte stores.
template <typename T>
__host__ __device__ __forceinline__ bool rows_16b_aligned(const T* base, int64_t row_stride) {
  return reinterpret_cast<uintptr_t>(base) % 16 == 0 && (row_stride * sizeof(T)) % 16 == 0;
}

// w[q]: the lane's packed 16-bit pair of rows g + 8 (q / 2), columns 8 (q % 2) + 2 t (g = lane / 4,
// t = lane % 4) of a 16x16 tile. Returns row g + 8 (t / 2), columns 8 (t % 2) .. + 7, as words in
// column order.
__device__ __forceinline__ uint4 quad_transpose16(uint32_t (&w)[4], int t) {
  const bool odd = t & 1, high = t & 2;
#pragma unroll
  for (int k = 0; k < 2; ++k) {  // 2 x 2 blocks: lane t takes the partner's word of the other parity
    const uint32_t got = __shfl_xor_sync(0xffffffffu, odd ? w[2 * k] : w[2 * k + 1], 1);
    if (odd) w[2 * k] = got; else w[2 * k + 1] = got;
  }
#pragma unroll
  for (int j = 0; j < 2; ++j) {  // the off-diagonal blocks
    const uint32_t got = __shfl_xor_sync(0xffffffffu, high ? w[j] : w[2 + j], 2);
    if (high) w[j] = got; else w[2 + j] = got;
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// The piece lane t stores of the 16-column block b of a warp's accumulator rows, rounded to T:
// at(i) is element i = 4 j + 2 r + c (row g + 8 r, column 8 j + 2 t + c: a pair of m16n8 C
// fragments, or a warp's rows of a wgmma accumulator), row r scaled by s0 (r = 0) or s1 (r = 1).
// Returns row g + 8 (t / 2), columns 16 b + 8 (t % 2) .. + 7.
template <typename T, typename At>
__device__ __forceinline__ uint4 accumulator_piece(At&& at, int b, float s0, float s1, int t) {
  uint32_t w[4];  // word q: row g + 8 (q / 2), columns 16 b + 8 (q % 2) + 2 t
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const int i = 4 * (2 * b + q % 2) + 2 * (q / 2);
    const float s = q / 2 ? s1 : s0;
    w[q] = portable::ElemTraits<T>::pack(at(i) * s, at(i + 1) * s);
  }
  return quad_transpose16(w, t);
}

}  // namespace flare
