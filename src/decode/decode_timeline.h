// A per-CTA timeline of the key-group decode kernel, for measurements only: in builds with
// -DFLARE_DECODE_TIMELINE=1 (CMAKE_CUDA_FLAGS, so that the library and bench_decode agree) the
// kernel stamps its SM clock at each CTA's milestones, and the global timer at its start and end,
// into a device buffer; bench_decode then prints where a CTA's time goes (start until the first
// keys land, the walk, the key groups' merge, the epilogue and combine) and how the grid's CTAs
// spread in time. Default builds compile none of it.
#pragma once

#ifndef FLARE_DECODE_TIMELINE
#define FLARE_DECODE_TIMELINE 0
#endif

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "src/common/device_clock.h"

namespace flare::decode {

enum DecodeMark : int {
  kDecodeMarkStart,       // clock64 at the CTA's start
  kDecodeMarkSetup,       // the producer is past the barrier setup (__syncthreads)
  kDecodeMarkIssued,      // the producer has issued its first stage
  kDecodeMarkLanded,      // consumer warp 0 sees its first stage
  kDecodeMarkLoopDone,    // consumer warp 0 has walked its keys
  kDecodeMarkMerged,      // the key groups have merged (consumer barrier passed)
  kDecodeMarkEnd,         // thread 0 is done (after the epilogue and any combine)
  kDecodeMarkStartNs,     // %globaltimer at the start
  kDecodeMarkEndNs,       // %globaltimer at the end
  kDecodeMarkSm,
  kDecodeMarkEpilogueDone,  // cluster combine: the CTA's states are in its shared memory
  kDecodeMarkClusterIn,     // cluster combine: past the first cluster barrier
  kDecodeMarkClusterMerged, // cluster combine: this CTA's slice merged and stored
  kDecodeMarks
};
inline constexpr int kDecodeTimelineCtas = 1 << 14;

#if FLARE_DECODE_TIMELINE
unsigned long long* decode_timeline_buffer();  // [kDecodeTimelineCtas][kDecodeMarks], allocated on first use
void decode_timeline_reset(cudaStream_t stream);
std::string decode_timeline_summary();  // synchronizes; medians of each phase over the stamped CTAs
#endif

#if defined(__CUDACC__)
__device__ __forceinline__ void decode_mark(unsigned long long* tl, DecodeMark m) {
  if (tl != nullptr && blockIdx.x < kDecodeTimelineCtas) {
    unsigned long long v;
    if (m == kDecodeMarkStartNs || m == kDecodeMarkEndNs) {
      v = detail::global_ns();
    } else if (m == kDecodeMarkSm) {
      v = detail::sm_id();
    } else {
      v = clock64();
    }
    tl[static_cast<int64_t>(blockIdx.x) * kDecodeMarks + m] = v;
  }
}
#endif

}  // namespace flare::decode
