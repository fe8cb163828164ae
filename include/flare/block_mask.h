// Building block-sparse masks (mask.h's BlockMask) on the GPU from element predicates, fast
// enough to rebuild per step: every block is classified exactly as the host builder does
// (FULL: every element inside the sequence visible, EMPTY: none, else PARTIAL), the causal,
// window and prefix-LM predicates per row in O(1), document ids and bits per element.
#pragma once

#include "flare/mask.h"
#include "flare/status.h"
#include "flare/types.h"

namespace flare {

struct BlockMaskBuildParams {
  // The mask's dims. batch / heads may be 1: the same lists serve every batch entry / head
  // (valid only when the predicate does not depend on it: doc ids need the real batch, bits
  // with a head dim need the real heads).
  int batch = 1, heads = 1;
  int seqlen_q = 0, seqlen_k = 0;
  int q_block_size = 128, kv_block_size = 128;  // positive multiples of 16
  ElementMask element;                         // CUDA tensors; becomes the mask's element mask
  Stream stream = nullptr;
};

// Fills `mask`'s lists, which the caller allocates in CUDA memory (int32, last dim contiguous):
//   kv_num_blocks, full_kv_num_blocks   [batch, heads, num_q_blocks]
//   kv_indices, full_kv_indices         [batch, heads, num_q_blocks, num_kv_blocks]
// and, optionally (all four or none), the transposed lists the backward walks:
//   q_num_blocks, full_q_num_blocks     [batch, heads, num_kv_blocks]
//   q_indices, full_q_indices           [batch, heads, num_kv_blocks, num_q_blocks]
// with num_q_blocks = ceil(seqlen_q / q_block_size), num_kv_blocks likewise. Each row lists its
// blocks ascending, the rest of the row 0. Sets mask->q_block_size, kv_block_size and element
// from `params`, so *mask is ready for attention_forward. Asynchronous on params.stream, no
// allocation, no host synchronization (CUDA-graph capturable).
Status build_block_mask(const BlockMaskBuildParams& params, BlockMask* mask);

}  // namespace flare
