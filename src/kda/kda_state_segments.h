// The forward state pass cut into segments along the sequence, for batches too small to fill the
// GPU. The pass is sequential over a sequence's chunks, so its parallelism is (sequences x value
// heads x value slices) CTAs; with one or two sequences that is a few warps per SM, each
// latency-bound. The chunk step is affine in the state,
//   S_{c+1} = T_c S_c + kg_c^T u_c,   T_c = Diag(decay_c) - kg_c^T w_c   (K x K),
// so a segment of chunks maps its start state S to X S + S0, where S0 is the segment run from a
// zero state and X = T_last ... T_first is the same recurrence run on the K columns of the
// identity with u = 0. Segment 0 starts from the known initial state, and no segment after the
// last needs a start, so (kda_fwd_launch.cuh):
//   phase A: segment 0's output pass (which ends in segment 1's start) beside the transitions of
//     segments 1 .. count-2 (S0 | X each, K x (V + K) "state" columns in one CTA: value columns
//     from 0 reading u, identity columns without u; no output);
//   combine (sequential over segments, tiny): start_{s+1} = X_s start_s + S0_s, in fp32;
//   phase B: the output pass of segments 1 .. count-1 from their starts (the last writes the
//     final state).
// Each phase is one wave of count - 1 CTAs per (sequence, value head), each walking one segment:
// the critical path is two segments' walks instead of the whole sequence's.
//
// Pure host functions: the rule below is tested on the CPU (tests/cpu/test_kda_args.cpp).
#pragma once

#include <algorithm>
#include <cstdint>

namespace flare::detail {

// Segments are at least this many chunks (below, the transition and combine costs are not small
// against the chunk steps they parallelise), at most this many per sequence.
inline constexpr int kKdaMinSegmentChunks = 16;
inline constexpr int kKdaMaxSegments = 16;

struct KdaStateSegments {
  int count = 1;   // segments per sequence (1: the unsegmented pass)
  int chunks = 0;  // chunks per segment after the first (the last may hold fewer); 0 when count is 1
  int first = 0;   // chunks of segment 0 (chunks unless weighted); 0 when count is 1
};

// count and chunks for `count` segments over chunks_per_row chunks (the last segment non-empty).
inline KdaStateSegments kda_segments_of(int64_t chunks_per_row, int count) {
  if (count <= 1 || chunks_per_row <= 1) return {};
  const int64_t chunks = (chunks_per_row + count - 1) / count;
  return {static_cast<int>((chunks_per_row + chunks - 1) / chunks), static_cast<int>(chunks), static_cast<int>(chunks)};
}

// As kda_segments_of, with segment 0 weighted first_weight_pct percent of each later segment:
// segment 0's output pass runs beside the transitions of segments 1 .. count-2, whose chunk steps
// may take longer or shorter than an output step, so the phase is shortest where their lengths
// are in the inverse ratio. At least a chunk in segment 0 and one in each later segment (the count
// may come out lower); 100 or below 1: kda_segments_of.
inline KdaStateSegments kda_segments_weighted(int64_t chunks_per_row, int count, int first_weight_pct) {
  if (count <= 1 || count > chunks_per_row || first_weight_pct == 100 || first_weight_pct < 1)
    return kda_segments_of(chunks_per_row, count);
  const int64_t weights = int64_t{count - 1} * 100 + first_weight_pct;
  const int64_t first =
      std::clamp<int64_t>((chunks_per_row * first_weight_pct + weights / 2) / weights, 1, chunks_per_row - (count - 1));
  const int64_t rest = chunks_per_row - first, chunks = (rest + count - 2) / (count - 1);
  return {1 + static_cast<int>((rest + chunks - 1) / chunks), static_cast<int>(chunks), static_cast<int>(first)};
}

// The segmentation of the forward state pass. wide_ctas: the output pass's CTAs without
// segments at its widest value slice (sequences x value heads x V / min(V, 128)), which run one
// per SM; each phase runs count - 1 times as many. The count: the most segments whose phases
// still fit in one wave (wide_ctas x (count - 1) <= SMs), at least 16 chunks each, at most 16;
// below 3 segments the phases would walk the whole sequence one after the other, so no segments.
// Varlen batches are not segmented (their sequences differ in length).
// forced_chunks > 0 (FLARE_KDA_STATE_SEGMENT, tests and tuning) sets the segment length instead.
// first_weight_pct: segment 0's length against the others' (kda_segments_weighted): the planner
// passes kda::default_segment0_weight (kda_state_forms.h: 150 where the transitions are slower
// than the output steps beside them, else 100) or FLARE_KDA_SEGMENT0_WEIGHT (tuning).
inline KdaStateSegments kda_state_segments(int64_t wide_ctas, int64_t chunks_per_row, bool varlen, int num_sms,
                                              int forced_chunks = 0, int first_weight_pct = 100) {
  if (varlen || chunks_per_row <= 1 || wide_ctas <= 0) return {};
  if (forced_chunks > 0)
    return kda_segments_weighted(chunks_per_row,
                                 static_cast<int>((chunks_per_row + forced_chunks - 1) / forced_chunks),
                                 first_weight_pct);
  if (num_sms <= 0) return {};  // no device facts
  const int64_t count = std::min<int64_t>({num_sms / wide_ctas + 1, chunks_per_row / kKdaMinSegmentChunks,
                                           int64_t{kKdaMaxSegments}});
  return count >= 3 ? kda_segments_weighted(chunks_per_row, static_cast<int>(count), first_weight_pct)
                    : KdaStateSegments{};
}

}  // namespace flare::detail
