// Persistent tile order of the attention forward and backward: which (batch, head, block) the
// linear tile index t in [0, num_tiles) stands for. A persistent CTA walks t = c, c + P, ...
// (static) or takes the next t from a counter (dynamic), so this order decides what runs
// together (L2 reuse) and what runs last (the tail).
//
// Forward tiles are (batch, q-head, q-block m); backward tiles are (batch, q-head, kv-block n).
// The tile space uses the max lengths: with varlen, tiles past a sequence's end exist and exit
// at once, because per-sequence lengths are only known on the device.
//
// Three rules shape the order:
// - L2 groups. The K/V heads (forward) or Q/dO/dQ heads (backward) that tiles share are cut into
//   groups whose bytes fit an L2 budget (a caller's number, e.g. half the device's L2); every
//   tile of a group comes before the next group, so the tiles in flight share operands that
//   stay resident. A group is made of "units" (batch entry, kv head), in b-major order: groups
//   may span a batch boundary, since two batch entries' K/V cost the same bytes as two heads'
//   and a full group beats a partial one. The q-heads of one kv head are adjacent. Where the
//   units do not divide into full groups, the partial group comes first: last, its few heads'
//   longest tiles started after every other group's and ran alone at the end (64 units in
//   groups of 7, causal: a CPU model of the grid put the makespan 10 % above the work / SMs with
//   the partial group last, 1 % with it first; tests/cpu/test_tile_order.cpp).
// - Longest first (forward, non-deterministic backward). Inside a group the block axis is
//   visited from the blocks with the most work to the blocks with the least, heads innermost,
//   so the short tiles fill the tail of the grid.
// - Head-major (deterministic backward). Each (batch, head)'s kv blocks are consecutive, in
//   descending n (shortest first for causal). dq_turns.h ties the dQ turn order to this tile
//   order, which is what keeps the semaphores deadlock-free. Consecutive tiles share a head, so L2
//   reuse needs no grouping there. Its `reversed_heads` last flat heads instead come last
//   interleaved, block rank outer and heads inner, with their kv blocks ascending (longest first
//   for causal): the grid's last waves then end on short tiles, as the ordinary grid does. (The
//   longest-first variant is the L2-grouped order with kv blocks ascending.)
//
// Block order along an axis ("fold"). A tile's work is the number of blocks on the other axis
// it visits. Along the axis, the lower side of the band is clamped at 0 on a prefix of blocks
// (work grows there: "rising ramp") and the upper side at the sequence end on a suffix (work
// shrinks there: "falling ramp"); between them lies the middle, where the work is the band's
// width (neither side clamped) or everything (both clamped). So the order is: the middle first
// (descending block index), then the two ramps from the middle outward, alternating. This is
// exactly longest-first when the work is monotone (causal, one-sided windows, full attention).
// For two-sided windows (a sliding window with causal is one) it is longest-first up to the
// rounding of rows to blocks: a later tile has at most one of its own blocks' worth more work,
// i.e. max(1, ceil(own block / other block)) blocks of the other axis (tested). Exact sorting
// would need a table per shape; the rounding error is a fraction of one tile's work, which does
// not move the tail.
#pragma once

#include <cstdint>

#include "src/scheduling/mask_math.h"

namespace flare::sched {

namespace order_detail {
FLARE_HD int min_int(int a, int b) { return a < b ? a : b; }
FLARE_HD int max_int(int a, int b) { return a > b ? a : b; }
FLARE_HD int ceil_div(int a, int b) { return (a + b - 1) / b; }
}  // namespace order_detail

// What a tile order depends on: the shapes (the max lengths when varlen) and the band.
struct TileShape {
  int batch = 1, heads = 1, heads_kv = 1;
  int seqlen_q = 0, seqlen_k = 0;
  int q_block = 128, kv_block = 128;
  int head_dim = 128, elem_bytes = 2;
  bool causal = false;
  int window_left = -1, window_right = -1;

  int num_q_blocks() const { return order_detail::ceil_div(seqlen_q, q_block); }
  int num_kv_blocks() const { return order_detail::ceil_div(seqlen_k, kv_block); }
  int group() const { return heads / heads_kv; }  // q-heads per kv head
  Band band() const { return Band::make(causal, window_left, window_right, seqlen_q, seqlen_k); }
};

struct TileCoord {
  int batch = 0, head = 0, block = 0;
};

// The visiting order of the blocks of one axis: [mid_begin, mid_end) first, descending; then the
// ramps [0, mid_begin) and [mid_end, num_blocks), from the middle outward, alternating.
struct BlockFold {
  int num_blocks = 0, mid_begin = 0, mid_end = 0;
};

FLARE_HD int block_at_rank(const BlockFold& f, int rank) {
  const int mid = f.mid_end - f.mid_begin;
  if (rank < mid) return f.mid_end - 1 - rank;
  const int k = rank - mid;  // k-th block of the ramps
  const int below = f.mid_begin, above = f.num_blocks - f.mid_end;
  const int paired = order_detail::min_int(below, above);
  if (k < 2 * paired) return (k & 1) ? f.mid_end + k / 2 : f.mid_begin - 1 - k / 2;
  // Only the longer ramp is left; `paired` of its blocks are already placed.
  const int d = k - paired;
  return below > above ? f.mid_begin - 1 - d : f.mid_end + d;
}

FLARE_HD int rank_of_block(const BlockFold& f, int block) {
  const int mid = f.mid_end - f.mid_begin;
  if (block >= f.mid_begin && block < f.mid_end) return f.mid_end - 1 - block;
  const bool is_below = block < f.mid_begin;
  const int d = is_below ? f.mid_begin - 1 - block : block - f.mid_end;  // distance from the middle
  const int paired = order_detail::min_int(f.mid_begin, f.num_blocks - f.mid_end);
  if (d < paired) return mid + 2 * d + (is_below ? 0 : 1);
  return mid + paired + d;
}

struct TileOrder {
  int num_tiles = 0;
  int heads = 1;            // q-heads
  int group = 1;            // q-heads per kv head
  int num_units = 0;        // batch * heads_kv: (batch, kv head) pairs, b-major
  int units_per_group = 1;  // units whose shared bytes fit the L2 budget together
  int tiles_per_group = 0;  // units_per_group * group * blocks.num_blocks
  int first_units = 1;      // units of the first group: the partial one, or units_per_group; the rest are full
  bool head_major = false;  // true: a head's blocks are consecutive; false: block rank outer
  BlockFold blocks;         // order of the block axis (q-blocks forward, kv-blocks backward)
  // Head-major orders only (0 for the others): the last flat heads (b * heads + h), interleaved
  // after the others with their blocks in the fold's reverse (the deterministic backward's
  // kShortestTail, dq_turns.h).
  int reversed_heads = 0;
};

// The first flat head of a head-major order's reversed tail, and the tile index where it begins.
FLARE_HD int first_reversed_head(const TileOrder& o) { return o.num_units * o.group - o.reversed_heads; }
FLARE_HD int reversed_tail_begin(const TileOrder& o) { return first_reversed_head(o) * o.blocks.num_blocks; }

// The tile at linear index `tile` in [0, num_tiles). The divisors are plan constants: a kernel
// that finds these divisions on its critical path would keep fast divisors (multiplier and
// shift, one for tiles_per_group, heads, num_blocks and the first and full groups' head counts)
// next to this struct; plain division is kept until a profile asks for it.
FLARE_HD TileCoord tile_at(const TileOrder& o, int tile) {
  if (tile >= reversed_tail_begin(o)) {  // the reversed heads, block rank outer
    const int k = tile - reversed_tail_begin(o);
    const int rank = k / o.reversed_heads;
    const int flat_head = first_reversed_head(o) + (k - rank * o.reversed_heads);
    TileCoord c;
    c.batch = flat_head / o.heads;
    c.head = flat_head - c.batch * o.heads;
    c.block = o.blocks.num_blocks - 1 - block_at_rank(o.blocks, rank);
    return c;
  }
  // Group 0 holds units [0, first_units); group g >= 1 the units_per_group after it.
  const int first_tiles = o.first_units * o.group * o.blocks.num_blocks;
  int in_group = tile, first_unit = 0, heads_here = o.first_units * o.group;
  if (tile >= first_tiles) {
    const int group_index = (tile - first_tiles) / o.tiles_per_group;
    in_group = tile - first_tiles - group_index * o.tiles_per_group;
    first_unit = o.first_units + group_index * o.units_per_group;
    heads_here = o.units_per_group * o.group;
  }
  int head_in_group, rank;
  if (o.head_major) {
    head_in_group = in_group / o.blocks.num_blocks;
    rank = in_group - head_in_group * o.blocks.num_blocks;
  } else {
    rank = in_group / heads_here;
    head_in_group = in_group - rank * heads_here;
  }
  // Unit u = b * heads_kv + kv_head holds q-heads kv_head * group + j, so the flat q-head index
  // u * group + j is b * heads + h.
  const int flat_head = first_unit * o.group + head_in_group;
  TileCoord c;
  c.batch = flat_head / o.heads;
  c.head = flat_head - c.batch * o.heads;
  c.block = block_at_rank(o.blocks, rank);
  return c;
}

// The inverse of tile_at.
FLARE_HD int tile_index_of(const TileOrder& o, const TileCoord& c) {
  const int flat_head = c.batch * o.heads + c.head;
  if (flat_head >= first_reversed_head(o))
    return reversed_tail_begin(o) + rank_of_block(o.blocks, o.blocks.num_blocks - 1 - c.block) * o.reversed_heads +
           (flat_head - first_reversed_head(o));
  const int unit = flat_head / o.group;
  int group_start = 0, first_unit = 0, heads_here = o.first_units * o.group;
  if (unit >= o.first_units) {
    const int group_index = (unit - o.first_units) / o.units_per_group;
    group_start = o.first_units * o.group * o.blocks.num_blocks + group_index * o.tiles_per_group;
    first_unit = o.first_units + group_index * o.units_per_group;
    heads_here = o.units_per_group * o.group;
  }
  const int head_in_group = flat_head - first_unit * o.group;
  const int rank = rank_of_block(o.blocks, c.block);
  const int in_group = o.head_major ? head_in_group * o.blocks.num_blocks + rank : rank * heads_here + head_in_group;
  return group_start + in_group;
}

// ---- host planning ---------------------------------------------------------------------------

// Bytes one unit (batch entry, kv head) shares among its tiles. Forward: its K and V, read by
// every q-block tile of its q-heads. Backward: the Q, dO (elem_bytes each), dQ accumulator (fp32)
// and LSE, dP-sum (fp32 per row) of its `group` q-heads, read by every kv-block tile.
inline int64_t forward_unit_bytes(const TileShape& s) {
  return 2LL * s.seqlen_k * s.head_dim * s.elem_bytes;
}
inline int64_t backward_unit_bytes(const TileShape& s) {
  const int64_t per_row = (int64_t)s.head_dim * (2LL * s.elem_bytes + 4) + 8;
  return (int64_t)s.group() * s.seqlen_q * per_row;
}

// The fold of an axis whose block i has its lower side clamped for i < rising_end and its upper
// side clamped for i >= falling_begin (both monotone: a prefix and a suffix).
inline BlockFold fold_of(int num_blocks, int rising_end, int falling_begin) {
  BlockFold f;
  f.num_blocks = num_blocks;
  f.mid_begin = order_detail::min_int(rising_end, falling_begin);
  f.mid_end = order_detail::max_int(rising_end, falling_begin);
  return f;
}

// Forward axis: q-block m, rows [r0, r1). Lower side: the first row's first key is key 0.
// Upper side: the last row's last key is the sequence's last key.
inline BlockFold forward_fold(const TileShape& s) {
  const Band band = s.band();
  const int blocks = s.num_q_blocks();
  auto lower_clamped = [&](int m) {
    return band.left >= kUnbounded || (int64_t)m * s.q_block + band.offset - band.left <= 0;
  };
  auto upper_clamped = [&](int m) {
    const int64_t last_row = order_detail::min_int(s.seqlen_q, (m + 1) * s.q_block) - 1;
    return band.right >= kUnbounded || last_row + band.offset + band.right + 1 >= s.seqlen_k;
  };
  int rising_end = 0, falling_begin = blocks;
  while (rising_end < blocks && lower_clamped(rising_end)) ++rising_end;
  while (falling_begin > 0 && upper_clamped(falling_begin - 1)) --falling_begin;
  return fold_of(blocks, rising_end, falling_begin);
}

// Backward axis: kv-block n, columns [c0, c1). Lower side: the first row that sees c0 is row 0.
// Upper side: the last row that sees c1 - 1 is the last row.
inline BlockFold backward_fold(const TileShape& s) {
  const Band band = s.band();
  const int blocks = s.num_kv_blocks();
  auto lower_clamped = [&](int n) {
    return band.right >= kUnbounded || (int64_t)n * s.kv_block - band.right - band.offset <= 0;
  };
  auto upper_clamped = [&](int n) {
    const int64_t last_col = order_detail::min_int(s.seqlen_k, (n + 1) * s.kv_block) - 1;
    return band.left >= kUnbounded || last_col + band.left - band.offset + 1 >= s.seqlen_q;
  };
  int rising_end = 0, falling_begin = blocks;
  while (rising_end < blocks && lower_clamped(rising_end)) ++rising_end;
  while (falling_begin > 0 && upper_clamped(falling_begin - 1)) --falling_begin;
  return fold_of(blocks, rising_end, falling_begin);
}

inline TileOrder order_of(const TileShape& s, const BlockFold& blocks, int64_t unit_bytes, int64_t l2_budget_bytes,
                          bool head_major) {
  TileOrder o;
  o.heads = s.heads;
  o.group = s.group();
  o.num_units = s.batch * s.heads_kv;
  const int64_t fit = unit_bytes > 0 ? l2_budget_bytes / unit_bytes : o.num_units;
  o.units_per_group = (int)(fit < 1 ? 1 : (fit > o.num_units ? o.num_units : fit));
  if (o.units_per_group < 1) o.units_per_group = 1;  // no units at all
  o.blocks = blocks;
  o.head_major = head_major;
  o.tiles_per_group = order_detail::max_int(1, o.units_per_group * o.group * blocks.num_blocks);
  const int partial = o.num_units % o.units_per_group;
  o.first_units = partial > 0 ? partial : o.units_per_group;
  o.num_tiles = s.batch * s.heads * blocks.num_blocks;
  return o;
}

// Forward: (b, h, q-block), longest first inside each L2 group of K/V heads.
inline TileOrder make_forward_order(const TileShape& s, int64_t l2_budget_bytes) {
  return order_of(s, forward_fold(s), forward_unit_bytes(s), l2_budget_bytes, /*head_major=*/false);
}

// Backward: (b, h, kv-block). Non-deterministic: longest first inside each L2 group. Deterministic:
// head-major, kv blocks descending (shortest first for causal), or ascending (`longest_first`:
// longest first for causal), the orders dq_turns.h builds on.
inline TileOrder make_backward_order(const TileShape& s, int64_t l2_budget_bytes, bool deterministic,
                                     bool longest_first = false) {
  if (!deterministic)
    return order_of(s, backward_fold(s), backward_unit_bytes(s), l2_budget_bytes, /*head_major=*/false);
  BlockFold axis;  // the whole axis as the middle (descending), or as the upper ramp (ascending)
  axis.num_blocks = s.num_kv_blocks();
  axis.mid_begin = 0;
  axis.mid_end = longest_first ? 0 : axis.num_blocks;
  return order_of(s, axis, backward_unit_bytes(s), l2_budget_bytes, /*head_major=*/!longest_first);
}

}  // namespace flare::sched
