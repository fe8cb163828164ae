// Host side of the measurement-only kernel timelines (src/attention/hopper/fwd_timeline.h,
// src/decode/decode_timeline.h): a zeroed device buffer of 64-bit stamps allocated on first use,
// its reset on a stream, its read-back, and the statistics their summaries print.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdio>
#include <vector>

namespace flare::detail {

class StampBuffer {
 public:
  StampBuffer(std::size_t count, const char* name) : count_(count), name_(name) {}

  // The device buffer (null, with a message, where it cannot be allocated).
  unsigned long long* get() {
    if (!tried_) {
      tried_ = true;
      void* p = nullptr;
      if (cudaMalloc(&p, bytes()) != cudaSuccess || cudaMemset(p, 0, bytes()) != cudaSuccess) {
        std::fprintf(stderr, "%s: no buffer\n", name_);
        p = nullptr;
      }
      buffer_ = static_cast<unsigned long long*>(p);
    }
    return buffer_;
  }
  void reset(cudaStream_t stream) {
    if (unsigned long long* b = get()) (void)cudaMemsetAsync(b, 0, bytes(), stream);
  }
  // Synchronizes the device and copies the stamps out; false where either fails.
  bool read(std::vector<unsigned long long>* out) {
    unsigned long long* b = get();
    if (b == nullptr || cudaDeviceSynchronize() != cudaSuccess) return false;
    out->resize(count_);
    return cudaMemcpy(out->data(), b, bytes(), cudaMemcpyDeviceToHost) == cudaSuccess;
  }

 private:
  std::size_t bytes() const { return count_ * sizeof(unsigned long long); }
  std::size_t count_;
  const char* name_;
  bool tried_ = false;
  unsigned long long* buffer_ = nullptr;
};

// Clock ticks per microsecond of the current device (its reported clock rate).
inline double device_cycles_per_us() {
  int device = 0, khz = 0;
  (void)cudaGetDevice(&device);
  (void)cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, device);
  return khz > 0 ? khz / 1000.0 : 1.0;
}

inline double median_of(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}
inline double mean_of(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x;
  return v.empty() ? 0 : s / static_cast<double>(v.size());
}

}  // namespace flare::detail
