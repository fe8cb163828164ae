// The Hopper forward's launchers. hopper_forward_check says whether a problem can run on it (an
// sm_90 device, a build with the Hopper kernels, operands TMA can address); the definitions of
// launch_hopper_fwd live in the generated per-(head dim, dtype) translation units.
#pragma once

#include "src/attention/fwd_params.h"
#include "src/block_sparse/block_sparse_params.h"

namespace flare::hopper {

template <int kHeadDim, typename T>
Status launch_hopper_fwd(const detail::FwdKernelParams& p, Stream stream);
template <int kHeadDim, typename T>
Status launch_hopper_fwd_sparse(const detail::FwdKernelParams& p, const block_sparse::BlockSparseParams& bs,
                                Stream stream);

// Ok when the Hopper kernel can run this problem on the current device, else why not.
Status hopper_forward_check(const detail::FwdKernelParams& p, DType dtype);

// Launches the kernel of the smallest instantiated head dim >= p.head_dim, for a problem that
// hopper_forward_check accepted.
Status hopper_attention_forward(const detail::FwdKernelParams& p, DType dtype, Stream stream);

// The scratch hopper_attention_forward needs for this problem (fwd_grid.h: the split tiles' slots).
std::size_t hopper_forward_workspace_bytes(const detail::FwdKernelParams& p, DType dtype);

// The block-sparse forward (a block mask's lists `bs`): Ok when it can run the problem (as
// hopper_forward_check, and q blocks of a multiple of 128 rows, kv blocks of a multiple of its key
// tile: 128 up to head dim 128, 64 above, and at most 8192 key tiles of keys: sparse_tile_list.h),
// else why not.
Status hopper_forward_sparse_check(const detail::FwdKernelParams& p, const block_sparse::BlockSparseParams& bs,
                                   DType dtype);
Status hopper_attention_forward_sparse(const detail::FwdKernelParams& p, const block_sparse::BlockSparseParams& bs,
                                       DType dtype, Stream stream);

// Whether the block-sparse forward orders its CTAs (sched::SparseOrder: longest list rows first in
// groups of about two waves): where its q tiles outnumber the SMs (one wave needs no order).
// FLARE_HOPPER_SPARSE_ORDER=0 never, =1 always (tests, A/B runs).
bool hopper_sparse_ordered(const detail::FwdKernelParams& p, int num_sms);
// Whether the block-sparse forward narrows a documents mask's rows to their document spans
// (block_sparse/doc_spans.h, computed before the forward): where the mask has document ids
// (`doc_ids`). FLARE_HOPPER_DOC_SPANS=0 never (the lookups: A/B runs).
bool hopper_sparse_doc_spans(bool doc_ids);
// Whether the ordered block-sparse forward (hopper_sparse_ordered) runs its persistent grid where
// its configuration has one (hopper_sparse_persistent_fits): sequences of at most
// kMaxPersistentSparseTiles key tiles of kv_tile keys (its lists' capacity). Measured on the H200
// (bench/RESULTS.md, session 47; issue 6's masks, 20 back-to-back calls, persistent / one CTA per
// tile): causal 0.992, window 0.978, documents 0.995, random blocks 0.988.
// FLARE_HOPPER_SPARSE_PERSISTENT=0 turns it off (A/B runs, tests).
bool hopper_sparse_persistent(const detail::FwdKernelParams& p, int kv_tile);
// The block-sparse forward's scratch: the CTA order (an int2 a tile, 16-byte rounded) and the
// persistent grid's counters (16 bytes: tiles claimed, tiles done) where it orders its CTAs, then the document spans
// (doc_spans_bytes) where it takes them. The launcher lays its workspace out by it and
// hopper_forward_sparse_workspace_bytes is its total.
struct SparseScratch {
  std::size_t order_bytes = 0, counter_bytes = 0, span_bytes = 0;
  std::size_t counter_offset() const { return order_bytes; }
  std::size_t span_offset() const { return order_bytes + counter_bytes; }
  std::size_t total() const { return order_bytes + counter_bytes + span_bytes; }
};
SparseScratch hopper_sparse_scratch(const detail::FwdKernelParams& p, bool doc_ids, int num_sms);
std::size_t hopper_forward_sparse_workspace_bytes(const detail::FwdKernelParams& p, bool doc_ids);
// FLARE_HOPPER_SPARSE_ORDER_UNITS=N: the order's groups of N (batch, kv head) units instead of the
// rule's (make_sparse_forward_order; an A/B switch); 0 where unset.
int hopper_sparse_order_units_override();

}  // namespace flare::hopper
