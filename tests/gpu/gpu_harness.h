// GPU test helpers: device buffers, poisoned outputs, and the FlashAttention error rule:
// a kernel passes when max|out - ref64| <= k * max|lowp - ref64| + atol, where lowp is the same
// computation done in the input dtype (the oracle with emulate_input_dtype) and no element is
// left unwritten (poison shows as NaN).
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "reference/host_tensor.h"

namespace flare::test {

#define FLARE_CUDA_OK(expr)                                                               \
  do {                                                                                    \
    cudaError_t _e = (expr);                                                              \
    ASSERT_EQ(_e, cudaSuccess) << #expr << ": " << cudaGetErrorString(_e);                \
  } while (0)

// FLARE_TEST_REDUCED=1 (set for the compute-sanitizer runs): the tests run a small subset.
inline bool reduced() { return std::getenv("FLARE_TEST_REDUCED") != nullptr; }

inline bool gpu_present() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

#define FLARE_REQUIRE_GPU()                                         \
  do {                                                              \
    if (!::flare::test::gpu_present()) GTEST_SKIP() << "no CUDA device"; \
  } while (0)

// An sm_90 device: the Hopper kernels' tests skip elsewhere.
inline bool hopper_device() {
  int dev = 0, major = 0, minor = 0;
  return gpu_present() && cudaGetDevice(&dev) == cudaSuccess &&
         cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess &&
         cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) == cudaSuccess && major == 9 &&
         minor == 0;
}

#define FLARE_REQUIRE_HOPPER()                                                        \
  do {                                                                                \
    if (!::flare::test::hopper_device()) GTEST_SKIP() << "needs an sm_90 device";    \
  } while (0)

// A device copy of a host tensor's shape and dtype.
class DeviceTensor {
 public:
  DeviceTensor() = default;
  explicit DeviceTensor(const ref::HostTensor& like) { allocate(like); }
  DeviceTensor(const DeviceTensor&) = delete;
  DeviceTensor& operator=(const DeviceTensor&) = delete;
  ~DeviceTensor() {
    if (ptr_) cudaFree(ptr_);
  }

  void allocate(const ref::HostTensor& like) {
    bytes_ = like.nbytes();
    if (cudaMalloc(&ptr_, bytes_ ? bytes_ : 16) != cudaSuccess) ptr_ = nullptr;
    view_ = like.view();
    view_.data = ptr_;
    view_.device = Device{DeviceKind::kCUDA, 0};
  }
  void upload(const ref::HostTensor& h) { cudaMemcpy(ptr_, h.data(), bytes_, cudaMemcpyHostToDevice); }
  void download(ref::HostTensor& h) const { cudaMemcpy(h.data(), ptr_, bytes_, cudaMemcpyDeviceToHost); }
  // 0xFF bytes: NaN in every float dtype, so unwritten elements show.
  void poison() { cudaMemset(ptr_, 0xFF, bytes_); }
  const TensorView& view() const { return view_; }
  operator const TensorView&() const { return view_; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
  TensorView view_{};
};

struct ErrorReport {
  double max_err = 0;       // max |got - ref| (less one ulp of got's dtype at ref, with ulp_allowed)
  double lowp_err = 0;      // max |lowp - ref|
  int64_t nan_count = 0;    // unwritten or NaN outputs (where the reference is not NaN)
  int64_t inf_mismatch = 0; // where one side is +-inf and the other is not the same
  int64_t worst_index = -1;
  double worst_ref = 0;     // the reference value there
  bool ulp_allowed = false;
  std::string describe(const char* name) const {
    char buf[256];
    std::snprintf(buf, sizeof buf,
                  "%s: max err %.3g%s (low-precision baseline %.3g) nan %lld inf-mismatch %lld at %lld (ref %.4g)",
                  name, max_err, ulp_allowed ? " beyond 1 ulp" : "", lowp_err, (long long)nan_count,
                  (long long)inf_mismatch, (long long)worst_index, worst_ref);
    return buf;
  }
};

// One unit in the last place of `dtype` at magnitude |x| (significand bits: bf16 8, fp16 11, fp32
// 24, fp64 53; subnormals of the 16-bit types ignored: the floor is fp16's smallest normal ulp).
inline double ulp_of(DType dtype, double x) {
  const int bits = dtype == DType::kBFloat16 ? 8 : dtype == DType::kFloat16 ? 11 : dtype == DType::kFloat32 ? 24 : 53;
  const double floor = std::ldexp(1.0, -24);
  if (x == 0) return floor;
  int e = 0;
  std::frexp(std::abs(x), &e);  // |x| = m 2^e, m in [0.5, 1)
  return std::max(std::ldexp(1.0, e - bits), floor);
}

// Infinite values (masked rows' LSE) must match exactly; finite values are compared.
// allow_ulp: each element's error counts only beyond one ulp of got's dtype at the reference value.
// got is rounded to its dtype once, at the store, and so is the low-precision run's result; near a
// rounding boundary the two can round opposite ways, and the baseline, a maximum over all elements,
// need not contain that flip at the element where the kernel's lands (the backward fuzzer met
// this twice in a few thousand cases: dq 2.4x and dk 2.6x their baselines; the dk error, 0.0056,
// is 0.7-1.4 bf16 ulp if |dk| there is 0.5-2, its magnitude not recorded).
inline ErrorReport compare(const ref::HostTensor& got, const ref::HostTensor& ref, const ref::HostTensor* lowp,
                           bool allow_ulp = false) {
  ErrorReport r;
  r.ulp_allowed = allow_ulp;
  const DType got_dtype = got.view().dtype;
  for (int64_t i = 0; i < ref.numel(); ++i) {
    double g = got.get(i), e = ref.get(i);
    if (std::isnan(g) && !std::isnan(e)) {
      ++r.nan_count;
      continue;
    }
    if (std::isinf(e) || std::isinf(g)) {
      if (g != e) ++r.inf_mismatch;
      continue;
    }
    double err = std::abs(g - e);
    if (allow_ulp) err = std::max(0.0, err - ulp_of(got_dtype, e));
    if (err > r.max_err) r.max_err = err, r.worst_index = i, r.worst_ref = e;
    if (lowp) {
      double l = lowp->get(i);
      if (std::isfinite(l)) r.lowp_err = std::max(r.lowp_err, std::abs(l - e));
    }
  }
  return r;
}

// The FlashAttention rule.
inline ::testing::AssertionResult within_tolerance(const ErrorReport& r, const char* name, double k = 2.0,
                                                   double atol = 1e-5) {
  if (r.nan_count || r.inf_mismatch || !(r.max_err <= k * r.lowp_err + atol))
    return ::testing::AssertionFailure() << r.describe(name);
  return ::testing::AssertionSuccess() << r.describe(name);
}

}  // namespace flare::test
