// Non-owning tensor view: what every flare entry point takes. No framework types.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>

namespace flare {

enum class DType : uint8_t { kFloat16, kBFloat16, kFloat32, kFloat64, kInt32, kInt64, kUInt8 };

constexpr std::size_t dtype_size(DType t) {
  switch (t) {
    case DType::kFloat16:
    case DType::kBFloat16: return 2;
    case DType::kFloat32:
    case DType::kInt32: return 4;
    case DType::kFloat64:
    case DType::kInt64: return 8;
    case DType::kUInt8: return 1;
  }
  return 0;
}

const char* dtype_name(DType t);

enum class DeviceKind : uint8_t { kCPU, kCUDA };

struct Device {
  DeviceKind kind = DeviceKind::kCUDA;
  int index = 0;
};

inline constexpr int kMaxRank = 5;

// A strided view of memory owned by someone else. Strides are in elements.
// A default-constructed view (data == nullptr, rank 0) means "not given" for optional arguments.
struct TensorView {
  void* data = nullptr;
  DType dtype = DType::kFloat32;
  int rank = 0;
  int64_t shape[kMaxRank] = {};
  int64_t stride[kMaxRank] = {};
  Device device{};

  bool defined() const { return data != nullptr || rank > 0; }
  int64_t size(int dim) const { return shape[dim < 0 ? dim + rank : dim]; }
  int64_t numel() const {
    int64_t n = 1;
    for (int i = 0; i < rank; ++i) n *= shape[i];
    return n;
  }
  bool is_contiguous() const {
    int64_t expect = 1;
    for (int i = rank - 1; i >= 0; --i) {
      if (shape[i] != 1 && stride[i] != expect) return false;
      expect *= shape[i];
    }
    return true;
  }
  template <typename T>
  T* ptr() const { return static_cast<T*>(data); }

  // A contiguous (row-major) view.
  static TensorView contiguous(void* data, DType dtype, std::initializer_list<int64_t> shape,
                               Device device = {}) {
    TensorView t;
    t.data = data;
    t.dtype = dtype;
    t.device = device;
    t.rank = static_cast<int>(shape.size());
    int i = 0;
    for (int64_t s : shape) t.shape[i++] = s;
    int64_t st = 1;
    for (int d = t.rank - 1; d >= 0; --d) {
      t.stride[d] = st;
      st *= t.shape[d];
    }
    return t;
  }
};

}  // namespace flare
