// Warpgroup GEMM issue on wgmma (CuTe's GMMA atoms): one call issues every k step of a tile
// product as one asynchronous batch; the caller waits with wg_wait<N>() (N batches may stay in
// flight) before reading the accumulator or reusing a register operand.
#pragma once

#include <cute/tensor.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>

namespace flare::hopper {

// The thread to slice a tiled wgmma's shared-memory operands with: the first of the caller's
// warpgroup, read through a shuffle from lane 0, which the compiler knows to be warp-uniform. A
// GMMA descriptor depends on the warpgroup alone; sliced by the thread index itself, the
// descriptors sat in ordinary registers and each wgmma waited on their moves to uniform ones
// (R2UR). Accumulator partitions (coordinates) still take the thread index.
__device__ __forceinline__ int warpgroup_leader(int thread) {
  return 128 * __shfl_sync(0xffffffffu, thread / 128, 0);
}

// C (+)= A B over every k step of the fragments. A from shared memory (descriptors) or registers.
template <bool kZeroInit, typename TiledMma, typename FragA, typename FragB, typename FragC>
__device__ __forceinline__ void wg_gemm(TiledMma& mma, FragA& a, const FragB& b, FragC& c) {
  constexpr bool kARegisters = !std::is_same_v<typename FragA::iterator, cute::GMMA::DescriptorIterator>;
  if constexpr (kARegisters) cute::warpgroup_fence_operand(a);
  cute::warpgroup_fence_operand(c);
  cute::warpgroup_arrive();
  if constexpr (kZeroInit) mma.accumulate_ = cute::GMMA::ScaleOut::Zero;
  CUTE_UNROLL
  for (int k = 0; k < cute::size<2>(a); ++k) {
    cute::gemm(mma, a(cute::_, cute::_, k), b(cute::_, cute::_, k), c);
    mma.accumulate_ = cute::GMMA::ScaleOut::One;
  }
  cute::warpgroup_commit_batch();
  cute::warpgroup_fence_operand(c);
  if constexpr (kARegisters) cute::warpgroup_fence_operand(a);
}

// Waits until at most kInFlight issued batches are pending; fences the accumulator that was read.
template <int kInFlight, typename FragC>
__device__ __forceinline__ void wg_wait(FragC& c) {
  cute::warpgroup_wait<kInFlight>();
  cute::warpgroup_fence_operand(c);
}

}  // namespace flare::hopper
