// Host-side scalar conversions for the CPU oracles and test harnesses (no CUDA headers).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "flare/tensor.h"

namespace flare::ref {

inline float bits_to_float(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}
inline uint32_t float_to_bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

// bf16: the upper half of an fp32, rounded to nearest even.
inline uint16_t float_to_bf16(float f) {
  uint32_t b = float_to_bits(f);
  if (std::isnan(f)) return 0x7fc0;
  b += 0x7fff + ((b >> 16) & 1);
  return static_cast<uint16_t>(b >> 16);
}
inline float bf16_to_float(uint16_t h) { return bits_to_float(static_cast<uint32_t>(h) << 16); }

// IEEE binary16, round to nearest even, with subnormals and overflow to inf.
inline uint16_t float_to_fp16(float f) {
  uint32_t x = float_to_bits(f);
  uint32_t sign = (x >> 16) & 0x8000;
  uint32_t mag = x & 0x7fffffff;
  if (mag >= 0x7f800000) return static_cast<uint16_t>(sign | (mag > 0x7f800000 ? 0x7e00 : 0x7c00));
  if (mag >= 0x477ff000) return static_cast<uint16_t>(sign | 0x7c00);  // rounds to >= 65520
  if (mag < 0x38800000) {                                              // subnormal or zero
    float a = bits_to_float(mag);
    uint32_t m = static_cast<uint32_t>(std::nearbyint(a * 16777216.0f));  // a / 2^-24
    return static_cast<uint16_t>(sign | m);
  }
  uint32_t e = ((mag >> 23) - 112) << 10;
  uint32_t m = (mag >> 13) & 0x3ff;
  uint32_t rest = mag & 0x1fff;
  uint32_t h = e | m;
  if (rest > 0x1000 || (rest == 0x1000 && (h & 1))) ++h;
  return static_cast<uint16_t>(sign | h);
}
inline float fp16_to_float(uint16_t h) {
  uint32_t sign = (h & 0x8000u) << 16;
  uint32_t e = (h >> 10) & 0x1f;
  uint32_t m = h & 0x3ff;
  if (e == 0) {
    float v = std::ldexp(static_cast<float>(m), -24);
    return sign ? -v : v;
  }
  if (e == 31) return bits_to_float(sign | 0x7f800000 | (m << 13));
  return bits_to_float(sign | ((e + 112) << 23) | (m << 13));
}

// Round a value to what `dtype` can hold (identity for fp32/fp64).
inline double round_to(DType dtype, double x) {
  switch (dtype) {
    case DType::kBFloat16: return bf16_to_float(float_to_bf16(static_cast<float>(x)));
    case DType::kFloat16: return fp16_to_float(float_to_fp16(static_cast<float>(x)));
    case DType::kFloat32: return static_cast<float>(x);
    default: return x;
  }
}

// Element access through a view, with conversion. `offset` is in elements.
inline double load(const TensorView& t, int64_t offset) {
  const void* p = t.data;
  switch (t.dtype) {
    case DType::kFloat16: return fp16_to_float(static_cast<const uint16_t*>(p)[offset]);
    case DType::kBFloat16: return bf16_to_float(static_cast<const uint16_t*>(p)[offset]);
    case DType::kFloat32: return static_cast<const float*>(p)[offset];
    case DType::kFloat64: return static_cast<const double*>(p)[offset];
    case DType::kInt32: return static_cast<const int32_t*>(p)[offset];
    case DType::kInt64: return static_cast<double>(static_cast<const int64_t*>(p)[offset]);
    case DType::kUInt8: return static_cast<const uint8_t*>(p)[offset];
  }
  return 0;
}
inline void store(const TensorView& t, int64_t offset, double x) {
  void* p = t.data;
  switch (t.dtype) {
    case DType::kFloat16: static_cast<uint16_t*>(p)[offset] = float_to_fp16(static_cast<float>(x)); break;
    case DType::kBFloat16: static_cast<uint16_t*>(p)[offset] = float_to_bf16(static_cast<float>(x)); break;
    case DType::kFloat32: static_cast<float*>(p)[offset] = static_cast<float>(x); break;
    case DType::kFloat64: static_cast<double*>(p)[offset] = x; break;
    case DType::kInt32: static_cast<int32_t*>(p)[offset] = static_cast<int32_t>(x); break;
    case DType::kInt64: static_cast<int64_t*>(p)[offset] = static_cast<int64_t>(x); break;
    case DType::kUInt8: static_cast<uint8_t*>(p)[offset] = static_cast<uint8_t>(x); break;
  }
}
inline int64_t load_index(const TensorView& t, int64_t offset) {
  return t.dtype == DType::kInt64 ? static_cast<const int64_t*>(t.data)[offset]
                                  : static_cast<const int32_t*>(t.data)[offset];
}

}  // namespace flare::ref
