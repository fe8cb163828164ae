// An owning host buffer with a TensorView over it: test inputs, oracle outputs, poisoned results.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

#include "flare/tensor.h"
#include "reference/numeric.h"

namespace flare::ref {

class HostTensor {
 public:
  HostTensor() = default;
  HostTensor(DType dtype, std::vector<int64_t> shape) { reset(dtype, std::move(shape)); }

  void reset(DType dtype, std::vector<int64_t> shape) {
    int64_t n = 1;
    for (int64_t s : shape) n *= s;
    bytes_.assign(static_cast<size_t>(n) * dtype_size(dtype) + 16, 0);
    view_ = TensorView{};
    view_.data = bytes_.data();
    view_.dtype = dtype;
    view_.device = Device{DeviceKind::kCPU, 0};
    view_.rank = static_cast<int>(shape.size());
    int64_t st = 1;
    for (int d = view_.rank - 1; d >= 0; --d) {
      view_.shape[d] = shape[d];
      view_.stride[d] = st;
      st *= shape[d];
    }
  }

  const TensorView& view() const { return view_; }
  operator const TensorView&() const { return view_; }
  int64_t numel() const { return view_.numel(); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(view_.dtype); }
  void* data() { return bytes_.data(); }
  const void* data() const { return bytes_.data(); }

  double get(int64_t i) const { return load(view_, i); }
  void set(int64_t i, double x) { store(view_, i, x); }

  // Uniform in [lo, hi), rounded to the dtype. Never all zeros.
  void fill_uniform(std::mt19937_64& rng, double lo = -1.0, double hi = 1.0) {
    std::uniform_real_distribution<double> dist(lo, hi);
    for (int64_t i = 0; i < numel(); ++i) set(i, dist(rng));
  }
  void fill_normal(std::mt19937_64& rng, double mean = 0.0, double stddev = 1.0) {
    std::normal_distribution<double> dist(mean, stddev);
    for (int64_t i = 0; i < numel(); ++i) set(i, dist(rng));
  }
  void fill(double x) {
    for (int64_t i = 0; i < numel(); ++i) set(i, x);
  }
  std::vector<double> to_double() const {
    std::vector<double> out(static_cast<size_t>(numel()));
    for (int64_t i = 0; i < numel(); ++i) out[static_cast<size_t>(i)] = get(i);
    return out;
  }

 private:
  std::vector<unsigned char> bytes_;
  TensorView view_{};
};

}  // namespace flare::ref
