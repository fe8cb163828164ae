// The CPU emulation of the turn semaphores (src/common/turn_semaphore.h), for kernel code run
// under tests/cpu/cuda_emu/cuda_emu.h. The emulation runs the blocks one after another in launch
// order, and the kernels' turn orders follow the launch order (a block only waits for blocks
// launched before it), so a block's turn has come by the time it asks, or never will: on the GPU
// that would be a deadlock. The emulation reports it and aborts instead of spinning.
#pragma once

#include <atomic>
#include <cstdio>
#include <cstdlib>

#include "cuda_emu.h"

namespace flare::device_sync {

inline void wait_for_turn(const int* sem, int turn) {
  const int v = std::atomic_ref<int>(*const_cast<int*>(sem)).load(std::memory_order_acquire);
  if (v != turn) {
    std::fprintf(stderr,
                 "turn semaphore %p: block (%u, %u, %u) waits for turn %d but the count is %d once every block "
                 "launched before it has finished: it would wait forever\n",
                 static_cast<const void*>(sem), blockIdx.x, blockIdx.y, blockIdx.z, turn, v);
    std::abort();
  }
}

inline void pass_turn(int* sem) { std::atomic_ref<int>(*sem).fetch_add(1, std::memory_order_release); }

}  // namespace flare::device_sync
