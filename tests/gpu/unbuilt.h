// Cases whose kernel a reduced build leaves out. A build configured with fewer head dims or dtypes
// than the full set (FLARE_HEAD_DIMS, FLARE_DTYPES; the binaries tools/pack-build carries to the
// GPU machine, say) answers such a case NotSupported "... in this build". There the case is skipped
// and counted, and the count is printed when the binary ends; in a full build the same answer
// fails the case, so a dispatch that loses a kernel it has cannot hide behind this.
#pragma once

#include <gtest/gtest.h>

#include <cstdio>
#include <string>

#include "flare/status.h"
#include "flare_instantiated.h"

namespace flare::test {

// FLARE_REDUCED_BUILD: cmake/FlareInstantiate.cmake, against CMakeLists.txt's full sets.
inline constexpr bool kReducedBuild =
#ifdef FLARE_REDUCED_BUILD
    true;
#else
    false;
#endif

inline int& unbuilt_cases() {
  static int count = 0;
  return count;
}

class UnbuiltReport : public ::testing::Environment {
 public:
  void TearDown() override {
    if (unbuilt_cases() > 0)
      std::printf("%d case(s) skipped: their head dim or dtype is not instantiated in this build\n", unbuilt_cases());
  }
};
inline ::testing::Environment* const kUnbuiltReport = ::testing::AddGlobalTestEnvironment(new UnbuiltReport);

// True (and counted) when a reduced build answered `s` for a kernel it does not instantiate.
inline bool unbuilt(const Status& s) {
  if (!kReducedBuild || !not_in_this_build(s)) return false;
  ++unbuilt_cases();
  return true;
}

}  // namespace flare::test

// Returns from the enclosing void function when a reduced build lacks the case's kernel; else
// asserts that the call succeeded.
#define FLARE_ASSERT_OK_OR_UNBUILT(status_expr)        \
  do {                                                 \
    const ::flare::Status _st = (status_expr);         \
    if (::flare::test::unbuilt(_st)) return;           \
    ASSERT_TRUE(_st.ok()) << _st.message();            \
  } while (0)
