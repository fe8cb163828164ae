// Decode: a few query tokens per sequence against a long KV cache.
#pragma once

#include "flare/status.h"
#include "flare/tensor.h"
#include "flare/types.h"

namespace flare {

// q [batch, q_len (1..8), heads_q, head_dim]. The q_len new tokens are the last q_len of each
// sequence's cache_seqlens[b] tokens; with `causal`, query t sees keys
// [0, cache_seqlens[b] - q_len + t] (and, with window_left >= 0, no further back than window_left).
// Contiguous caches: k/v [batch, max_cache_len, heads_kv, head_dim].
// Paged caches: k/v [num_pages, page_size, heads_kv, head_dim] with page_table int32
// [batch, max_pages_per_seq]; page_size a power of two >= 16.
struct DecodeParams {
  TensorView q;
  TensorView k_cache, v_cache;
  TensorView page_table;      // optional (paged)
  TensorView cache_seqlens;   // int32 [batch]
  TensorView out;             // like q
  TensorView lse;             // optional fp32 [batch, heads_q, q_len]
  float softmax_scale = 0.f;  // 0: 1/sqrt(head_dim)
  bool causal = true;
  int window_left = -1;       // -1: unbounded
  Stream stream = nullptr;
};

// Merges partial attention states by their log-sum-exp (the split-KV combine; ring attention and
// cascade inference need it too). For each row n, over its num_states states s:
//   lse[n] = log(sum_s exp(partial_lse[n, s])),
//   out[n] = sum_s exp(partial_lse[n, s] - lse[n]) * partial_out[n, s].
// A state with LSE -inf contributes nothing (its partial output is not read into the sum); a row
// whose states all have LSE -inf gets out = 0, lse = -inf; a state with LSE +inf (the forward's
// mark of a row that saw no key) gives its row out = 0, lse = +inf, as ref::merge_states does.
// Rows are any leading dims (at most 3), flattened. Allocates nothing.
struct MergeStatesParams {
  TensorView partial_out;  // fp32 [rows..., num_states, dim], contiguous
  TensorView partial_lse;  // fp32 [rows..., num_states], contiguous
  TensorView out;          // fp32, bf16 or fp16 [rows..., dim]; last dim contiguous, any row strides
  TensorView lse;          // optional fp32 [rows...]
  Stream stream = nullptr;
};

Status merge_states(const MergeStatesParams& params);

}  // namespace flare
