// Which form the KDA forward state passes take on the current device (kda_state_pass.cuh): the
// portable mma.sync one, or on sm_90 the wgmma one (kda_state_gmma.h), and what follows from it for
// the segmentation. Host functions, shared by the planner (kda_api.cpp) and the launch.
#pragma once

#include <cstdlib>

#include "src/common/device_facts.h"

namespace flare::kda {

// Whether the state passes take their wgmma form: a build with the Hopper kernels, an sm_90
// device, and FLARE_KDA_STATE_GMMA not 0 (tests and A/B runs set 0 for the portable form). Only
// the output pass's 64- and 128-column slices have that form.
inline bool use_state_gmma() {
#ifdef FLARE_WITH_HOPPER
  const detail::DeviceFacts& f = detail::current_device_facts();
  if (f.cc_major != 9 || f.cc_minor != 0) return false;
  const char* env = std::getenv("FLARE_KDA_STATE_GMMA");
  return env == nullptr || std::atoi(env) != 0;
#else
  return false;
#endif
}

// Whether the transitions have the wgmma form: where K + V <= 192. At K = V = 128 their 16 warps
// (128 registers a thread) spill and serialize the wgmma, so that shape keeps the portable ones.
constexpr bool transition_has_gmma(int K, int V) { return K + V <= 192; }

// Segment 0's default weight against the other segments (kda_segments_weighted, percent). Where
// the output pass runs on wgmma and the transitions beside segment 0 do not (K = V = 128), a
// transition's chunk step takes 1.38 times an output step (ncu at B2 T16384: 391 against 283 us
// for 86 chunks), so segment 0 is made longer: on the H100, 125 / 150 / 175 % gave B2 T16384
// 1.829 / 1.824 / 1.831 ms and B1 T32768 1.970 / 1.946 / 1.965, against 1.866-1.875 and
// 1.998-2.009 at 100 % (bench/RESULTS.md, session 17). Elsewhere the two steps match: 100.
inline int default_segment0_weight(int key_dim, int value_dim) {
  return use_state_gmma() && !transition_has_gmma(key_dim, value_dim) ? 150 : 100;
}

}  // namespace flare::kda
