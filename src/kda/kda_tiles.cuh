// Warp tile operations of the KDA kernels, on top of flare's m16n8k16 helpers (warp_mma.h).
//
// Names say which operand a fragment is and where it comes from:
//   load_a(tile, row0, col0)      A fragment (16x16) of a row-major smem tile
//   load_b_rows(tile, n0, k0)     B fragments of two n8 tiles, smem stored [n][k] (k contiguous)
//   load_b_cols(tile, k0, n0)     the same from a tile stored [k][n] (n contiguous), via .trans
//   to_a(acc, kk)                 the A fragment of k-step kk from fp32 accumulators (C layout)
// An accumulator row block of 16 rows x N columns is `float acc[N / 8][4]`.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "src/attention/portable/warp_mma.h"
#include "src/common/quad_transpose.h"

namespace flare::kda {

using portable::cp_async_16;
using portable::cp_async_commit;
using portable::cp_async_wait;
using portable::ElemTraits;
using portable::fast_exp2;
using portable::ldmatrix_x4;
using portable::ldmatrix_x4_trans;
using portable::stmatrix_x4_trans;
using portable::mma_16x8x16;

constexpr float kRcpLn2 = 1.4426950408889634f;  // gates are cumulated in log2 units: exp -> exp2
constexpr float kMaxExp2 = 126.f;               // clamp: exp2 stays finite in fp32 and bf16

__device__ __forceinline__ float exp2_clamped(float x) { return fast_exp2(fminf(x, kMaxExp2)); }

template <typename T>
__device__ __forceinline__ float to_float(T x);
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }
template <>
__device__ __forceinline__ float to_float<__half>(__half x) { return __half2float(x); }
template <>
__device__ __forceinline__ float to_float<float>(float x) { return x; }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16(x); }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half(x); }

template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) { return ElemTraits<T>::pack(lo, hi); }

template <typename T>
__device__ __forceinline__ float2 unpack2(uint32_t x) {
  const T* p = reinterpret_cast<const T*>(&x);
  return make_float2(to_float(p[0]), to_float(p[1]));
}

// A bf16 pair times a bf16 pair (each product rounded to bf16): one packed multiply. (fp16 scales
// through fp32 instead: scale_a_fragment.)
__device__ __forceinline__ uint32_t mul2_bf16(uint32_t x, uint32_t f) {
  const __nv_bfloat162 r = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&x), *reinterpret_cast<const __nv_bfloat162*>(&f));
  return *reinterpret_cast<const uint32_t*>(&r);
}

// A fragment of the 16x16 block at (row0, col0) of a row-major tile with row stride `ld`.
template <typename T>
__device__ __forceinline__ void load_a(uint32_t (&a)[4], const T* tile, int ld, int row0, int col0) {
  const int lane = threadIdx.x % 32;
  ldmatrix_x4(a, tile + (row0 + lane % 16) * ld + col0 + (lane / 16) * 8);
}

// B fragments (b0, b1 of n-tiles n0..n0+7 and n0+8..n0+15, k-step at k0) of a tile stored [n][k].
template <typename T>
__device__ __forceinline__ void load_b_rows(uint32_t (&b)[4], const T* tile, int ld, int n0, int k0) {
  const int lane = threadIdx.x % 32;
  ldmatrix_x4(b, tile + (n0 + lane % 8 + (lane / 16) * 8) * ld + k0 + ((lane / 8) % 2) * 8);
}

// The same for a tile stored [k][n].
template <typename T>
__device__ __forceinline__ void load_b_cols(uint32_t (&b)[4], const T* tile, int ld, int k0, int n0) {
  const int lane = threadIdx.x % 32;
  ldmatrix_x4_trans(b, tile + (k0 + lane % 8 + ((lane / 8) % 2) * 8) * ld + n0 + (lane / 16) * 8);
}

// acc[n-tile pair] += a * b for the two n8 tiles a load_b_* returned.
template <typename T>
__device__ __forceinline__ void mma_pair(float (&c0)[4], float (&c1)[4], const uint32_t (&a)[4],
                                         const uint32_t (&b)[4]) {
  mma_16x8x16<T>(c0, a, b[0], b[1]);
  mma_16x8x16<T>(c1, a, b[2], b[3]);
}

// The A fragment of k-step kk (columns 16kk..16kk+15) from accumulators in C layout.
template <typename T, int N8>
__device__ __forceinline__ void to_a(uint32_t (&a)[4], const float (&acc)[N8][4], int kk) {
  portable::accum_to_a<T>(acc[2 * kk], acc[2 * kk + 1], a);
}

// -a for a packed pair of 16-bit floats.
__device__ __forceinline__ uint32_t neg2(uint32_t x) { return x ^ 0x80008000u; }

template <int N8>
__device__ __forceinline__ void zero(float (&acc)[N8][4]) {
#pragma unroll
  for (int i = 0; i < N8; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
}

// A warp's 16 x 16 accumulator tile (acc[nt]: rows g and g + 8, columns 8 nt + 2 t, + 1) rounded
// to T and stored into the row-major tile at `dst` (row stride ld elements, 16-byte aligned rows):
// lane t writes one 16-byte piece, row g + 8 (t / 2), columns 8 (t % 2) .. + 7 (quad_transpose16).
template <typename T>
__device__ __forceinline__ void store_tile16(T* dst, int ld, const float (&acc)[2][4], int g, int t) {
  *reinterpret_cast<uint4*>(dst + (g + 8 * (t / 2)) * ld + 8 * (t % 2)) =
      accumulator_piece<T>([&](int i) { return acc[i / 4][i % 4]; }, 0, 1.f, 1.f, t);
}

// The transposed fragment x^T [16 columns x R rows] of rows [0, R) and columns [c0, c0 + 16) of a
// 16-bit tile in shared memory (u^T of a chunk, as the state passes start vnew^T from it).
template <int R, typename T, int Ld>
__device__ __forceinline__ void load_frag_t(float (&x)[R / 8][4], const T (&tile)[R][Ld], int c0, int g, int t) {
#pragma unroll
  for (int nt = 0; nt < R / 8; ++nt) {
    const int j = nt * 8 + 2 * t;
    x[nt][0] = to_float(tile[j][c0 + g]);
    x[nt][1] = to_float(tile[j + 1][c0 + g]);
    x[nt][2] = to_float(tile[j][c0 + g + 8]);
    x[nt][3] = to_float(tile[j + 1][c0 + g + 8]);
  }
}

// A warp's fragment of a transposed fp32 [K, V] state (rows v (+8), columns c = 8 nt + 2 t (+1)):
// `state` points at the state's element (c = 0, v) of the thread's row v, the row stride is V.
// Loaded as zeros when `state` is null.
template <int K>
__device__ __forceinline__ void load_state_frag(float (&S)[K / 8][4], const float* state, int V, int t) {
#pragma unroll
  for (int nt = 0; nt < K / 8; ++nt) {
    if (state != nullptr) {
      const float* src = state + (nt * 8 + 2 * t) * V;
      S[nt][0] = src[0], S[nt][1] = src[V], S[nt][2] = src[8], S[nt][3] = src[V + 8];
    } else {
      S[nt][0] = S[nt][1] = S[nt][2] = S[nt][3] = 0.f;
    }
  }
}

// The inverse of load_state_frag (nothing when `state` is null).
template <int K>
__device__ __forceinline__ void store_state_frag(const float (&S)[K / 8][4], float* state, int V, int t) {
  if (state == nullptr) return;
#pragma unroll
  for (int nt = 0; nt < K / 8; ++nt) {
    float* dst = state + (nt * 8 + 2 * t) * V;
    dst[0] = S[nt][0], dst[V] = S[nt][1], dst[8] = S[nt][2], dst[V + 8] = S[nt][3];
  }
}

// A transposed state fragment's decay over one chunk: S^T <- S^T Diag(decay), `decay` the chunk's
// K per-channel factors (shared memory).
template <int K>
__device__ __forceinline__ void decay_state_frag(float (&S)[K / 8][4], const float* decay, int t) {
#pragma unroll
  for (int nt = 0; nt < K / 8; ++nt) {
    const float d0 = decay[nt * 8 + 2 * t], d1 = decay[nt * 8 + 2 * t + 1];
    S[nt][0] *= d0, S[nt][1] *= d1, S[nt][2] *= d0, S[nt][3] *= d1;
  }
}

// S^T += X^T Y over a chunk's tokens: X^T as the A operands of its 16-token k-steps, Y the chunk's
// [token][K] tile in shared memory (row stride ld). The state update's vnew^T kg.
template <typename T, int K, int KSteps>
__device__ __forceinline__ void add_chunk_product(float (&S)[K / 8][4], const uint32_t (&xt)[KSteps][4], const T* y,
                                                  int ld) {
#pragma unroll
  for (int jj = 0; jj < KSteps; ++jj)
#pragma unroll
    for (int np = 0; np < K / 16; ++np) {
      uint32_t b[4];
      load_b_cols(b, y, ld, jj * 16, np * 16);
      mma_pair<T>(S[2 * np], S[2 * np + 1], xt[jj], b);
    }
}

}  // namespace flare::kda
