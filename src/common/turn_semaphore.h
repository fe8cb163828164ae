// Turn semaphores of the deterministic backward: an int in global memory counts the adds made
// into one accumulator; a writer spins until it holds its turn, adds, and hands the turn on. One
// thread calls these; the caller orders its other threads around them (a barrier) and makes its
// writes visible before the hand-over (a fence, or completed bulk operations).
#pragma once

#include <cuda_runtime.h>

namespace flare::device_sync {

// Spins until *sem == turn (acquire: what the previous holder wrote is visible after it).
__device__ __forceinline__ void wait_for_turn(const int* sem, int turn) {
  int v;
  do {
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(sem) : "memory");
  } while (v != turn);
}

// Hands the turn on (release: this thread's prior writes, and those it has observed, come first).
__device__ __forceinline__ void pass_turn(int* sem) {
  asm volatile("red.release.gpu.global.add.s32 [%0], 1;\n" ::"l"(sem), "r"(1) : "memory");
}

}  // namespace flare::device_sync
