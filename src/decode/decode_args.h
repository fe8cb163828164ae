// Validation of the decode params, and the shape facts the kernels need, derived once.
#pragma once

#include <cstdint>

#include "flare/decode.h"

namespace flare::detail {

// New tokens per sequence and step: plain decode is 1, speculative / multi-token decode up to 8.
inline constexpr int kMaxDecodeQueryLen = 8;
// A page holds at least one 16-row MMA tile of keys, so a tile never straddles two pages.
inline constexpr int kMinPageSize = 16;

// The head dims the decode kernels are instantiated for.
constexpr bool is_decode_head_dim(int d) { return d == 64 || d == 128 || d == 256; }

struct DecodeShape {
  int batch = 0, q_len = 0, heads_q = 0, heads_kv = 0, head_dim = 0;
  bool paged = false;
  int page_size = 0, num_pages = 0, max_pages_per_seq = 0;  // 0 when not paged
  // Keys one sequence can hold: k_cache's dim 1, or max_pages_per_seq * page_size when paged.
  int64_t max_cache_len = 0;
  float softmax_scale = 0.f;  // resolved (never 0)
};

// `device`: where the tensors must live (kCUDA for the GPU op, kCPU for the oracles and tests).
// With kCPU the values of cache_seqlens and page_table are checked too; device views are not read.
Status validate_decode(const DecodeParams& p, DeviceKind device, DecodeShape* s);

}  // namespace flare::detail
