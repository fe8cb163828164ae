// Test checks on a flare::Status: the argument rules' tests expect an InvalidArgument that names
// the offending argument.
#pragma once

#include <gtest/gtest.h>

#include <string>

#include "flare/status.h"

namespace flare::test {

// An InvalidArgument whose message quotes 'arg' and contains `what` (when given).
inline ::testing::AssertionResult rejects(const Status& st, const std::string& arg, const std::string& what = "") {
  if (st.ok()) return ::testing::AssertionFailure() << "accepted; expected an error about '" << arg << "'";
  if (st.code() != StatusCode::kInvalidArgument)
    return ::testing::AssertionFailure() << "not an invalid-argument error: " << st.message();
  if (st.message().find("'" + arg + "'") == std::string::npos)
    return ::testing::AssertionFailure() << "does not name '" << arg << "': " << st.message();
  if (!what.empty() && st.message().find(what) == std::string::npos)
    return ::testing::AssertionFailure() << "does not say \"" << what << "\": " << st.message();
  return ::testing::AssertionSuccess();
}

}  // namespace flare::test
