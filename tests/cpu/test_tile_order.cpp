// Tile order: a bijection on many shapes, L2 groups contiguous, longest first against brute force.
#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "src/scheduling/grid_sim.h"
#include "src/scheduling/tile_order.h"

namespace flare::sched {
namespace {

struct BandCase {
  bool causal;
  int left, right;
};
const BandCase kBands[] = {{false, -1, -1}, {true, -1, -1}, {true, 5, -1},  {false, 7, 3},
                           {false, -1, 4},  {false, 9, -1}, {false, 0, 0},  {true, 0, -1},
                           {true, 40, -1},  {false, 30, 50}};

// A band bounded on at most one side has work monotone along either axis: longest first is exact.
bool one_sided(const BandCase& c) {
  const bool left_bounded = c.left >= 0;
  const bool right_bounded = c.causal || c.right >= 0;
  return !(left_bounded && right_bounded);
}

struct HeadCase {
  int batch, heads, heads_kv;
};
const HeadCase kHeads[] = {{1, 1, 1}, {2, 4, 1}, {3, 6, 3}, {2, 8, 8}, {1, 12, 4}};

// Brute-force work of a tile's block: the blocks of the other axis it visits.
int forward_work(const TileShape& s, int m) {
  const Band band = s.band();
  int count = 0;
  for (int n = 0; n < s.num_kv_blocks(); ++n) {
    bool any = false;
    for (int i = m * s.q_block; i < std::min(s.seqlen_q, (m + 1) * s.q_block) && !any; ++i)
      for (int j = n * s.kv_block; j < std::min(s.seqlen_k, (n + 1) * s.kv_block) && !any; ++j)
        any = band.visible(i, j);
    count += any;
  }
  return count;
}
int backward_work(const TileShape& s, int n) {
  const Band band = s.band();
  int count = 0;
  for (int m = 0; m < s.num_q_blocks(); ++m) {
    bool any = false;
    for (int i = m * s.q_block; i < std::min(s.seqlen_q, (m + 1) * s.q_block) && !any; ++i)
      for (int j = n * s.kv_block; j < std::min(s.seqlen_k, (n + 1) * s.kv_block) && !any; ++j)
        any = band.visible(i, j);
    count += any;
  }
  return count;
}

// Calls fn(shape, band case) on every shape of the sweep.
template <class Fn>
void for_each_shape(Fn fn) {
  for (const BandCase& bc : kBands)
    for (const HeadCase& hc : kHeads)
      for (int sq : {1, 37, 64, 100})
        for (int sk : {1, 40, 64, 130})
          for (int qb : {16, 32})
            for (int kb : {16, 64}) {
              TileShape s;
              s.batch = hc.batch, s.heads = hc.heads, s.heads_kv = hc.heads_kv;
              s.seqlen_q = sq, s.seqlen_k = sk, s.q_block = qb, s.kv_block = kb;
              s.head_dim = 64, s.elem_bytes = 2;
              s.causal = bc.causal, s.window_left = bc.left, s.window_right = bc.right;
              fn(s, bc);
            }
}

// The L2 budgets tried: below one unit, a few units, everything.
std::vector<int64_t> budgets_for(int64_t unit_bytes) { return {unit_bytes / 2, 3 * unit_bytes, 1LL << 40}; }

TEST(BlockFold, RankAndBlockAreInverse) {
  for (int blocks = 0; blocks <= 12; ++blocks)
    for (int begin = 0; begin <= blocks; ++begin)
      for (int end = begin; end <= blocks; ++end) {
        BlockFold f{blocks, begin, end};
        std::vector<int> seen(blocks, 0);
        for (int r = 0; r < blocks; ++r) {
          const int b = block_at_rank(f, r);
          ASSERT_GE(b, 0);
          ASSERT_LT(b, blocks);
          ++seen[b];
          ASSERT_EQ(rank_of_block(f, b), r) << blocks << " " << begin << " " << end;
        }
        for (int b = 0; b < blocks; ++b) ASSERT_EQ(seen[b], 1);
      }
}

// Every index maps to a distinct valid tile, every tile is reached, and tile_index_of inverts.
void expect_bijection(const TileOrder& o, const TileShape& s, int blocks) {
  ASSERT_EQ(o.num_tiles, s.batch * s.heads * blocks);
  std::vector<char> seen(o.num_tiles, 0);
  for (int t = 0; t < o.num_tiles; ++t) {
    const TileCoord c = tile_at(o, t);
    ASSERT_TRUE(c.batch >= 0 && c.batch < s.batch && c.head >= 0 && c.head < s.heads && c.block >= 0 &&
                c.block < blocks)
        << "t=" << t << " -> " << c.batch << "," << c.head << "," << c.block;
    const int flat = (c.batch * s.heads + c.head) * blocks + c.block;
    ASSERT_FALSE(seen[flat]) << "tile reached twice, t=" << t;
    seen[flat] = 1;
    ASSERT_EQ(tile_index_of(o, c), t);
  }
}

TEST(TileOrder, EveryOrderIsABijection) {
  int orders = 0;
  for_each_shape([&](const TileShape& s, const BandCase&) {
    for (int64_t budget : budgets_for(forward_unit_bytes(s))) {
      expect_bijection(make_forward_order(s, budget), s, s.num_q_blocks());
      ++orders;
    }
    for (int64_t budget : budgets_for(backward_unit_bytes(s)))
      for (bool det : {false, true})
        for (bool longest : {false, true}) {
          TileOrder o = make_backward_order(s, budget, det, longest);
          expect_bijection(o, s, s.num_kv_blocks());
          ++orders;
          if (!o.head_major) continue;
          // The last heads interleaved with their blocks reversed (kShortestTail, dq_turns.h).
          for (int reversed : {1, 3, s.batch * s.heads}) {
            o.reversed_heads = std::min(reversed, s.batch * s.heads);
            expect_bijection(o, s, s.num_kv_blocks());
            ++orders;
          }
        }
  });
  EXPECT_GT(orders, 5000);
}

// Checks the group/longest-first structure of a non-head-major order:
// - L2 groups (runs of `per_group` units, b-major) are contiguous and as large as the budget allows,
//   the partial one (num_units % per_group units) first;
// - inside a group the block rank is outer and the flat q-head (b * heads + h) inner, ascending,
//   so the q-heads of one kv head are adjacent;
// - the work never grows along a group by more than `slack` blocks (0: exactly longest first).
// Returns the largest growth seen.
int check_grouped_order(const TileOrder& o, const TileShape& s, int64_t unit_bytes, int64_t budget,
                        int (*work_of)(const TileShape&, int)) {
  const int num_units = s.batch * s.heads_kv;
  int per_group = 1;  // brute force: the most units that fit
  while (per_group < num_units && (per_group + 1) * unit_bytes <= budget) ++per_group;
  EXPECT_EQ(o.units_per_group, per_group);
  const int first_units = num_units % per_group > 0 ? num_units % per_group : per_group;
  auto group_of_unit = [&](int u) { return u < first_units ? 0 : 1 + (u - first_units) / per_group; };
  auto first_flat_of_group = [&](int g) { return (g == 0 ? 0 : first_units + (g - 1) * per_group) * s.group(); };

  const int blocks = o.blocks.num_blocks;
  std::vector<int> work(blocks);
  for (int b = 0; b < blocks; ++b) work[b] = work_of(s, b);

  int worst_growth = 0, least_work_so_far = 0, prev_group = -1, prev_flat = -1, prev_rank = -1;
  for (int t = 0; t < o.num_tiles; ++t) {
    const TileCoord c = tile_at(o, t);
    const int flat = c.batch * s.heads + c.head;
    const int group = group_of_unit(flat / s.group());
    const int rank = rank_of_block(o.blocks, c.block);
    if (group != prev_group) {
      EXPECT_EQ(group, prev_group + 1) << "groups out of order at t=" << t;
      EXPECT_EQ(rank, 0);
      EXPECT_EQ(flat, first_flat_of_group(group));
      least_work_so_far = work[c.block];
    } else if (rank == prev_rank) {
      EXPECT_EQ(flat, prev_flat + 1) << "heads of a group not adjacent at t=" << t;
    } else {
      EXPECT_EQ(rank, prev_rank + 1);
      EXPECT_EQ(flat, first_flat_of_group(group));
    }
    // A tile after a shorter one is out of longest-first order by the difference.
    worst_growth = std::max(worst_growth, work[c.block] - least_work_so_far);
    least_work_so_far = std::min(least_work_so_far, work[c.block]);
    prev_group = group, prev_flat = flat, prev_rank = rank;
  }
  return worst_growth;
}

TEST(TileOrder, GroupsAreContiguousAndLongestWorkComesFirst) {
  int worst_excess = 0;  // growth beyond one block of rounding, two-sided bands
  for_each_shape([&](const TileShape& s, const BandCase& bc) {
    // Two-sided bands: rows rounded to blocks move the work by up to one block of the tile's own
    // axis, counted in blocks of the other axis (at least one).
    const int forward_slack = one_sided(bc) ? 0 : std::max(1, order_detail::ceil_div(s.q_block, s.kv_block));
    const int backward_slack = one_sided(bc) ? 0 : std::max(1, order_detail::ceil_div(s.kv_block, s.q_block));
    for (int64_t budget : budgets_for(forward_unit_bytes(s))) {
      const TileOrder o = make_forward_order(s, budget);
      const int growth = check_grouped_order(o, s, forward_unit_bytes(s), budget, forward_work);
      EXPECT_LE(growth, forward_slack) << "forward sq=" << s.seqlen_q << " sk=" << s.seqlen_k << " qb=" << s.q_block
                                       << " kb=" << s.kv_block << " causal=" << bc.causal << " l=" << bc.left
                                       << " r=" << bc.right;
      worst_excess = std::max(worst_excess, growth - forward_slack);
    }
    for (int64_t budget : budgets_for(backward_unit_bytes(s))) {
      const TileOrder o = make_backward_order(s, budget, /*deterministic=*/false);
      const int growth = check_grouped_order(o, s, backward_unit_bytes(s), budget, backward_work);
      EXPECT_LE(growth, backward_slack) << "backward sq=" << s.seqlen_q << " sk=" << s.seqlen_k
                                        << " qb=" << s.q_block << " kb=" << s.kv_block << " causal=" << bc.causal
                                        << " l=" << bc.left << " r=" << bc.right;
      worst_excess = std::max(worst_excess, growth - backward_slack);
    }
  });
  EXPECT_LE(worst_excess, 0);
}

// Causal square attention, the case the kernels care most about: strictly the reverse of the
// natural order (forward) and the natural order (backward).
TEST(TileOrder, CausalIsDescendingForwardAndAscendingBackward) {
  TileShape s;
  s.batch = 2, s.heads = 4, s.heads_kv = 2, s.seqlen_q = s.seqlen_k = 1000, s.q_block = s.kv_block = 128;
  s.causal = true;
  const TileOrder fwd = make_forward_order(s, 1LL << 40);
  const TileOrder bwd = make_backward_order(s, 1LL << 40, false);
  for (int r = 0; r < s.num_q_blocks(); ++r) EXPECT_EQ(block_at_rank(fwd.blocks, r), s.num_q_blocks() - 1 - r);
  for (int r = 0; r < s.num_kv_blocks(); ++r) EXPECT_EQ(block_at_rank(bwd.blocks, r), r);
}

// The grid's tail on causal square shapes: CTAs take the order's tiles from a counter (the Hopper
// persistent forward) or the hardware dispatches one CTA per tile in index order (the portable
// masked forward); a tile costs its key blocks and a start. Units that do not fill their last
// group: the partial group first keeps the makespan near the work / CTAs; last (until session 52),
// its few heads' longest tiles started after every other group's (d128 4k: 1.10, d256 1k: 1.15).
TEST(TileOrder, CausalTailStaysShortWithAPartialGroup) {
  struct Case {
    int units, q_blocks, per_group, ctas;
  };
  // 16k tokens: d128 at 4k (128-row tiles, 7 units of K/V in half of L2, one CTA an SM) and 2k;
  // d256 at 1k on the portable forward (64-row tiles, two CTAs an SM).
  for (const Case& c : {Case{64, 32, 7, 132}, Case{128, 16, 14, 132}, Case{128, 16, 30, 264}}) {
    TileShape s;
    s.batch = c.units / 16, s.heads = s.heads_kv = 16;
    s.seqlen_q = s.seqlen_k = 128 * c.q_blocks, s.q_block = s.kv_block = 128;
    s.causal = true;
    s.head_dim = 128, s.elem_bytes = 2;
    const TileOrder o = make_forward_order(s, c.per_group * forward_unit_bytes(s));
    ASSERT_EQ(o.units_per_group, c.per_group);
    ASSERT_NE(c.units % c.per_group, 0) << "a case with a partial group";
    SimWorkload w;
    double work = 0;
    for (int t = 0; t < o.num_tiles; ++t) {
      SimStep step;
      step.compute = 0.5 + (tile_at(o, t).block + 1);  // causal square: block m sees m + 1 key blocks
      work += step.compute;
      w.tiles.push_back({step});
    }
    SimOptions opt;
    opt.resident_ctas = c.ctas;
    opt.dispatch = Dispatch::kDynamic;
    const SimResult r = simulate_grid(w, opt);
    ASSERT_TRUE(r.completed);
    EXPECT_LT(r.makespan, 1.04 * work / c.ctas) << c.units << " units in groups of " << c.per_group;
  }
}

// Descending blocks, head by head; the `reversed_heads` last heads after them, block rank outer
// and heads inner, blocks ascending.
TEST(TileOrder, DeterministicBackwardIsHeadMajorWithDescendingBlocks) {
  for_each_shape([&](const TileShape& s, const BandCase&) {
    TileOrder o = make_backward_order(s, backward_unit_bytes(s), /*deterministic=*/true);
    const int blocks = s.num_kv_blocks(), heads = s.batch * s.heads;
    for (int reversed : {0, 1, 2, heads}) {
      o.reversed_heads = std::min(reversed, heads);
      const int tail = (heads - o.reversed_heads) * blocks;
      for (int t = 0; t < o.num_tiles; ++t) {
        const TileCoord c = tile_at(o, t);
        const int flat_head = c.batch * s.heads + c.head;
        if (t < tail) {
          ASSERT_EQ(flat_head, t / blocks);
          ASSERT_EQ(c.block, blocks - 1 - t % blocks);
        } else {
          ASSERT_EQ(flat_head, heads - o.reversed_heads + (t - tail) % o.reversed_heads);
          ASSERT_EQ(c.block, (t - tail) / o.reversed_heads);
        }
      }
    }
  });
}

}  // namespace
}  // namespace flare::sched
