// Forcing the KDA state passes' value-slice width (FLARE_KDA_STATE_BV) in a test: the heuristic
// takes the widest slice that fills the GPU, so small test cases would see only the narrow ones.
#pragma once

#include <gtest/gtest.h>

#include <cstdlib>
#include <string>
#include <vector>

namespace flare::test {

// Calls run(bv) with the state passes forced to each width, then lets the heuristic choose again.
template <typename Run>
void with_each_state_slice_width(const std::vector<int>& widths, Run run) {
  for (int bv : widths) {
    ASSERT_EQ(setenv("FLARE_KDA_STATE_BV", std::to_string(bv).c_str(), 1), 0);
    SCOPED_TRACE("FLARE_KDA_STATE_BV=" + std::to_string(bv));
    run(bv);
  }
  unsetenv("FLARE_KDA_STATE_BV");
}

}  // namespace flare::test
