// Ping-pong between consumer warpgroups: they take turns issuing their GEMMs, so that while one
// warpgroup's softmax runs on the FMA and exp2 units, the other's GEMMs keep the tensor cores busy.
//
// Warpgroup w waits on named barrier kFirstId + w until its predecessor passes the turn (an arrive
// of the predecessor's 128 threads), issues, and passes the turn to w + 1 (mod the count). The
// last warpgroup passes once at the start, so the first goes first. A warpgroup passes only after
// its own wait completed, so no barrier ever sees two passes before its wait.
#pragma once

#include <cstdint>

namespace flare::hopper {

template <int kWarpgroups, bool kEnabled>
struct GemmTurns {
  static constexpr int kFirstId = 1;  // 0 is __syncthreads
  static constexpr int kThreads = 256;

  __device__ __forceinline__ static void start(int wg) {
    if constexpr (kEnabled)
      if (wg == kWarpgroups - 1) arrive(kFirstId);
  }
  __device__ __forceinline__ static void wait(int wg) {
    if constexpr (kEnabled) asm volatile("bar.sync %0, %1;" ::"r"(kFirstId + wg), "n"(kThreads) : "memory");
  }
  __device__ __forceinline__ static void pass(int wg) {
    if constexpr (kEnabled) arrive(kFirstId + (wg + 1) % kWarpgroups);
  }

 private:
  __device__ __forceinline__ static void arrive(int id) {
    asm volatile("bar.arrive %0, %1;" ::"r"(id), "n"(kThreads) : "memory");
  }
};

}  // namespace flare::hopper
