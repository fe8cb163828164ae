// Validation of a user-provided block-sparse mask (FlexAttention's BlockMask layout, mask.h).
//
// The layout rules hold for views on any device; the value rules (counts, indices, the partial /
// full split, the transposed lists) are read only from CPU views: a device mask is checked by
// shape and dtype here and trusted for its values, as FlexAttention does. Every error is a
// Status::InvalidArgument naming the field ('kv_indices', 'full_kv_num_blocks', ...).
#pragma once

#include "flare/mask.h"
#include "flare/status.h"
#include "flare/tensor.h"

namespace flare::detail {

// Block sizes are multiples of the MMA tile edge, so a block never splits an MMA fragment and
// the element predicate is the only partial-block mechanism (no per-row tail inside a block).
inline constexpr int kBlockSizeGranularity = 16;

// The attention a mask must fit. The mask's batch and head dims are these or 1 (broadcast).
struct BlockMaskProblem {
  int batch = 1, heads = 1;
  int seqlen_q = 0, seqlen_k = 0;
};

// What the validation derives from a good mask.
struct BlockMaskShape {
  int num_q_blocks = 0, num_kv_blocks = 0;  // ceil(seqlen / block size)
  bool has_full_blocks = false;             // full_kv lists given
  bool has_transposed_lists = false;        // q (and, with full blocks, full_q) lists given
};

// Rules:
// - q_block_size, kv_block_size: positive multiples of kBlockSizeGranularity.
// - kv_num_blocks / kv_indices required; every other list optional, counts and indices of a list
//   given together; the transposed lists include full_q exactly when full_kv is given.
// - int32, shapes [B|1, H|1, rows] and [B|1, H|1, rows, cols] (forward: rows = q blocks, cols =
//   kv blocks; transposed: the reverse), a list's counts and indices with the same B and H dims,
//   non-negative strides, last dim contiguous, on `device`.
// - CPU values: counts in [0, cols]; a row's first `count` indices in [0, cols) and strictly
//   increasing; no block both partial and full; the transposed lists name exactly the (q block,
//   kv block) pairs of the forward lists, partial and full alike.
// - The element mask: see validate_element_mask.
Status validate_block_mask(const BlockMask& mask, const BlockMaskProblem& problem, DeviceKind device,
                           BlockMaskShape* shape);

// Windows and prefix length >= -1; doc_ids_q int32 [batch, seqlen_q] and doc_ids_k int32
// [batch, seqlen_k] given together; bits int32 words (read as uint32) [B|1, H|1, seqlen_q,
// ceil(seqlen_k / 32)]. Field names are 'element.<field>'.
Status validate_element_mask(const ElementMask& element, const BlockMaskProblem& problem, DeviceKind device);

}  // namespace flare::detail
