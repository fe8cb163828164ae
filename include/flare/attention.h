// Softmax attention: forward and backward.
//
// Layout follows FlashAttention. Batched: q [batch, seqlen_q, heads, head_dim],
// k/v [batch, seqlen_k, heads_kv, head_dim]. Varlen: q [total_q, heads, head_dim],
// k/v [total_k, heads_kv, head_dim] with cu_seqlens_q/k int32 [batch + 1].
// heads_kv divides heads (GQA/MQA). The last dimension is contiguous; other strides are free.
// The log-sum-exp is fp32 [batch, heads, seqlen_q] (varlen: [heads, total_q]), natural log,
// +inf for rows that see no key (their output is 0).
#pragma once

#include <cstddef>
#include <cstdint>

#include "flare/mask.h"
#include "flare/status.h"
#include "flare/tensor.h"
#include "flare/types.h"

namespace flare {

struct BlockSparseDqPlan;  // block_mask.h

inline constexpr int kMaxHeadDim = 256;

struct AttentionForwardParams {
  TensorView q, k, v;          // fp16 or bf16, same dtype
  TensorView out;              // like q
  TensorView lse;              // optional fp32 (see above)
  TensorView cu_seqlens_q;     // optional int32 [batch + 1] (varlen)
  TensorView cu_seqlens_k;     // required with cu_seqlens_q
  int max_seqlen_q = 0;        // varlen only: upper bound of the sequence lengths
  int max_seqlen_k = 0;
  float softmax_scale = 0.f;   // 0: 1/sqrt(head_dim)
  float softcap = 0.f;         // > 0: scores = softcap * tanh(scale * q.k / softcap)
  TensorView sinks;            // optional fp32 [heads]: a logit per head that joins the softmax
                               // denominator (gpt-oss attention sinks); contributes no value
  MaskParams mask;
  const BlockMask* block_mask = nullptr;  // block-sparse attention when set
  // Scratch from attention_forward_workspace_size() (0 bytes for most problems), 16-byte aligned;
  // nullptr: allocated on `stream` per call where one is needed.
  void* workspace = nullptr;
  std::size_t workspace_bytes = 0;
  Backend backend = Backend::kAuto;
  Stream stream = nullptr;
};

struct AttentionBackwardParams {
  TensorView q, k, v, out, dout;  // as in the forward; dout like out
  TensorView lse;                 // fp32 from the forward (required)
  TensorView dq, dk, dv;          // outputs, shaped like q, k, v
  TensorView dsinks;              // optional fp32 [heads], required when sinks are given
  TensorView cu_seqlens_q, cu_seqlens_k;
  int max_seqlen_q = 0, max_seqlen_k = 0;
  float softmax_scale = 0.f;
  float softcap = 0.f;
  TensorView sinks;
  MaskParams mask;
  const BlockMask* block_mask = nullptr;
  // dQ (and GQA's dK/dV) summed in a fixed order: bitwise identical results run to run. With a
  // block_mask it needs the mask's plan (block_mask.h: make_block_sparse_dq_plan) and the
  // device copy of its data.
  bool deterministic = false;
  const BlockSparseDqPlan* block_mask_dq_plan = nullptr;
  const int32_t* block_mask_dq_plan_data = nullptr;
  // Scratch from attention_backward_workspace_size(); nullptr: allocated on `stream` per call.
  void* workspace = nullptr;
  std::size_t workspace_bytes = 0;
  Backend backend = Backend::kAuto;
  Stream stream = nullptr;
};

// The scratch the forward needs on the current device (the Hopper kernel splits the ragged last
// round of some grids into key ranges merged after it; with a block mask it orders its tiles by
// their list rows' lengths); 0 when none.
Status attention_forward_workspace_size(const AttentionForwardParams& params, std::size_t* bytes);
Status attention_forward(const AttentionForwardParams& params);
Status attention_backward_workspace_size(const AttentionBackwardParams& params, std::size_t* bytes);
Status attention_backward(const AttentionBackwardParams& params);

}  // namespace flare
