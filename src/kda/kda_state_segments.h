// The forward state pass cut into segments along the sequence, for batches too small to fill the
// GPU. The pass is sequential over a sequence's chunks, so its parallelism is (sequences x value
// heads x value slices) CTAs; with one or two sequences that is a few warps per SM, each
// latency-bound. The chunk step is affine in the state,
//   S_{c+1} = T_c S_c + kg_c^T u_c,   T_c = Diag(decay_c) - kg_c^T w_c   (K x K),
// so a segment of chunks maps its start state S to X S + S0, where S0 is the segment run from a
// zero state and X = T_last ... T_first is the same recurrence run on the K columns of the
// identity with u = 0. Hence three kernels instead of one:
//   transition (segments 0 .. count-2, all in parallel): S0 and X of each segment, as one
//     K x (V + K) "state" whose first V columns start at 0 and read u, the other K start at the
//     identity and read no u (no output);
//   combine (sequential over segments, tiny): start_{s+1} = X_s start_s + S0_s, in fp32, from
//     start_0 = the initial state;
//   output (every segment in parallel): the ordinary pass over the segment's chunks from start_s,
//     writing the output (and, in the last segment, the final state).
// About 2.5x the state pass's arithmetic, spread over count times as many CTAs.
//
// Pure host functions: the rule below is tested on the CPU (tests/cpu/test_kda_args.cpp).
#pragma once

#include <algorithm>
#include <cstdint>

#include "flare/decode_plan.h"  // decode_wave_efficiency

namespace flare::detail {

// Segments are at least this many chunks (below, the transition and combine costs are not small
// against the chunk steps they parallelise), at most this many per sequence.
inline constexpr int kKdaMinSegmentChunks = 16;
inline constexpr int kKdaMaxSegments = 16;
// The count chosen: the fewest segments whose wave efficiency is within this fraction of the best.
inline constexpr double kKdaSegmentWaveSlack = 0.05;

struct KdaStateSegments {
  int count = 1;   // segments per sequence (1: the unsegmented pass)
  int chunks = 0;  // chunks per segment (the last may hold fewer); 0 when count is 1
};

// count and chunks for `count` segments over chunks_per_row chunks (the last segment non-empty).
inline KdaStateSegments kda_segments_of(int64_t chunks_per_row, int count) {
  if (count <= 1 || chunks_per_row <= 1) return {};
  const int64_t chunks = (chunks_per_row + count - 1) / count;
  return {static_cast<int>((chunks_per_row + chunks - 1) / chunks), static_cast<int>(chunks)};
}

// The segmentation of the forward state pass. wide_ctas: the output pass's CTAs without
// segments at its widest value slice (sequences x value heads x V / min(V, 128)), which run one
// per SM. Segments where those fill at most half the SMs; their count: the fewest (at least 16
// chunks each, at most 16) whose CTAs fill the waves (decode_wave_efficiency) within 5 % of the
// best count. Varlen batches are not segmented (their sequences differ in length).
// forced_chunks > 0 (FLARE_KDA_STATE_SEGMENT, tests and tuning) sets the segment length instead.
inline KdaStateSegments kda_state_segments(int64_t wide_ctas, int64_t chunks_per_row, bool varlen, int num_sms,
                                              int forced_chunks = 0) {
  if (varlen || chunks_per_row <= 1 || wide_ctas <= 0) return {};
  if (forced_chunks > 0)
    return kda_segments_of(chunks_per_row, static_cast<int>((chunks_per_row + forced_chunks - 1) / forced_chunks));
  // No device facts, or half the SMs have a CTA already (the unsegmented pass then runs narrower
  // slices on the rest; segments would buy little for their extra arithmetic).
  if (num_sms <= 0 || wide_ctas * 2 > num_sms) return {};
  const int most = static_cast<int>(std::min<int64_t>(chunks_per_row / kKdaMinSegmentChunks, kKdaMaxSegments));
  double best = 0;
  for (int count = 1; count <= most; ++count) best = std::max(best, decode_wave_efficiency(wide_ctas * count, num_sms));
  for (int count = 1; count <= most; ++count)
    if (decode_wave_efficiency(wide_ctas * count, num_sms) >= best * (1 - kKdaSegmentWaveSlack))
      return kda_segments_of(chunks_per_row, count);
  return {};
}

}  // namespace flare::detail
