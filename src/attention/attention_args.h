// Validation of the attention params, and the shape facts the kernels need, derived once.
#pragma once

#include <cstdint>

#include "flare/attention.h"

namespace flare::detail {

struct AttentionShape {
  int batch = 0;
  int heads = 0, heads_kv = 0, head_dim = 0;
  int seqlen_q = 0, seqlen_k = 0;  // batched: the lengths; varlen: the max lengths
  bool varlen = false;
  int64_t total_q = 0, total_k = 0;  // rows of q / k (batch * seqlen when batched)
  float softmax_scale = 0.f;         // resolved (never 0)
};

// `device`: where the tensors must live (kCUDA for the GPU ops, kCPU for the oracles and tests).
Status validate_attention_forward(const AttentionForwardParams& p, DeviceKind device, AttentionShape* shape);
Status validate_attention_backward(const AttentionBackwardParams& p, DeviceKind device, AttentionShape* shape);

}  // namespace flare::detail
