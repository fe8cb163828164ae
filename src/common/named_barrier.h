// Named barriers (bar.sync / bar.arrive): barrier kId (1-15; 0 is __syncthreads') of `threads`
// threads, a multiple of 32. named_sync waits until `threads` have arrived; named_arrive only
// arrives (a producer that lets its consumers go without waiting for them).
#pragma once

namespace flare::device {

template <int kId>
__device__ __forceinline__ void named_sync(int threads) {
  static_assert(kId >= 1 && kId <= 15, "barrier 0 is __syncthreads'");
  asm volatile("bar.sync %0, %1;\n" ::"n"(kId), "r"(threads) : "memory");
}
template <int kId>
__device__ __forceinline__ void named_arrive(int threads) {
  static_assert(kId >= 1 && kId <= 15, "barrier 0 is __syncthreads'");
  asm volatile("bar.arrive %0, %1;\n" ::"n"(kId), "r"(threads) : "memory");
}

}  // namespace flare::device
