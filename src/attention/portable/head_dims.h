// The head dims this build instantiates (FLARE_HEAD_DIMS): a head dim is served by the smallest
// instantiated one at least as large.
#pragma once

#include <type_traits>

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

}  // namespace flare::portable
