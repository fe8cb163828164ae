// A per-CTA timeline of the Hopper forward, for measurements only: in builds with
// -DFLARE_HOPPER_FWD_TIMELINE=1 (CMAKE_CUDA_FLAGS, so that the library and the benchmarks agree)
// the kernel stamps clock64 at each CTA's milestones, with its SM, into a device buffer; a
// benchmark then prints where a CTA's time goes (its start until Q and the first K land, the main
// loop per key tile, the epilogue) and what lies between consecutive CTAs on one SM (the launch
// and teardown the one-CTA-per-tile grid pays per tile). Default builds compile none of it.
#pragma once

#ifndef FLARE_HOPPER_FWD_TIMELINE
#define FLARE_HOPPER_FWD_TIMELINE 0
#endif

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "src/common/device_clock.h"

namespace flare::hopper {

// The stamps of one CTA (a tile, in the persistent grid), in its SM's clock.
enum FwdMark : int {
  kMarkStart,      // the kernel (or, persistent, the producer's tile) begins
  kMarkQIssued,    // the producer has issued Q's load
  kMarkKIssued,    // the producer has issued the first K load (after reading the tile's list)
  kMarkQLanded,    // consumer warpgroup 0 sees Q
  kMarkKLanded,    // consumer warpgroup 0 sees the first K
  kMarkLoopDone,   // consumer warpgroup 0's last PV GEMM has completed
  kMarkEnd,        // the later consumer warpgroup's epilogue stores are issued (atomicMax)
  kMarkSm,         // the SM's id
  kMarkTiles,      // key tiles the CTA walked
  kMarkFirstGemm,  // consumer warpgroup 0 has its GEMM turn for the first S (its tensor work begins)
  kMarkEpilogue0,  // consumer warpgroup 0's own epilogue stores are issued
  // Warpgroup 0 in its fourth key tile (kTimelineStep), for the main loop's critical path:
  kMarkStepTurn,     // its GEMM turn begins (S_n and the previous PV are issued next)
  kMarkStepIssued,   // both GEMMs are issued and the turn passed
  kMarkStepSDone,    // S_n has completed
  kMarkStepSoftmax,  // P_n's softmax is done
  kMarkStepPVDone,   // the previous PV has completed (P_n may now overwrite its registers); with
                     // two P sets (kTwoP) no wait: stamped right after kMarkStepSoftmax
  kMarkStepNext,     // the next tile's turn begins
  // %globaltimer (ns, one clock for every SM) at kMarkStart and kMarkEnd: the grid's fill, its
  // makespan against each SM's busy time (the last round's idle SMs)
  kMarkGlobalStart,
  kMarkGlobalEnd,
  kMarks
};
inline constexpr int kTimelineCtas = 1 << 16;  // stamps kept for CTAs (tiles) below this index
inline constexpr int kTimelineStep = 4;        // the key tile (1-based, in walk order) of the step stamps

#if FLARE_HOPPER_FWD_TIMELINE
// The device buffer [kTimelineCtas][kMarks] (allocated on first use).
unsigned long long* fwd_timeline_buffer();
// Zeroes the buffer on `stream` (before the launch to be looked at).
void fwd_timeline_reset(cudaStream_t stream);
// Reads the buffer back (synchronizing the device) and summarizes the stamped CTAs: medians and
// means of each phase in cycles and microseconds (at the device's clock rate), and the gaps
// between consecutive CTAs on each SM.
std::string fwd_timeline_summary();
#endif

#if defined(__CUDACC__)
__device__ __forceinline__ void timeline_mark(unsigned long long* tl, int cta, FwdMark m) {
  if (tl != nullptr && cta < kTimelineCtas) tl[static_cast<int64_t>(cta) * kMarks + m] = clock64();
}
__device__ __forceinline__ void timeline_mark_latest(unsigned long long* tl, int cta, FwdMark m) {
  if (tl != nullptr && cta < kTimelineCtas) atomicMax(&tl[static_cast<int64_t>(cta) * kMarks + m], clock64());
}
__device__ __forceinline__ void timeline_set(unsigned long long* tl, int cta, FwdMark m, unsigned long long v) {
  if (tl != nullptr && cta < kTimelineCtas) tl[static_cast<int64_t>(cta) * kMarks + m] = v;
}
using detail::global_ns;
__device__ __forceinline__ void timeline_mark_global(unsigned long long* tl, int cta, FwdMark m) {
  if (tl != nullptr && cta < kTimelineCtas) tl[static_cast<int64_t>(cta) * kMarks + m] = global_ns();
}
__device__ __forceinline__ void timeline_mark_global_latest(unsigned long long* tl, int cta, FwdMark m) {
  if (tl != nullptr && cta < kTimelineCtas) atomicMax(&tl[static_cast<int64_t>(cta) * kMarks + m], global_ns());
}
using detail::sm_id;
#endif

}  // namespace flare::hopper
