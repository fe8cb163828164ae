// The clocks the measurement-only kernel timelines stamp (src/attention/hopper/fwd_timeline.h,
// src/decode/decode_timeline.h) beside clock64(): the global timer, one clock for every SM, and
// the SM a CTA runs on.
#pragma once

#include <cuda_runtime.h>

namespace flare::detail {

#if defined(__CUDACC__)
// %globaltimer: nanoseconds, the same clock on every SM.
__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ unsigned sm_id() {
  unsigned id;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(id));
  return id;
}
#endif

}  // namespace flare::detail
