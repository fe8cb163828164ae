// Host builders of block-sparse masks: owned storage in FlexAttention's layout (mask.h), viewed
// as a flare::BlockMask of CPU views.
//
// A mask is a block-level classification plus an element predicate (the one mechanism of
// mask_math.h): every (q block, kv block) is EMPTY (skipped), PARTIAL (the kernels apply
// `element` to it) or FULL (every element visible, no predicate). The builders:
//   build_from_kinds          a per-block kind matrix for each (b, h)
//   build_from_element_mask   classify every block by brute force against an ElementMask
//   build_from_predicate      the same for any callable, with the ElementMask that stands for it
//                             inside partial blocks (checked to agree there)
//   fill_transposed_lists     per kv block, the q blocks that see it (what the backward walks)
//   copy_block_mask           a user's CPU BlockMask into owned storage
// Every builder fills the transposed lists. Brute force is deliberate: these are the oracle of
// the GPU builder, and a (q block, kv block) pair costs block_q * block_kv predicate calls.
//
// Broadcast. A mask's batch or head count may be 1, meaning the same lists for every batch
// entry or head; HostBlockMask::row_of maps an attention (b, h) onto the mask's own.
//
// Sequence ends. Only elements inside [0, seqlen_q) x [0, seqlen_k) are classified, so a block
// crossing seqlen_k whose real elements are all visible is FULL: kernels mask the columns past
// seqlen_k of the last kv block whatever its kind (a user's mask may mark it FULL anyway).
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "flare/mask.h"
#include "flare/status.h"
#include "src/block_sparse/block_mask_args.h"
#include "src/scheduling/mask_math.h"

namespace flare::block_sparse {

using sched::TileKind;

// The mask's own dims (batch and heads may be 1: broadcast) and the sequence it covers.
struct BlockMaskGeometry {
  int batch = 1, heads = 1;
  int seqlen_q = 0, seqlen_k = 0;
  int q_block_size = 128, kv_block_size = 128;

  int num_q_blocks() const { return (seqlen_q + q_block_size - 1) / q_block_size; }
  int num_kv_blocks() const { return (seqlen_k + kv_block_size - 1) / kv_block_size; }
};

// Per (batch, head) a kind for every (q block m, kv block n), row-major [batch, heads, m, n].
struct BlockKindGrid {
  int batch = 1, heads = 1;
  int num_q_blocks = 0, num_kv_blocks = 0;
  std::vector<TileKind> kinds;

  static BlockKindGrid all_empty(int batch, int heads, int num_q_blocks, int num_kv_blocks);
  TileKind& at(int b, int h, int m, int n) { return kinds[index(b, h, m, n)]; }
  TileKind at(int b, int h, int m, int n) const { return kinds[index(b, h, m, n)]; }

 private:
  size_t index(int b, int h, int m, int n) const {
    return ((static_cast<size_t>(b) * heads + h) * num_q_blocks + m) * num_kv_blocks + n;
  }
};

// One list family: per row (a q block forward, a kv block transposed) the listed blocks, at the
// front of the row in increasing order; the rest of the row is 0.
struct BlockList {
  std::vector<int32_t> num_blocks;  // [batch, heads, rows]
  std::vector<int32_t> indices;     // [batch, heads, rows, cols]
};

struct HostBlockMask {
  int batch = 1, heads = 1;  // 1: broadcast over the attention's batch / heads
  int num_q_blocks = 0, num_kv_blocks = 0;
  int q_block_size = 128, kv_block_size = 128;
  BlockList partial_kv, full_kv;  // per q block: the kv blocks it sees
  BlockList partial_q, full_q;    // per kv block: the q blocks that see it
  ElementMask element;            // applied inside partial blocks

  // The mask's (b, h) row serving the attention's (b, h).
  int row_of(int b, int h) const { return (batch == 1 ? 0 : b) * heads + (heads == 1 ? 0 : h); }
  // Attention (b, h); O(log count) in the sorted lists.
  TileKind kind(int b, int h, int m, int n) const;
  // The q blocks of kv block n, partial and full merged, ascending; `is_full` parallel to them.
  void q_blocks_of(int b, int h, int n, std::vector<int32_t>* q_blocks, std::vector<int32_t>* is_full) const;
  // Views into this object's storage (valid while it lives unchanged), DeviceKind::kCPU. The
  // views are read-only by contract even though TensorView holds a non-const pointer.
  BlockMask view() const;
};

// The visibility `element` defines at absolute positions (FlexAttention's mask_mod), for a mask
// row (b, h) of its tensors (bits broadcast by their own dims). Host only.
bool element_mask_visible(const ElementMask& element, int b, int h, int64_t q_idx, int64_t kv_idx);

using ElementPredicate = std::function<bool(int b, int h, int64_t q_idx, int64_t kv_idx)>;

// Kinds of every block of `geometry`: FULL when every element in the sequence is visible, EMPTY
// when none is, else PARTIAL.
BlockKindGrid classify_blocks(const ElementPredicate& visible, const BlockMaskGeometry& geometry);

// Grid dims must match `geometry`'s block counts, batch and heads; block sizes are checked as in
// validate_block_mask.
Status build_from_kinds(const BlockKindGrid& kinds, const BlockMaskGeometry& geometry, const ElementMask& element,
                        HostBlockMask* out);
// `element`'s tensors must fit `geometry`: doc ids [geometry.batch, seqlen] and bits with batch
// and head dims 1 or geometry's (a mask built for batch 1 cannot follow per-batch documents).
Status build_from_element_mask(const ElementMask& element, const BlockMaskGeometry& geometry, HostBlockMask* out);
// `partial_element` must equal `visible` on every element of every partial block (checked: the
// kernels evaluate `partial_element` there, never `visible`).
Status build_from_predicate(const ElementPredicate& visible, const ElementMask& partial_element,
                            const BlockMaskGeometry& geometry, HostBlockMask* out);

// Replaces partial_q / full_q by the transpose of partial_kv / full_kv.
void fill_transposed_lists(HostBlockMask* mask);

// Validates `mask` (CPU views) against `problem` and copies it; batch and head dims are the
// largest of the lists' (lists with different broadcasts are expanded), the transposed lists
// are computed when absent.
Status copy_block_mask(const BlockMask& mask, const detail::BlockMaskProblem& problem, HostBlockMask* out);

}  // namespace flare::block_sparse
