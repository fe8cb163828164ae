// The block-sparse forward's CTA order (src/scheduling/sparse_order.h): its groups are the dense
// order's L2 groups, each group's tiles a permutation of its units' tiles sorted longest first with
// ties in the natural order, and encode/decode inverse to each other.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <set>
#include <vector>

#include "src/scheduling/sparse_order.h"

namespace flare::sched {
namespace {

struct Shape {
  int batch, heads, heads_kv, seqlen;
  int64_t l2_budget;
  int sms;
};
const Shape kShapes[] = {{2, 16, 16, 8192, 25 << 20, 132}, {1, 4, 1, 1000, 1 << 20, 132}, {3, 6, 3, 300, 1 << 16, 8},
                         {2, 8, 2, 2049, 8 << 20, 132},    {1, 1, 1, 128, 1 << 30, 132},  {4, 12, 4, 777, 3 << 20, 20},
                         {2, 16, 16, 8192, 1 << 20, 132}};

TileShape tile_shape(const Shape& s) {
  TileShape t;
  t.batch = s.batch, t.heads = s.heads, t.heads_kv = s.heads_kv;
  t.seqlen_q = t.seqlen_k = s.seqlen;
  return t;
}

TEST(SparseOrder, GroupsAreTheDenseOrdersL2Groups) {
  for (const Shape& s : kShapes) {
    const TileShape t = tile_shape(s);
    const SparseOrder o = make_sparse_forward_order(t, s.l2_budget, s.sms);
    // About two waves of tiles, within the dense order's L2 group, at least one unit.
    const int l2_units = make_forward_order(t, s.l2_budget).units_per_group;
    const int unit_tiles = o.group * t.num_q_blocks();
    EXPECT_EQ(o.units_per_group, std::max(1, std::min(l2_units, 2 * s.sms / unit_tiles)));
    EXPECT_LE(o.units_per_group, l2_units);
    if (o.units_per_group > 1) EXPECT_LE(o.units_per_group * unit_tiles, 2 * s.sms);
    EXPECT_EQ(o.num_tiles(), s.batch * s.heads * t.num_q_blocks());
    int tiles = 0;
    for (int g = 0; g < o.num_groups(); ++g) {
      EXPECT_EQ(o.group_first_tile(g), tiles);
      std::set<int> units;
      for (int i = 0; i < o.group_tiles(g); ++i) {
        const TileCoord c = o.group_tile(g, i);
        units.insert((c.batch * s.heads + c.head) / o.group);  // the (batch, kv head) unit
        EXPECT_EQ(o.decode(o.encode(c)).batch, c.batch);
        EXPECT_EQ(o.decode(o.encode(c)).head, c.head);
        EXPECT_EQ(o.decode(o.encode(c)).block, c.block);
      }
      EXPECT_LE(static_cast<int>(units.size()), o.units_per_group);
      EXPECT_EQ(static_cast<int>(units.size()) * o.group * o.m_tiles, o.group_tiles(g));
      tiles += o.group_tiles(g);
    }
    EXPECT_EQ(tiles, o.num_tiles());
  }
}

TEST(SparseOrder, LongestFirstInEachGroupTiesInNaturalOrder) {
  std::mt19937 rng(7);
  for (const Shape& s : kShapes)
    for (int lengths_kind = 0; lengths_kind < 3; ++lengths_kind) {
      const SparseOrder o = make_sparse_forward_order(tile_shape(s), s.l2_budget, s.sms);
      // Random lengths (some past the last bucket), causal-like ones, and all equal.
      std::vector<int> length(o.num_tiles());
      for (int v = 0; v < o.num_tiles(); ++v) {
        const TileCoord c = o.decode(v);
        length[v] = lengths_kind == 0   ? static_cast<int>(rng() % 3000) - 5
                    : lengths_kind == 1 ? c.block + 1
                                        : 4;
      }
      const std::vector<int> order =
          sparse_forward_order_host(o, [&](const TileCoord& c) { return length[o.encode(c)]; });
      ASSERT_EQ(static_cast<int>(order.size()), o.num_tiles());
      EXPECT_EQ(std::set<int>(order.begin(), order.end()).size(), order.size()) << "a permutation";
      for (int g = 0; g < o.num_groups(); ++g) {
        std::vector<int> natural_rank(o.num_tiles(), -1);
        for (int i = 0; i < o.group_tiles(g); ++i) natural_rank[o.encode(o.group_tile(g, i))] = i;
        for (int k = 0; k < o.group_tiles(g); ++k) {
          const int v = order[o.group_first_tile(g) + k];
          ASSERT_GE(natural_rank[v], 0) << "tile of another group in group " << g;
          if (k == 0) continue;
          const int u = order[o.group_first_tile(g) + k - 1];
          const int bu = sparse_order_bucket(length[u]), bv = sparse_order_bucket(length[v]);
          EXPECT_GE(bu, bv);
          if (bu == bv) EXPECT_LT(natural_rank[u], natural_rank[v]) << "ties keep the natural order";
        }
      }
      if (lengths_kind == 2) {  // all equal: the natural order itself
        for (int g = 0; g < o.num_groups(); ++g)
          for (int i = 0; i < o.group_tiles(g); ++i)
            EXPECT_EQ(order[o.group_first_tile(g) + i], o.encode(o.group_tile(g, i)));
      }
    }
}

TEST(SparseOrder, NaturalOrderIsHeadsInTurnQTilesDescending) {
  SparseOrder o;
  o.batch = 2, o.heads = 4, o.group = 2, o.m_tiles = 3, o.units_per_group = 3;  // 4 units: groups of 3 and 1
  ASSERT_EQ(o.num_groups(), 2);
  EXPECT_EQ(o.group_tiles(0), 3 * 2 * 3);
  EXPECT_EQ(o.group_tiles(1), 1 * 2 * 3);
  const TileCoord first = o.group_tile(0, 0), fourth = o.group_tile(0, 3), last = o.group_tile(1, 5);
  EXPECT_EQ(std::vector<int>({first.batch, first.head, first.block}), std::vector<int>({0, 0, 2}));
  EXPECT_EQ(std::vector<int>({fourth.batch, fourth.head, fourth.block}), std::vector<int>({0, 1, 2}));
  EXPECT_EQ(std::vector<int>({last.batch, last.head, last.block}), std::vector<int>({1, 3, 0}));
  EXPECT_EQ(sparse_order_bucket(-3), 0);
  EXPECT_EQ(sparse_order_bucket(kSparseOrderBuckets + 9), kSparseOrderBuckets - 1);
}

}  // namespace
}  // namespace flare::sched
