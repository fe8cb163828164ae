// A block mask's per-element lookups (document ids, the bit-packed mask) for one thread's share of
// a wgmma accumulator tile, as bits: the thread holds two rows 8 apart and, per row, the columns
// col_base + 8 j + c (j < kGroups, c < 2); bit 2 j + c of word r says whether (row r, that column)
// passes the lookups. The structural predicates (causal, windows, prefix) are intervals and stay
// with the callers.
//
// Rows are queries in the forward (S = Q K^T) and keys in the backward (S^T = K Q^T):
// kRowsAreQueries picks which document-id array and which bit-mask index a row is.
//
// The loads come in groups, not one per element: a document id pair (int2) per two columns when
// the ids are contiguous and 8-byte aligned (ElementMaskParams::doc_*_pairs), a bit-mask word per
// 32 keys of a query row. Rows must lie inside their sequence; columns at or past `col_end` (the
// columns' sequence length) get no bit and are never read.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "src/block_sparse/block_sparse_params.h"

namespace flare::hopper {

// Bit 2 j + c of each row's word: column col_base + 8 j + c has the same document as the row.
template <int kGroups, bool kRowsAreQueries>
__device__ __forceinline__ void doc_lookup_bits(const block_sparse::ElementMaskParams& el, int b,
                                                const int64_t (&rows)[2], int64_t col_base, int64_t col_end,
                                                uint32_t (&bits)[2]) {
  const int32_t* row_ids = kRowsAreQueries ? el.doc_q : el.doc_k;
  const int64_t row_batch = kRowsAreQueries ? el.doc_q_batch : el.doc_k_batch;
  const int64_t row_stride = kRowsAreQueries ? el.doc_q_row : el.doc_k_row;
  const int32_t* col_ids = (kRowsAreQueries ? el.doc_k : el.doc_q) + b * (kRowsAreQueries ? el.doc_k_batch : el.doc_q_batch);
  const int64_t col_stride = kRowsAreQueries ? el.doc_k_row : el.doc_q_row;
  const bool pairs = kRowsAreQueries ? el.doc_k_pairs : el.doc_q_pairs;
  const int32_t doc0 = row_ids[b * row_batch + rows[0] * row_stride];
  const int32_t doc1 = row_ids[b * row_batch + rows[1] * row_stride];
  bits[0] = bits[1] = 0u;
  if (pairs && col_base + 8 * (kGroups - 1) + 1 < col_end) {
    // Every column inside the sequence: the pair loads, all issued before any compare (one
    // round trip of latency per tile rather than one per group of the loop below).
    int2 d[kGroups];
#pragma unroll
    for (int j = 0; j < kGroups; ++j) d[j] = *reinterpret_cast<const int2*>(col_ids + col_base + 8 * j);
#pragma unroll
    for (int j = 0; j < kGroups; ++j) {
      bits[0] |= ((d[j].x == doc0 ? 1u : 0u) | (d[j].y == doc0 ? 2u : 0u)) << (2 * j);
      bits[1] |= ((d[j].x == doc1 ? 1u : 0u) | (d[j].y == doc1 ? 2u : 0u)) << (2 * j);
    }
    return;
  }
#pragma unroll 4
  for (int j = 0; j < kGroups; ++j) {
    const int64_t col = col_base + 8 * j;
    int2 d = make_int2(0, 0);
    uint32_t in = 0u;  // bit c: column col + c inside the sequence
    if (pairs && col + 1 < col_end) {
      d = *reinterpret_cast<const int2*>(col_ids + col);
      in = 3u;
    } else {
      if (col < col_end) d.x = col_ids[col * col_stride], in = 1u;
      if (col + 1 < col_end) d.y = col_ids[(col + 1) * col_stride], in |= 2u;
    }
    const uint32_t s0 = (d.x == doc0 ? 1u : 0u) | (d.y == doc0 ? 2u : 0u);
    const uint32_t s1 = (d.x == doc1 ? 1u : 0u) | (d.y == doc1 ? 2u : 0u);
    bits[0] |= (s0 & in) << (2 * j);
    bits[1] |= (s1 & in) << (2 * j);
  }
}

// Bit 2 j + c of each row's word: the bit-packed mask sets (query, key) at row r, column
// col_base + 8 j + c. Forward (rows are queries): each row's words cover its columns, one load per
// 32 of them (col_base - col_base % 8 must be a multiple of 32). Backward (rows are keys): one word
// per query column serves both rows when they share it.
template <int kGroups, bool kRowsAreQueries>
__device__ __forceinline__ void mask_lookup_bits(const block_sparse::ElementMaskParams& el, int b, int h,
                                                 const int64_t (&rows)[2], int64_t col_base, int64_t col_end,
                                                 uint32_t (&bits)[2]) {
  bits[0] = bits[1] = 0u;
  if constexpr (kRowsAreQueries) {
    static_assert(kGroups % 4 == 0, "a row's columns span whole 32-column words");
    const int64_t word0 = col_base / 32;  // col_base % 32 < 8: the thread's first columns' word
    const int in_word = static_cast<int>(col_base % 32);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const uint32_t* words = el.bits_row_ptr(b, h, rows[r]);
#pragma unroll
      for (int w = 0; w < kGroups / 4; ++w) {
        const int64_t first = (word0 + w) * 32;
        const uint32_t word = first < col_end ? words[word0 + w] : 0u;
#pragma unroll
        for (int jj = 0; jj < 4; ++jj) {
          const int j = 4 * w + jj;
          const int64_t col = col_base + 8 * j;
          uint32_t pair = (word >> (in_word + 8 * jj)) & 3u;
          pair &= (col < col_end ? 1u : 0u) | (col + 1 < col_end ? 2u : 0u);
          bits[r] |= pair << (2 * j);
        }
      }
    }
  } else {
    const int64_t w0 = rows[0] / 32, w1 = rows[1] / 32;
    const int s0 = static_cast<int>(rows[0] % 32), s1 = static_cast<int>(rows[1] % 32);
#pragma unroll 4
    for (int j = 0; j < kGroups; ++j) {
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int64_t q = col_base + 8 * j + c;
        if (q >= col_end) continue;
        const uint32_t* words = el.bits_row_ptr(b, h, q);
        const uint32_t x0 = words[w0];
        const uint32_t x1 = w1 == w0 ? x0 : words[w1];
        bits[0] |= ((x0 >> s0) & 1u) << (2 * j + c);
        bits[1] |= ((x1 >> s1) & 1u) << (2 * j + c);
      }
    }
  }
}

// Both lookups (each where the mask has it; the documents' only where `docs`: a caller that has
// the rows' document spans narrows to them instead): every column that passes them all.
template <int kGroups, bool kRowsAreQueries>
__device__ __forceinline__ void element_lookup_bits(const block_sparse::ElementMaskParams& el, int b, int h,
                                                    const int64_t (&rows)[2], int64_t col_base, int64_t col_end,
                                                    uint32_t (&bits)[2], bool docs = true) {
  static_assert(2 * kGroups <= 32, "a row's columns fit one word");
  constexpr uint32_t kAll = 2 * kGroups == 32 ? ~0u : (1u << (2 * kGroups)) - 1u;
  bits[0] = bits[1] = kAll;
  if (docs && el.doc_q != nullptr) doc_lookup_bits<kGroups, kRowsAreQueries>(el, b, rows, col_base, col_end, bits);
  if (el.bits != nullptr) {
    uint32_t m[2];
    mask_lookup_bits<kGroups, kRowsAreQueries>(el, b, h, rows, col_base, col_end, m);
    bits[0] &= m[0];
    bits[1] &= m[1];
  }
}

}  // namespace flare::hopper
