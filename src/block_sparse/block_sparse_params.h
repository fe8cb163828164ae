// Block-sparse masks as the kernels see them: the lists' device pointers with broadcast dims
// folded into zero strides, and the element predicates of partial blocks. Host views become
// these once (make_block_sparse_params); the forward and backward kernels and the GPU builder
// read them.
#pragma once

#include <cstdint>

#include "flare/mask.h"
#include "src/scheduling/mask_math.h"

namespace flare::block_sparse {

// Far beyond any column: "no bound on this side" of a row's interval.
inline constexpr int64_t kNoColumnBound = int64_t{1} << 62;

// An inclusive column interval [lo, hi]; empty when lo > hi.
struct ColumnInterval {
  int64_t lo = 0, hi = kNoColumnBound;
  FLARE_HD bool contains(int64_t j) const { return lo <= j && j <= hi; }
};

// ElementMask (mask.h) on the device. Every enabled predicate must hold. The structural ones
// (causal, windows, prefix-LM) leave each row one interval of visible columns; doc ids and
// bits are looked up per element.
struct ElementMaskParams {
  bool causal = false;
  int window_left = -1, window_right = -1, prefix_length = -1;
  const int32_t* doc_q = nullptr;  // [batch, seqlen_q]; doc_k given with it
  const int32_t* doc_k = nullptr;
  int64_t doc_q_batch = 0, doc_q_row = 0, doc_k_batch = 0, doc_k_row = 0;
  // Ids of two neighbouring positions load as one int2 (the row stride is 1, every batch's
  // first id 8-byte aligned): the Hopper kernels' grouped lookups (element_lookups.h).
  bool doc_q_pairs = false, doc_k_pairs = false;
  const uint32_t* bits = nullptr;              // [B|1, H|1, seqlen_q, words], words contiguous
  int64_t bits_batch = 0, bits_head = 0, bits_row = 0;  // 0 on broadcast dims

  FLARE_HD bool has_lookups() const { return doc_q != nullptr || bits != nullptr; }
  FLARE_HD bool has_structural() const {
    return causal || window_left >= 0 || window_right >= 0 || prefix_length >= 0;
  }

  // The columns the structural predicates leave row q_idx (absolute positions).
  FLARE_HD ColumnInterval row_interval(int64_t q_idx) const {
    ColumnInterval r;
    if (window_left >= 0) r.lo = q_idx - window_left;
    if (causal && q_idx < r.hi) r.hi = q_idx;
    if (window_right >= 0 && q_idx + window_right < r.hi) r.hi = q_idx + window_right;
    // Prefix-LM: kv < prefix || kv <= q, i.e. kv <= max(prefix - 1, q).
    if (prefix_length >= 0) {
      const int64_t reach = q_idx > prefix_length - 1 ? q_idx : int64_t{prefix_length} - 1;
      if (reach < r.hi) r.hi = reach;
    }
    return r;
  }
  // Without a prefix the structural predicates bound the diagonal offset d = q_idx - kv_idx:
  // causal d >= 0, window_left d <= window_left, window_right d >= -window_right. The interval
  // [lo, hi] of d (INT32 bounds where a side is open) lets a kernel test an element with two
  // compares of a per-step base plus a constant (bwd_probs) instead of row_interval's.
  struct DiagonalBand {
    int lo = INT32_MIN, hi = INT32_MAX;
    FLARE_HD bool contains(int d) const { return lo <= d && d <= hi; }
  };
  FLARE_HD bool diagonal_band_applies() const { return prefix_length < 0; }
  FLARE_HD DiagonalBand diagonal_band() const {
    DiagonalBand d;
    if (causal) d.lo = 0;
    if (window_right >= 0 && -window_right > d.lo) d.lo = -window_right;
    if (window_left >= 0) d.hi = window_left;
    return d;
  }
  // Row q_idx's document (read once per row by the kernels).
  FLARE_HD int32_t doc_of_row(int b, int64_t q_idx) const { return doc_q[b * doc_q_batch + q_idx * doc_q_row]; }
  FLARE_HD const uint32_t* bits_row_ptr(int b, int h, int64_t q_idx) const {
    return bits + b * bits_batch + h * bits_head + q_idx * bits_row;
  }
  // The per-element lookups of row q_idx (doc id `row_doc`, bit words `row_bits`) at kv_idx.
  FLARE_HD bool lookups_visible(int b, int32_t row_doc, const uint32_t* row_bits, int64_t kv_idx) const {
    if (doc_q != nullptr && doc_k[b * doc_k_batch + kv_idx * doc_k_row] != row_doc) return false;
    if (bits != nullptr && ((row_bits[kv_idx / 32] >> (kv_idx % 32)) & 1u) == 0) return false;
    return true;
  }
  // The whole predicate, as reference/attention_ref.cpp's element_visible.
  FLARE_HD bool visible(int b, int h, int64_t q_idx, int64_t kv_idx) const {
    if (!row_interval(q_idx).contains(kv_idx)) return false;
    return lookups_visible(b, doc_q ? doc_of_row(b, q_idx) : 0, bits ? bits_row_ptr(b, h, q_idx) : nullptr, kv_idx);
  }
};

// One list family: per (b, h, row) a count and the listed blocks at the front of the row.
struct BlockListParams {
  const int32_t* counts = nullptr;  // null: the list is absent (lists nothing)
  const int32_t* indices = nullptr;
  int64_t counts_batch = 0, counts_head = 0, counts_row = 0;  // 0 on broadcast dims
  int64_t indices_batch = 0, indices_head = 0, indices_row = 0;

  // Clamped to [0, max_count]: device values are not validated on the host.
  FLARE_HD int count(int b, int h, int row, int max_count) const {
    if (counts == nullptr) return 0;
    const int c = counts[b * counts_batch + h * counts_head + row * counts_row];
    return c < 0 ? 0 : (c > max_count ? max_count : c);
  }
  FLARE_HD const int32_t* row(int b, int h, int row) const {
    return indices + b * indices_batch + h * indices_head + row * indices_row;
  }
};

struct BlockSparseParams {
  BlockListParams partial_kv, full_kv;  // per q block: the kv blocks it sees (forward)
  BlockListParams partial_q, full_q;    // per kv block: the q blocks that see it (backward; absent if not given)
  int q_block_size = 128, kv_block_size = 128;
  int num_q_blocks = 0, num_kv_blocks = 0;
  ElementMaskParams element;
};

// Host views (CUDA memory, validated by validate_block_mask) to device params.
ElementMaskParams make_element_mask_params(const ElementMask& element);
BlockSparseParams make_block_sparse_params(const BlockMask& mask, int seqlen_q, int seqlen_k);

}  // namespace flare::block_sparse
