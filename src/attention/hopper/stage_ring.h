// A ring of shared-memory stages filled by TMA and drained by consumer warps, on mbarriers.
//
// Each stage has a FULL barrier (the producer's expected byte count; the TMA engine completes it)
// and an EMPTY barrier (one arrival per consumer warp once its reads are done). Producer and
// consumers walk the ring with their own RingPos; the phase bit flips each lap. A fresh barrier
// counts as "previous phase complete", so the producer's first lap finds every stage empty.
#pragma once

#include <cstdint>

#include <cutlass/arch/barrier.h>

namespace flare::hopper {

struct RingPos {
  int index = 0;
  uint32_t phase = 0;
  template <int kStages>
  __device__ __forceinline__ void advance() {
    if (++index == kStages) {
      index = 0;
      phase ^= 1u;
    }
  }
};

template <int kStages>
struct StageBarriers {
  uint64_t full[kStages];
  uint64_t empty[kStages];

  // One thread, before the CTA-wide barrier that publishes the initialization.
  __device__ __forceinline__ void init(int consumer_arrivals) {
    for (int s = 0; s < kStages; ++s) {
      cutlass::arch::ClusterTransactionBarrier::init(&full[s], 1);
      cutlass::arch::ClusterBarrier::init(&empty[s], consumer_arrivals);
    }
  }
  // Producer: wait until the stage is free, then announce the bytes the TMA will deliver. Returns
  // the barrier the copy completes on.
  __device__ __forceinline__ uint64_t& acquire(const RingPos& pos, uint32_t bytes) {
    cutlass::arch::ClusterBarrier::wait(&empty[pos.index], pos.phase ^ 1u);
    cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&full[pos.index], bytes);
    return full[pos.index];
  }
  // Consumer: wait until the stage's bytes have landed.
  __device__ __forceinline__ void wait_full(const RingPos& pos) {
    cutlass::arch::ClusterTransactionBarrier::wait(&full[pos.index], pos.phase);
  }
  // Consumer: its reads of the stage are complete. One arrival of the count given to init: lane 0
  // of a warp after __syncwarp (K/V), or every consumer thread (the forward's Q: each thread's own
  // reads are then ordered before the producer's rewrite).
  __device__ __forceinline__ void release(const RingPos& pos) {
    cutlass::arch::ClusterBarrier::arrive(&empty[pos.index]);
  }
};

}  // namespace flare::hopper
