// Rows of an MMA accumulator tile as 16-byte pieces. In the m16n8 accumulator layout (mma.sync's
// C fragment, and each warp's rows of a wgmma accumulator) the four lanes of a quad hold a row's
// 8 columns two apiece; stored as they lie that is four 4-byte stores a row, each filling half
// of a 32-byte sector. Two xor shuffles of 2 x 2 word blocks, then two of the off-diagonal blocks,
// give each lane one row's 8 columns instead: a 16x16 tile leaves in one 16-byte store a lane.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace flare {

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

}  // namespace flare
