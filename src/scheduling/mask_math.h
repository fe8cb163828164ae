// Mask arithmetic shared by every attention kernel and tested on the CPU against brute force.
//
// One mechanism: a tile of (query rows x key columns) is FULL (every element visible, no
// element mask needed), PARTIAL (some visible: apply the element predicate) or EMPTY (skip).
// Dense masks (causal, sliding window) are a band around the bottom-right aligned diagonal:
// key j is visible to row i when  diag(i) - left <= j <= diag(i) + right, diag(i) = i + sk - sq,
// with left/right = kUnbounded when a side is open.
#pragma once

#include <cstdint>

#ifdef __CUDACC__
#define FLARE_HD __host__ __device__ __forceinline__
#else
#define FLARE_HD inline
#endif

namespace flare::sched {

inline constexpr int kUnbounded = 1 << 30;

enum class TileKind : int { kEmpty = 0, kPartial = 1, kFull = 2 };

// The band of a dense mask, resolved from (causal, window_left, window_right).
struct Band {
  int left = kUnbounded;
  int right = kUnbounded;
  int offset = 0;  // seqlen_k - seqlen_q: diag(i) = i + offset

  FLARE_HD static Band make(bool causal, int window_left, int window_right, int seqlen_q, int seqlen_k) {
    Band b;
    b.left = window_left < 0 ? kUnbounded : window_left;
    b.right = causal ? 0 : (window_right < 0 ? kUnbounded : window_right);
    b.offset = seqlen_k - seqlen_q;
    return b;
  }
  FLARE_HD bool unmasked() const { return left >= kUnbounded && right >= kUnbounded; }
  // First and one-past-last visible key of row i (may be empty: lo >= hi), clamped to [0, sk).
  FLARE_HD int row_lo(int i) const {
    long long lo = left >= kUnbounded ? 0 : (long long)i + offset - left;
    return lo < 0 ? 0 : (int)lo;
  }
  FLARE_HD int row_hi(int i, int seqlen_k) const {
    long long hi = right >= kUnbounded ? seqlen_k : (long long)i + offset + right + 1;
    return hi > seqlen_k ? seqlen_k : (hi < 0 ? 0 : (int)hi);
  }
  FLARE_HD bool visible(int i, int j) const {
    long long d = (long long)j - ((long long)i + offset);
    return d >= -(long long)left && d <= (long long)right;
  }
  // The rows that see key j, as offsets from row `base` clamped to [-1, limit]: row base + r sees
  // it for r in [lo, hi] (empty: lo > hi), for 0 <= r < limit. A backward's key row tests each of
  // its elements' query offsets with two int compares against these.
  struct RowSpan {
    int lo, hi;
    FLARE_HD bool contains(int r) const { return r >= lo && r <= hi; }
  };
  FLARE_HD RowSpan key_rows(int j, int base, int limit) const {
    auto clamp = [&](long long r) { return (int)(r < -1 ? -1 : (r > limit ? limit : r)); };
    const long long first = right >= kUnbounded ? -1 : (long long)j - offset - right - base;
    const long long last = left >= kUnbounded ? limit : (long long)j - offset + left - base;
    return RowSpan{clamp(first), clamp(last)};
  }
};

// Key-block range [first, last) that rows [row_begin, row_end) of a sequence can touch, for
// blocks of kv_block columns. Empty (first >= last) when no row sees any key.
struct BlockRange {
  int first = 0, last = 0;
};

FLARE_HD BlockRange kv_block_range(const Band& band, int row_begin, int row_end, int seqlen_k, int kv_block) {
  BlockRange r;
  if (row_begin >= row_end || seqlen_k <= 0) return r;
  // lo is monotone in i, so the block's smallest lo is at row_begin and largest hi at row_end-1.
  int lo = band.row_lo(row_begin);
  int hi = band.row_hi(row_end - 1, seqlen_k);
  if (lo >= hi) return r;
  r.first = lo / kv_block;
  r.last = (hi + kv_block - 1) / kv_block;
  return r;
}

// Query-block range [first, last) whose rows can see keys [col_begin, col_end) (for the backward,
// which walks query blocks for a fixed key block).
FLARE_HD BlockRange q_block_range(const Band& band, int col_begin, int col_end, int seqlen_q,
                                  int q_block) {
  BlockRange r;
  if (col_begin >= col_end || seqlen_q <= 0) return r;
  // Row i sees column j when j - right <= i + offset <= j + left.
  long long lo = band.right >= kUnbounded ? 0 : (long long)col_begin - band.right - band.offset;
  long long hi = band.left >= kUnbounded ? seqlen_q : (long long)(col_end - 1) + band.left - band.offset + 1;
  if (lo < 0) lo = 0;
  if (hi > seqlen_q) hi = seqlen_q;
  if (lo >= hi) return r;
  r.first = (int)(lo / q_block);
  r.last = (int)((hi + q_block - 1) / q_block);
  return r;
}

// Classify the tile rows [r0, r1) x columns [c0, c1), clipped to the sequence (columns past
// seqlen_k are masked, so a tile that crosses the end is at most PARTIAL). O(1).
FLARE_HD TileKind classify_tile(const Band& band, int r0, int r1, int c0, int c1, int seqlen_k) {
  const bool clipped = c1 > seqlen_k;
  if (clipped) c1 = seqlen_k;
  if (r0 >= r1 || c0 >= c1) return TileKind::kEmpty;
  // Row i meets [c0, c1) when c0 - offset - right <= i < c1 - offset + left (unclamped band).
  long long lo_row = band.right >= kUnbounded ? r0 : (long long)c0 - band.offset - band.right;
  long long hi_row = band.left >= kUnbounded ? r1 : (long long)c1 - band.offset + band.left;
  if (lo_row < r0) lo_row = r0;
  if (hi_row > r1) hi_row = r1;
  if (lo_row >= hi_row) return TileKind::kEmpty;
  // Full when every row's window covers [c0, c1): lo and hi grow with the row.
  const bool full = !clipped && band.row_lo(r1 - 1) <= c0 && band.row_hi(r0, seqlen_k) >= c1;
  return full ? TileKind::kFull : TileKind::kPartial;
}

// Key blocks [first, last) that classify_tile calls FULL for rows [r0, r1), for blocks of
// kv_block columns: contiguous, since a row's visible window only moves right as the row grows
// (FULL: the last row's first key at or before the block, the first row's end at or after it).
// Empty (first >= last) when no block is. Lets a kernel that walks many blocks of one row range
// test a block with two compares instead of classifying it.
FLARE_HD BlockRange full_kv_blocks(const Band& band, int r0, int r1, int seqlen_k, int kv_block) {
  BlockRange r;
  if (r0 >= r1 || seqlen_k <= 0) return r;
  r.first = (band.row_lo(r1 - 1) + kv_block - 1) / kv_block;
  r.last = band.row_hi(r0, seqlen_k) / kv_block;
  return r;
}

// How many of the key blocks [range.first, range.last), counted from the last down (the order the
// Hopper forward walks a tile's blocks, diagonal first), are EMPTY for rows [r0, r1), up to the
// first that is not: a consumer warpgroup whose rows are the first of a taller tile passes them
// without computing. Never the whole range: rows that see no key still compute one (masked) block.
FLARE_HD int leading_empty_blocks(const Band& band, const BlockRange& range, int r0, int r1, int seqlen_k,
                                  int kv_block) {
  const int blocks = range.last - range.first;
  if (blocks <= 1) return 0;
  const BlockRange own = kv_block_range(band, r0, r1, seqlen_k, kv_block);
  int n = own.first < own.last ? range.last - own.last : blocks;
  n = n < 0 ? 0 : n;
  return n < blocks ? n : blocks - 1;
}

// Where a sequence's row tiles start: tile m holds rows [m * rows - shift, (m + 1) * rows - shift),
// m in [0, ceil(seqlen_q / rows)), clipped to the sequence. Where later rows see more keys (a band
// bounded on the right, open on the left: causal) the shift puts the ragged tile first, where the
// walk is one block or two, instead of last, where it is the longest: 1024 causal rows in tiles of
// 192 over key blocks of 128 walk 27 tile-blocks instead of 32. Other bands keep 0.
FLARE_HD int row_tile_shift(const Band& band, int seqlen_q, int rows) {
  if (band.right >= kUnbounded || band.left < kUnbounded || seqlen_q <= 0 || rows <= 0) return 0;
  const int rem = seqlen_q % rows;
  return rem == 0 ? 0 : rows - rem;
}

// The transposed question, for a kernel that walks row tiles against one key block [c0, c1): the
// first rows q0 whose tile [q0, q0 + rows) classify_tile calls FULL are exactly those in
// [first, last] (inclusive; empty when first > last): the last row's window must start at or
// before c0, the first row's must end at or after c1, and the block must lie inside the sequence.
// Bounds are clamped to +-2^30 (first rows beyond that do not occur).
struct RowSpan {
  int first = 0, last = -1;
  FLARE_HD bool contains(int q0) const { return q0 >= first && q0 <= last; }
};
FLARE_HD RowSpan full_row_tiles(const Band& band, int c0, int c1, int seqlen_k, int rows) {
  RowSpan s;
  if (c0 >= c1 || c1 > seqlen_k || rows <= 0) return s;
  constexpr long long kFar = 1ll << 30;
  const long long first = band.right >= kUnbounded ? -kFar : (long long)c1 - band.offset - band.right - 1;
  const long long last = band.left >= kUnbounded ? kFar : (long long)c0 - rows + 1 - band.offset + band.left;
  s.first = (int)(first < -kFar ? -kFar : (first > kFar ? kFar : first));
  s.last = (int)(last < -kFar ? -kFar : (last > kFar ? kFar : last));
  return s;
}

}  // namespace flare::sched
