// The head dims this build instantiates (FLARE_HEAD_DIMS, flare_instantiated.h), for tests that
// sweep them.
#pragma once

#include <vector>

#include "flare_instantiated.h"

namespace flare::test {

// Ascending.
inline std::vector<int> instantiated_head_dims() {
  std::vector<int> dims;
#ifdef FLARE_HAS_HEAD_DIM_64
  dims.push_back(64);
#endif
#ifdef FLARE_HAS_HEAD_DIM_96
  dims.push_back(96);
#endif
#ifdef FLARE_HAS_HEAD_DIM_128
  dims.push_back(128);
#endif
#ifdef FLARE_HAS_HEAD_DIM_192
  dims.push_back(192);
#endif
#ifdef FLARE_HAS_HEAD_DIM_256
  dims.push_back(256);
#endif
  return dims;
}

}  // namespace flare::test
