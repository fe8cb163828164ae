// Global -> shared tile copies of the portable kernels (cp.async, 16 bytes per thread and step).
#pragma once

#include <cstdint>

#include "src/attention/portable/warp_mma.h"

namespace flare::portable {

// Copies rows [0, rows) x columns [0, cols) of a row-major global tile (kRows x kCols at most)
// into a shared tile whose rows are kSmemStride elements apart. Rows and columns past the valid
// range are zero-filled (V's zero rows keep 0 * garbage out of the output).
template <int kRows, int kCols, int kThreads, int kSmemStride, typename T>
__device__ __forceinline__ void load_tile(T* smem, const T* gmem, int64_t row_stride, int rows, int cols) {
  constexpr int kChunksPerRow = kCols / 8;
  constexpr int kChunks = kRows * kChunksPerRow;
  if constexpr (kThreads % kChunksPerRow == 0 && kChunks % kThreads == 0) {
    // Each thread keeps one column and walks rows: one running pointer, few registers.
    constexpr int kRowStep = kThreads / kChunksPerRow;
    const int col = (threadIdx.x % kChunksPerRow) * 8;
    int r = threadIdx.x / kChunksPerRow;
    const T* src = gmem + r * row_stride + col;
    T* dst = smem + r * kSmemStride + col;
#pragma unroll
    for (int it = 0; it < kChunks / kThreads; ++it, r += kRowStep) {
      const bool valid = r < rows && col < cols;
      cp_async_16(dst, valid ? src : gmem, valid);
      src += kRowStep * row_stride;
      dst += kRowStep * kSmemStride;
    }
  } else {
    for (int c = threadIdx.x; c < kChunks; c += kThreads) {
      const int r = c / kChunksPerRow, col = (c % kChunksPerRow) * 8;
      const bool valid = r < rows && col < cols;
      cp_async_16(smem + r * kSmemStride + col, valid ? gmem + r * row_stride + col : gmem, valid);
    }
  }
}

}  // namespace flare::portable
