// The CPU emulation of flare's warp tile primitives (src/attention/portable/warp_mma.h), for
// running kernel code under tests/cpu/cuda_emu/cuda_emu.h: the same m16n8k16 fragment layouts,
// computed from the whole warp's registers exchanged through the block's barriers.
//   A 16x16: a0 (row g, cols 2t..2t+1), a1 (row g+8, ...), a2 (row g, cols 2t+8..), a3 (row g+8, cols 2t+8..)
//   B 16x8:  b0 (k rows 2t..2t+1, col g), b1 (k rows 2t+8..2t+9, col g)
//   C 16x8:  c0,c1 (row g, cols 2t, 2t+1), c2,c3 (row g+8, cols 2t, 2t+1)
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "cuda_emu.h"

namespace flare::portable {

template <typename T>
struct ElemTraits;
template <>
struct ElemTraits<__nv_bfloat16> {
  static uint32_t pack(float lo, float hi) {
    const __nv_bfloat16 l = __float2bfloat16_rn(lo), h = __float2bfloat16_rn(hi);
    uint16_t a, b;
    std::memcpy(&a, &l, 2), std::memcpy(&b, &h, 2);
    return a | (uint32_t{b} << 16);
  }
  static float unpack(uint16_t bits) { return __bfloat162float(__nv_bfloat16(__nv_bfloat16_raw{bits})); }
};
template <>
struct ElemTraits<__half> {
  static uint32_t pack(float lo, float hi) {
    const __half l = __float2half_rn(lo), h = __float2half_rn(hi);
    uint16_t a, b;
    std::memcpy(&a, &l, 2), std::memcpy(&b, &h, 2);
    return a | (uint32_t{b} << 16);
  }
  static float unpack(uint16_t bits) { return __half2float(__half(__half_raw{bits})); }
};

template <typename T>
inline void accum_to_a(const float (&lo)[4], const float (&hi)[4], uint32_t (&a)[4]) {
  a[0] = ElemTraits<T>::pack(lo[0], lo[1]);
  a[1] = ElemTraits<T>::pack(lo[2], lo[3]);
  a[2] = ElemTraits<T>::pack(hi[0], hi[1]);
  a[3] = ElemTraits<T>::pack(hi[2], hi[3]);
}

inline uint16_t half_of(uint32_t w, int hi) { return static_cast<uint16_t>(hi ? w >> 16 : w & 0xffffu); }

// D = A B + D (fp32 accumulation) over the warp's fragments.
template <typename T>
inline void mma_16x8x16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  auto& e = cuda_emu::exchange();
  const int l = cuda_emu::lane(), g = l / 4, t = l % 4;
  std::memcpy(e.a[l], a, sizeof(a));
  e.b[l][0] = b0, e.b[l][1] = b1;
  cuda_emu::warp_barrier();
  auto A = [&](int r, int k) {
    return ElemTraits<T>::unpack(half_of(e.a[(r % 8) * 4 + (k % 8) / 2][(r >= 8) + 2 * (k >= 8)], k % 2));
  };
  auto B = [&](int k, int n) { return ElemTraits<T>::unpack(half_of(e.b[n * 4 + (k % 8) / 2][k >= 8], k % 2)); };
  for (int i = 0; i < 4; ++i) {
    const int row = g + (i / 2) * 8, col = 2 * t + i % 2;
    float acc = d[i];
    for (int k = 0; k < 16; ++k) acc += A(row, k) * B(k, col);
    d[i] = acc;
  }
  cuda_emu::warp_barrier();
}

// Four 8x8 b16 matrices; lane l supplies the row address of matrix l / 8.
inline void ldmatrix(uint32_t (&r)[4], const void* row_ptr, bool trans) {
  auto& e = cuda_emu::exchange();
  const int l = cuda_emu::lane();
  e.addr[l] = row_ptr;
  cuda_emu::warp_barrier();
  for (int q = 0; q < 4; ++q) {
    uint16_t lo, hi;
    if (!trans) {
      const uint16_t* row = static_cast<const uint16_t*>(e.addr[q * 8 + l / 4]);
      lo = row[2 * (l % 4)], hi = row[2 * (l % 4) + 1];
    } else {
      lo = static_cast<const uint16_t*>(e.addr[q * 8 + 2 * (l % 4)])[l / 4];
      hi = static_cast<const uint16_t*>(e.addr[q * 8 + 2 * (l % 4) + 1])[l / 4];
    }
    r[q] = lo | (uint32_t{hi} << 16);
  }
  cuda_emu::warp_barrier();
}
inline void ldmatrix_x4(uint32_t (&r)[4], const void* row_ptr) { ldmatrix(r, row_ptr, false); }
inline void ldmatrix_x4_trans(uint32_t (&r)[4], const void* row_ptr) { ldmatrix(r, row_ptr, true); }

// stmatrix .x4 .trans: matrix q's fragment element (row l / 4, column 2 (l % 4) (+1)) of lane l
// lands in row 2 (l % 4) (+1), column l / 4, of the rows whose addresses lanes 8 q .. 8 q + 7 give.
inline void stmatrix_x4_trans(const uint32_t (&r)[4], void* row_ptr) {
  auto& e = cuda_emu::exchange();
  const int l = cuda_emu::lane();
  e.addr[l] = row_ptr;
  cuda_emu::warp_barrier();
  for (int q = 0; q < 4; ++q) {
    uint16_t* lo_row = static_cast<uint16_t*>(const_cast<void*>(e.addr[q * 8 + 2 * (l % 4)]));
    uint16_t* hi_row = static_cast<uint16_t*>(const_cast<void*>(e.addr[q * 8 + 2 * (l % 4) + 1]));
    lo_row[l / 4] = half_of(r[q], 0);
    hi_row[l / 4] = half_of(r[q], 1);
  }
  cuda_emu::warp_barrier();
}

// The copy happens at once (zero-filled when not valid); commit and wait have nothing to do.
inline void cp_async_16(void* smem, const void* gmem, bool valid) {
  if (valid) std::memcpy(smem, gmem, 16);
  else std::memset(smem, 0, 16);
}
inline void cp_async_commit() {}
template <int N>
inline void cp_async_wait() {}

inline float fast_exp2(float x) { return std::exp2(x); }

// tanh.approx, exact here (the hardware's is within about 2^-11 relative).
inline float fast_tanh(float x) { return std::tanh(x); }

// red.global.add (atomicAdd before sm_90): the blocks run one after another, but a block's
// threads run at once.
inline void red_add_f32x2(float* dst, float a, float b) {
  std::atomic_ref<float>(dst[0]).fetch_add(a, std::memory_order_relaxed);
  std::atomic_ref<float>(dst[1]).fetch_add(b, std::memory_order_relaxed);
}

inline void red_add_f32x2_if(bool pred, float* dst, float a, float b) {
  if (pred) red_add_f32x2(dst, a, b);
}

// The 4-byte cp.async of bwd_kernel.h (whose PTX definition the emulable copy of that header
// drops: tests/cpu/cuda_emu/emulable_kernel.cmake).
inline void cp_async_4(void* smem, const void* gmem, bool valid) {
  if (valid) std::memcpy(smem, gmem, 4);
  else std::memset(smem, 0, 4);
}

}  // namespace flare::portable
