// The head dims this build instantiates (FLARE_HEAD_DIMS): a head dim is served by the smallest
// instantiated one at least as large.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <string>
#include <type_traits>

#include "flare/status.h"
#include "flare/types.h"

#include "flare_instantiated.h"

namespace flare::portable {

inline constexpr int kLargestHeadDim =
#if defined(FLARE_HAS_HEAD_DIM_256)
    256;
#elif defined(FLARE_HAS_HEAD_DIM_192)
    192;
#elif defined(FLARE_HAS_HEAD_DIM_128)
    128;
#elif defined(FLARE_HAS_HEAD_DIM_96)
    96;
#else
    64;
#endif

// 0 when no instantiated head dim can serve d.
constexpr int instantiated_head_dim(int d) {
#ifdef FLARE_HAS_HEAD_DIM_64
  if (d <= 64) return 64;
#endif
#ifdef FLARE_HAS_HEAD_DIM_96
  if (d <= 96) return 96;
#endif
#ifdef FLARE_HAS_HEAD_DIM_128
  if (d <= 128) return 128;
#endif
#ifdef FLARE_HAS_HEAD_DIM_192
  if (d <= 192) return 192;
#endif
#ifdef FLARE_HAS_HEAD_DIM_256
  if (d <= 256) return 256;
#endif
  return 0;
}

// f(std::integral_constant<int, D>{}) for D = instantiated_head_dim(d) (which must be non-zero).
template <typename F>
decltype(auto) visit_head_dim(int d, F&& f) {
  switch (instantiated_head_dim(d)) {
#ifdef FLARE_HAS_HEAD_DIM_64
    case 64: return f(std::integral_constant<int, 64>{});
#endif
#ifdef FLARE_HAS_HEAD_DIM_96
    case 96: return f(std::integral_constant<int, 96>{});
#endif
#ifdef FLARE_HAS_HEAD_DIM_128
    case 128: return f(std::integral_constant<int, 128>{});
#endif
#ifdef FLARE_HAS_HEAD_DIM_192
    case 192: return f(std::integral_constant<int, 192>{});
#endif
    default: break;
  }
  // 256, or (for a head dim the caller did not check) the largest instantiated one.
  return f(std::integral_constant<int, kLargestHeadDim>{});
}

// f(std::integral_constant<int, D>{}, T{}) for the instantiated head dim D serving `head_dim` and
// the dtype's element type T (__nv_bfloat16 or __half); NotSupported naming what the build lacks.
template <typename F>
Status visit_instantiation(int head_dim, DType dtype, F&& f) {
  if (instantiated_head_dim(head_dim) == 0)
    return Status::NotSupported("head dim " + std::to_string(head_dim) +
                                ": no kernel instantiated for it in this build (see FLARE_HEAD_DIMS)");
  if (dtype == DType::kBFloat16) {
#ifdef FLARE_HAS_DTYPE_bf16
    return visit_head_dim(head_dim, [&](auto hd) { return f(hd, __nv_bfloat16{}); });
#endif
  } else if (dtype == DType::kFloat16) {
#ifdef FLARE_HAS_DTYPE_fp16
    return visit_head_dim(head_dim, [&](auto hd) { return f(hd, __half{}); });
#endif
  }
  return Status::NotSupported(std::string("dtype ") + dtype_name(dtype) +
                              ": no kernel instantiated for it in this build (see FLARE_DTYPES)");
}

}  // namespace flare::portable
