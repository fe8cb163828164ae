// Tile configuration of the Hopper backward.
//
// A CTA owns kBlockN = 128 keys of one (sequence, q head): a producer warpgroup (TMA) and two
// consumer warpgroups of 64 keys each, which hold their keys' dK and dV in registers while the
// query blocks (kBlockM = 64 rows of Q and dO, kStages deep) stream past. dK and dV take
// 2 x head_dim / 2 registers a thread, so this tiling serves head dims up to 128; larger ones run
// the portable backward.
#pragma once

#include "src/attention/hopper/register_split.h"

namespace flare::hopper {

// Deterministic dQ turns: 0 = tile order (every kv block walks its query blocks ascending, turns
// in tile order: deadlock-free on any residency); 1 = rotated walks where every kv block sees every
// query block (dq_turns.h kAuto; needs a round of CTAs resident together).
#ifndef FLARE_HOPPER_BWD_ROTATE
#define FLARE_HOPPER_BWD_ROTATE 1
#endif

// dQ tiles in shared memory, each with its own writer thread: 2 keeps two adds (and in
// deterministic mode two turn handoffs) in flight; at most 3 (producer warps 1-3).
#ifndef FLARE_HOPPER_BWD_DQ_BUFS
#define FLARE_HOPPER_BWD_DQ_BUFS 2
#endif

template <int kHeadDim_, int kStages_ = 2>
struct HopperBwdConfig {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = 64;   // query rows per step
  static constexpr int kBlockN = 128;  // keys per CTA, 64 per consumer warpgroup
  static constexpr int kDqBufs = FLARE_HOPPER_BWD_DQ_BUFS;
  static_assert(kDqBufs >= 1 && kDqBufs <= 3, "one writer warp per dQ tile: producer warps 1-3");
  static constexpr int kConsumerWGs = 2;
  static constexpr int kStages = kStages_;
  static constexpr int kThreads = 128 * (kConsumerWGs + 1);
  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs = 240;
  static_assert(fits_register_file(kThreads, kProducerRegs, kConsumerRegs), "setmaxnreg would wait forever");
};

inline constexpr int kHopperBwdMaxHeadDim = 128;

}  // namespace flare::hopper
