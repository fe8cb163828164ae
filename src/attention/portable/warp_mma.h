// Tile primitives of the portable (sm_80+) kernels: one warp's view of the tensor cores.
//
// The m16n8k16 MMA fragments (g = lane / 4, t = lane % 4):
//   A 16x16: a0 (row g, cols 2t..2t+1), a1 (row g+8, ...), a2 (row g, cols 2t+8..), a3 (row g+8, cols 2t+8..)
//   B 16x8:  b0 (k rows 2t..2t+1, col g), b1 (k rows 2t+8..2t+9, col g)
//   C 16x8:  c0,c1 (row g, cols 2t, 2t+1), c2,c3 (row g+8, cols 2t, 2t+1)
// A C fragment pair of two adjacent 8-column tiles is exactly an A fragment of a 16-wide k step,
// which is how P goes from the QK^T accumulators into the PV product without touching memory.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace flare::portable {

template <typename T> struct ElemTraits;
template <> struct ElemTraits<__nv_bfloat16> {
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
  // The pair back as floats (exact: a bf16 is the top half of an fp32).
  static __device__ __forceinline__ float2 unpack(uint32_t v) {
    return make_float2(__uint_as_float(v << 16), __uint_as_float(v & 0xffff0000u));
  }
};
template <> struct ElemTraits<__half> {
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
  static __device__ __forceinline__ float2 unpack(uint32_t v) {
    return __half22float2(*reinterpret_cast<const __half2*>(&v));
  }
};

// D = A * B + D with fp32 accumulation.
// Two 16x8 fp32 accumulators (columns 0-7 and 8-15 of a 16x16 tile) as the A fragment of the next
// mma: the layouts match element for element, so P = softmax(S) feeds P V from registers.
template <typename T>
__device__ __forceinline__ void accum_to_a(const float (&lo)[4], const float (&hi)[4], uint32_t (&a)[4]) {
  a[0] = ElemTraits<T>::pack(lo[0], lo[1]);
  a[1] = ElemTraits<T>::pack(lo[2], lo[3]);
  a[2] = ElemTraits<T>::pack(hi[0], hi[1]);
  a[3] = ElemTraits<T>::pack(hi[2], hi[3]);
}

template <typename T>
__device__ __forceinline__ void mma_16x8x16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);

template <>
__device__ __forceinline__ void mma_16x8x16<__nv_bfloat16>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                                           uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <>
__device__ __forceinline__ void mma_16x8x16<__half>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Four 8x8 b16 matrices; lane l supplies the row address of matrix l / 8.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* row_ptr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(row_ptr)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* row_ptr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(row_ptr)));
}

// Four 8x8 b16 matrices from fragment registers (lane l holds row l / 4, columns 2 (l % 4) and
// + 1 of matrix q in r[q]) to shared memory transposed: lane 8 q + j supplies the address of row j
// of matrix q's transpose (16-byte aligned). stmatrix on sm_90; before it, 16-bit stores to the
// addresses the other lanes supply.
__device__ __forceinline__ void stmatrix_x4_trans(const uint32_t (&r)[4], void* row_ptr) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(smem_addr(row_ptr)),
               "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3])
               : "memory");
#else
  const int lane = threadIdx.x % 32;
  const uint32_t mine = smem_addr(row_ptr);
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const uint32_t lo_row = __shfl_sync(0xffffffffu, mine, q * 8 + 2 * (lane % 4));
    const uint32_t hi_row = __shfl_sync(0xffffffffu, mine, q * 8 + 2 * (lane % 4) + 1);
    asm volatile("st.shared.u16 [%0], %1;\n" ::"r"(lo_row + 2 * (lane / 4)), "h"(static_cast<unsigned short>(r[q] & 0xffffu)) : "memory");
    asm volatile("st.shared.u16 [%0], %1;\n" ::"r"(hi_row + 2 * (lane / 4)), "h"(static_cast<unsigned short>(r[q] >> 16)) : "memory");
  }
#endif
}

// 16-byte global -> shared copy that bypasses L1; zero-fills when `valid` is false. Without the
// 128-byte L2 prefetch hint FlashAttention-2's copies carry (.L2::128B): on the d256 and d128
// forward it measured 0.97-1.02 of these copies' time (bench/RESULTS.md, session 44).
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(smem)), "l"(gmem),
               "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// dst[0] += a, dst[1] += b in global memory without a return value: one vector reduction on
// sm_90, two scalar ones before. dst must be 8-byte aligned.
__device__ __forceinline__ void red_add_f32x2(float* dst, float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(dst), "f"(a), "f"(b) : "memory");
#else
  atomicAdd(dst, a);
  atomicAdd(dst + 1, b);
#endif
}

// red_add_f32x2 where `pred` holds, as a predicated PTX instruction on sm_90. ptxas may still
// branch around it, but allocates better than for a C++ `if` around red_add_f32x2 (bwd_add_dq's
// edge path: the d128 2-D backward's spill 16 -> 56 bytes with the `if`).
__device__ __forceinline__ void red_add_f32x2_if(bool pred, float* dst, float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %3, 0;\n @p red.global.add.v2.f32 [%0], {%1, %2};\n}\n" ::"l"(dst),
      "f"(a), "f"(b), "r"(static_cast<int>(pred))
      : "memory");
#else
  if (pred) red_add_f32x2(dst, a, b);
#endif
}

// tanh on the special-function unit (max relative error about 2^-11), for soft-capping.
__device__ __forceinline__ float fast_tanh(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

}  // namespace flare::portable
