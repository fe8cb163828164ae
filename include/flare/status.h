// Status returned by every flare entry point. Messages name the offending argument.
#pragma once

#include <string>
#include <utility>

namespace flare {

enum class StatusCode { kOk = 0, kInvalidArgument, kNotSupported, kCudaError, kInternal };

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status Ok() { return {}; }
  // "argument 'q': expected rank 3 or 4, got 2"
  static Status InvalidArgument(const std::string& arg, const std::string& what) {
    return {StatusCode::kInvalidArgument, "argument '" + arg + "': " + what};
  }
  static Status NotSupported(const std::string& what) { return {StatusCode::kNotSupported, what}; }
  static Status CudaError(const std::string& what) { return {StatusCode::kCudaError, what}; }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

const char* status_code_name(StatusCode c);

// A build configured with fewer head dims or dtypes (FLARE_HEAD_DIMS, FLARE_DTYPES) answers a call
// that needs one of the others NotSupported "... in this build ...": true for that answer.
inline bool not_in_this_build(const Status& s) {
  return s.code() == StatusCode::kNotSupported && s.message().find("in this build") != std::string::npos;
}

}  // namespace flare

// Return early from a function returning Status.
#define FLARE_RETURN_IF_ERROR(expr)          \
  do {                                       \
    ::flare::Status _flare_s = (expr);       \
    if (!_flare_s.ok()) return _flare_s;     \
  } while (0)
