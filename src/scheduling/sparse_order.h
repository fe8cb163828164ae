// The block-sparse forward's CTA order. One CTA per tile (batch, q-head, q tile of the kernel's
// rows); the hardware hands CTAs to SMs in launch order as SMs free up, so what runs last is the
// order's tail. The grid's own order was (q tile descending inside each head, heads in turn):
// longest first inside a head for causal-like masks, but for a document mask the longest rows lie
// in the longest document, wherever it is, and the last heads' long tiles ran alone at the end
// (H200, issue 6's 8 documents: SMs idle 13 % of the forward after their last CTA; bench/RESULTS.md,
// session 45).
//
// This order cuts the (batch, kv head) units into groups as the dense forward does (tile_order.h:
// b-major, a kv head's q-heads adjacent, K and V of a group within an L2 budget; every tile of a
// group before the next group's), of about two waves of tiles, and sorts each group's tiles by the length of their list row (partial + full
// kv blocks), longest first; ties keep the group's natural order (unit, q-head, q tile
// descending): the sort is stable, and a causal mask's tiles come in the dense forward's order
// (longest first inside a group, heads innermost). The lengths live on
// the device: the sort is a kernel (block_sparse/sparse_fwd_order.cu, one CTA per group);
// sparse_forward_order_host is its CPU reference.
#pragma once

#include <algorithm>
#include <vector>

#include "src/scheduling/tile_order.h"

namespace flare::sched {

// Lengths from this many blocks on share the last bucket (their order among themselves is then
// the natural one): the sort kernel's buckets.
inline constexpr int kSparseOrderBuckets = 2048;

struct SparseOrder {
  int batch = 1, heads = 1;
  int group = 1;            // q-heads per kv head
  int m_tiles = 1;          // q tiles per (batch, q-head)
  int units_per_group = 1;  // (batch, kv head) units an L2 group holds

  FLARE_HD int num_units() const { return batch * (heads / group); }
  FLARE_HD int num_tiles() const { return batch * heads * m_tiles; }
  FLARE_HD int num_groups() const { return (num_units() + units_per_group - 1) / units_per_group; }
  FLARE_HD int group_first_tile(int g) const { return g * units_per_group * group * m_tiles; }
  FLARE_HD int group_tiles(int g) const {
    const int units = num_units() - g * units_per_group;
    return (units < units_per_group ? units : units_per_group) * group * m_tiles;
  }
  // The i-th tile of group g in the natural order: the group's flat q-heads (b * heads + h, which
  // is unit * group + q-head of the unit) in turn, each one's q tiles descending.
  FLARE_HD TileCoord group_tile(int g, int i) const {
    const int head_in_group = i / m_tiles;
    const int flat = g * units_per_group * group + head_in_group;
    return TileCoord{flat / heads, flat % heads, m_tiles - 1 - (i - head_in_group * m_tiles)};
  }
  // A tile as one int in the order array, and back.
  FLARE_HD int encode(const TileCoord& c) const { return (c.batch * heads + c.head) * m_tiles + c.block; }
  FLARE_HD TileCoord decode(int v) const {
    const int flat = v / m_tiles;
    return TileCoord{flat / heads, flat % heads, v - flat * m_tiles};
  }
};

FLARE_HD int sparse_order_bucket(int length) {
  return length < 0 ? 0 : (length >= kSparseOrderBuckets ? kSparseOrderBuckets - 1 : length);
}

// The shape's order: groups of the units whose tiles make about two waves of `num_sms` CTAs, at
// most the dense forward's L2 group (make_forward_order with the same budget), at least one unit.
// On issue 6's shape (H200, 64 q tiles a head) groups of 4 heads beat the L2's 7 on the random
// blocks (0.986-0.995 of the grid's order's time against 1.014-1.016) and the window (1.016-1.023
// against 1.013-1.058), causal and documents alike; with the forward launched under the sort
// (programmatic dependent launch), 20 back-to-back calls: causal 0.980, documents 0.950, random
// 0.990, window 0.969 (bench/RESULTS.md, session 45).
inline SparseOrder make_sparse_forward_order(const TileShape& s, int64_t l2_budget_bytes, int num_sms) {
  const TileOrder dense = make_forward_order(s, l2_budget_bytes);
  SparseOrder o;
  o.batch = s.batch;
  o.heads = s.heads;
  o.group = s.group();
  o.m_tiles = s.num_q_blocks();
  const int unit_tiles = o.group * o.m_tiles;
  const int two_waves = unit_tiles > 0 ? 2 * num_sms / unit_tiles : dense.units_per_group;
  o.units_per_group = order_detail::max_int(1, order_detail::min_int(two_waves, dense.units_per_group));
  return o;
}

// CPU reference of the sort kernel: `length(TileCoord)` is a tile's list-row length in blocks.
template <typename LengthFn>
std::vector<int> sparse_forward_order_host(const SparseOrder& o, LengthFn&& length) {
  std::vector<int> order;
  order.reserve(o.num_tiles());
  for (int g = 0; g < o.num_groups(); ++g) {
    std::vector<std::pair<int, int>> tiles;  // (bucket, natural index)
    for (int i = 0; i < o.group_tiles(g); ++i) tiles.emplace_back(sparse_order_bucket(length(o.group_tile(g, i))), i);
    std::stable_sort(tiles.begin(), tiles.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
    for (const auto& t : tiles) order.push_back(o.encode(o.group_tile(g, t.second)));
  }
  return order;
}

}  // namespace flare::sched
