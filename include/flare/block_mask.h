// Building block-sparse masks (mask.h's BlockMask) on the GPU from element predicates, fast
// enough to rebuild per step: every block is classified exactly as the host builder does
// (FULL: every element inside the sequence visible, EMPTY: none, else PARTIAL), the causal,
// window and prefix-LM predicates per row in O(1), document ids and bits per element.
#pragma once

#include <cstdint>
#include <vector>

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

// The deterministic block-sparse backward's plan: for every (batch, head, kv block) the q blocks
// it visits and in which order, the turn of each of its dQ adds at its q block, the GQA dK/dV
// turns, and the order in which the grid takes the tiles (longest first, heads interleaved; it
// cannot deadlock: src/block_sparse/dq_write_order.h has the argument, and a grid simulation over
// thousands of masks tests it). Made once per mask and attention shape on the host, from a HOST
// copy of the mask's lists (every list, the transposed ones included, as DeviceKind::kCPU views);
// the caller uploads `data` (int32, data.size() elements, 4-byte aligned) and passes the plan
// and that copy to attention_backward with deterministic = true, for every layer sharing the mask.
struct BlockSparseDqPlan {
  std::vector<int32_t> data;
  // What it was made for (attention_backward checks them against its shapes and mask).
  int batch = 0, heads = 0, heads_kv = 0;
  int mask_batch = 0, mask_heads = 0, num_q_blocks = 0, num_kv_blocks = 0;
  int q_block_size = 0, kv_block_size = 0;
  // Offsets into data (int32 elements) of its arrays, in the order of the planner's layout.
  int64_t offsets[7] = {};
};

Status make_block_sparse_dq_plan(const BlockMask& host_mask, int batch, int heads, int heads_kv, int seqlen_q,
                                 int seqlen_k, BlockSparseDqPlan* plan);

}  // namespace flare
