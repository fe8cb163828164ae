// The chunk prep's CTA order: which (chunk, value head) the CTA at position i of its 1-D grid
// prepares. CTAs start in grid order, so the order decides which inputs are read together and
// which of the prep's results are written last. Pure host/device functions (tests/cpu/test_kda_args.cpp).
//   kChunkMajor: consecutive CTAs take consecutive chunks of one value head (the order of the
//     earlier (chunk, head) grid);
//   kHeadMajor: consecutive CTAs take the value heads of one chunk, whose rows of q, k, v and the
//     gate lie side by side in memory;
//   kHeadMajorReversed: head-major from the last chunk back, so that the chunks the state pass
//     reads first (each sequence's first ones) are the last written, still in L2 when it starts.
// FLARE_KDA_PREP_ORDER=0|1|2 chooses (tuning). The default is kHeadMajorReversed: on the H100 the
// whole forward is 0.5-2.5 % faster with either head-major order than chunk-major (B2 T16384 1.936
// -> 1.910 ms, B8 T4096 layer 1.858 -> 1.815; bench/RESULTS.md, session 17), the reversed one by a
// hair.
#pragma once

#include <cstdint>

#include "src/scheduling/mask_math.h"  // FLARE_HD

namespace flare::detail {

enum KdaPrepOrder : int { kChunkMajor = 0, kHeadMajor = 1, kHeadMajorReversed = 2 };

struct KdaPrepCta {
  int chunk, hv;
};

// CTA i of max_chunks x heads_v (0 <= i < max_chunks * heads_v).
FLARE_HD KdaPrepCta kda_prep_cta(int64_t i, int max_chunks, int heads_v, int order) {
  if (order == kChunkMajor) return {static_cast<int>(i % max_chunks), static_cast<int>(i / max_chunks)};
  const int chunk = static_cast<int>(i / heads_v), hv = static_cast<int>(i % heads_v);
  return {order == kHeadMajorReversed ? max_chunks - 1 - chunk : chunk, hv};
}

}  // namespace flare::detail
