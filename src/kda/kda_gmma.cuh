// Warpgroup tile operations of the KDA state passes on sm_90a (wgmma), beside the warp ones of
// kda_tiles.cuh. A warpgroup's m64nNk16 accumulator puts warp w's rows at 16 w .. 16 w + 15 in
// exactly the layout of an m16n8k16 accumulator block (`float acc[N / 8][4]`: rows g and g + 8,
// columns 8 i + 2 t, + 1), and its register A operand is an m16n8k16 A fragment: the state passes
// keep their per-warp fragments and to_a, and only their B operands move to the layout below.
//
//   sw128_index<R>(r, c)        element offset of (r, c) in an R-row tile in the 128-byte swizzle
//   load_rows_sw128             a chunk's 64 rows into such a tile with cp.async
//   desc_k(tile, ks)            B descriptor, k-step ks, of a tile stored [n][k] (k contiguous)
//   desc_mn(tile, ks)           B descriptor, k-step ks, of a tile stored [k][n] (n contiguous)
//   mma_rs<T, major>(acc, a, d) acc (+)= a B, one k-step, A from registers
//   wg_arrive / wg_commit / wg_wait<N> / fence(x): wgmma's ordering (the caller keeps A operands
//     and accumulators untouched between issue and wait; fence stops the compiler moving them).
#pragma once

#include <cute/arch/mma_sm90_desc.hpp>
#include <cute/arch/mma_sm90_gmma.hpp>

#include <cstdint>
#include <type_traits>
#include <utility>

#include "src/kda/kda_fwd_params.h"
#include "src/kda/kda_tiles.cuh"

namespace flare::kda::gmma {

using Major = cute::SM90::GMMA::Major;
using ScaleIn = cute::SM90::GMMA::ScaleIn;
using detail::kKdaChunk;
using detail::kKdaSubChunk;

// An [R][C] tile of 16-bit elements in wgmma's 128-byte swizzle: column blocks of 64 elements, each
// R rows of 128 bytes; in row r the 16-byte piece p sits at p ^ (r % 8). Blocks and 8-row groups
// (1024 bytes) must be 1024-byte aligned, so the tile is.
template <int R>
__host__ __device__ constexpr int sw128_index(int r, int c) {
  return (c / 64) * (R * 64) + r * 64 + ((((c % 64) / 8) ^ (r % 8)) * 8) + c % 8;
}

// Rows [0, 64) of a [token][D] operand (full chunk rows) into an SW128 tile, 16-byte cp.async by
// kThreads threads; kLowerBlocks as load_rows's (P: the 16 x 16 blocks above the diagonal are
// zero-filled, nothing read).
template <typename T, int D, int kThreads, bool kLowerBlocks = false>
__device__ __forceinline__ void load_rows_sw128(T* dst, const T* src, int64_t token_stride) {
  static_assert(sizeof(T) == 2, "16-bit elements");
  constexpr int kPerVec = 8, kVecs = D / kPerVec, kRowStep = kThreads / kVecs;
  static_assert(kThreads % kVecs == 0 && kKdaChunk % kRowStep == 0, "whole rows per pass");
  const int c = (threadIdx.x % kVecs) * kPerVec, r0 = threadIdx.x / kVecs;
  const T* p = src + r0 * token_stride + c;
  const int64_t step = kRowStep * token_stride;
#pragma unroll 8
  for (int n = 0; n < kKdaChunk / kRowStep; ++n) {
    const int r = r0 + n * kRowStep;
    const bool valid = !kLowerBlocks || c < (r / kKdaSubChunk + 1) * kKdaSubChunk;
    cp_async_16(dst + sw128_index<kKdaChunk>(r, c), valid ? p : src, valid);
    p += step;
  }
}

// A shared-memory matrix descriptor in the 128-byte swizzle; byte offsets lbo, sbo.
__host__ __device__ constexpr uint64_t sw128_desc_bits(uint32_t smem_addr, uint32_t lbo, uint32_t sbo) {
  return uint64_t{(smem_addr & 0x3FFFFu) >> 4} | uint64_t{(lbo >> 4) & 0x3FFFu} << 16 |
         uint64_t{(sbo >> 4) & 0x3FFFu} << 32 | uint64_t{1} << 62;
}

// B of k-step ks from an SW128 tile of kKdaChunk rows stored [n][k]: n = the rows (8-row groups
// 1024 bytes apart), k = 16 columns of a 64-column block (32 bytes a step within it).
template <typename T>
__device__ __forceinline__ uint64_t desc_k(const T* tile, int ks) {
  const T* p = tile + (ks / 4) * (kKdaChunk * 64) + (ks % 4) * 16;
  return sw128_desc_bits(static_cast<uint32_t>(__cvta_generic_to_shared(p)), 16, 1024);
}

// B of k-step ks from an SW128 tile of kKdaChunk rows stored [k][n]: k = rows 16 ks .. + 15 (8-row
// groups 1024 bytes apart), n = the columns (64-column blocks kKdaChunk x 128 bytes apart).
template <typename T>
__device__ __forceinline__ uint64_t desc_mn(const T* tile, int ks) {
  const T* p = tile + ks * 16 * 64;
  return sw128_desc_bits(static_cast<uint32_t>(__cvta_generic_to_shared(p)), kKdaChunk * 128, 1024);
}

template <typename T, int N, Major kB, ScaleIn kA>
struct RsOp;
#define FLARE_KDA_RS_OP(T, N, NAME)                                       \
  template <Major kB, ScaleIn kA>                                         \
  struct RsOp<T, N, kB, kA> {                                             \
    using type = cute::SM90::GMMA::NAME<Major::K, kB, kA, ScaleIn::One>; \
  };
FLARE_KDA_RS_OP(__nv_bfloat16, 64, MMA_64x64x16_F32BF16BF16_RS)
FLARE_KDA_RS_OP(__nv_bfloat16, 128, MMA_64x128x16_F32BF16BF16_RS)
FLARE_KDA_RS_OP(__half, 64, MMA_64x64x16_F32F16F16_RS)
FLARE_KDA_RS_OP(__half, 128, MMA_64x128x16_F32F16F16_RS)
#undef FLARE_KDA_RS_OP

template <typename Op, int N8, size_t... I>
__device__ __forceinline__ void rs_issue(float (&d)[N8][4], const uint32_t (&a)[4], uint64_t desc,
                                         std::index_sequence<I...>) {
  Op::fma(a[0], a[1], a[2], a[3], desc, d[I / 4][I % 4]..., cute::SM90::GMMA::ScaleOut::One);
}

// d += (kA) a B over one k-step: d the warp's rows of an m64nN accumulator (N = 8 N8), a its A
// fragment, B from the descriptor (kB: Major::K for desc_k, Major::MN for desc_mn).
template <typename T, Major kB, ScaleIn kA = ScaleIn::One, int N8>
__device__ __forceinline__ void mma_rs(float (&d)[N8][4], const uint32_t (&a)[4], uint64_t desc) {
  rs_issue<typename RsOp<T, N8 * 8, kB, kA>::type>(d, a, desc, std::make_index_sequence<N8 * 4>{});
}

__device__ __forceinline__ void wg_arrive() { cute::warpgroup_arrive(); }
__device__ __forceinline__ void wg_commit() { cute::warpgroup_commit_batch(); }
template <int N>
__device__ __forceinline__ void wg_wait() { cute::warpgroup_wait<N>(); }

// Accumulators (float) or A fragments (uint32_t).
template <typename E, int N>
__device__ __forceinline__ void fence(E (&x)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) cute::warpgroup_fence_operand(x[i][j]);
}

}  // namespace flare::kda::gmma
