// Deterministic dQ turns against brute force: walks cover exactly the touching q-blocks, the
// turns at each q-block are 0..count-1 in (round, rotation) order, and lockstep runs never wait.
#include <gtest/gtest.h>

#include <algorithm>
#include <tuple>
#include <vector>

#include "src/scheduling/dq_turns.h"

namespace flare::sched {
namespace {

struct BandCase {
  bool causal;
  int left, right;
};
const BandCase kBands[] = {{false, -1, -1}, {true, -1, -1}, {true, 5, -1}, {false, 7, 3},
                           {false, -1, 4},  {false, 9, -1}, {false, 0, 0}, {true, 40, -1}};

// Brute force: does kv block n touch q block m (some visible element)?
bool touches(const DqPlan& p, const DqSequence& s, int n, int m) {
  for (int i = m * p.q_block; i < std::min(s.seqlen_q, (m + 1) * p.q_block); ++i)
    for (int j = n * p.kv_block; j < std::min(s.seqlen_k, (n + 1) * p.kv_block); ++j)
      if (s.band.visible(i, j)) return true;
  return false;
}

// The tile's q-blocks in walk order.
std::vector<int> walk_of(const DqPlan& p, const DqSequence& s, int n) {
  const DqWalk w = dq_walk(p, s, n);
  std::vector<int> ms;
  for (int step = 0; step < w.count; ++step) ms.push_back(q_block_at(w, step));
  return ms;
}

// Checks one (plan, b, h, sequence lengths) exhaustively against brute force.
void check_sequence(const DqPlan& p, int b, int h, int seqlen_q, int seqlen_k) {
  const DqSequence s = dq_sequence(p, seqlen_q, seqlen_k, b, h);
  const int num_m = s.num_q_blocks, num_n = s.num_kv_blocks;
  std::vector<std::vector<int>> walks(num_n);
  for (int n = 0; n < num_n; ++n) {
    walks[n] = walk_of(p, s, n);
    std::vector<int> sorted = walks[n];
    std::sort(sorted.begin(), sorted.end());
    std::vector<int> expected;
    for (int m = 0; m < num_m; ++m)
      if (touches(p, s, n, m)) expected.push_back(m);
    ASSERT_EQ(sorted, expected) << "walk of n=" << n << " covers the wrong q-blocks";
    // The walk follows the rotation: T(n, m) = (m - n) mod Q strictly increasing.
    if (s.rotate()) {
      for (size_t k = 1; k < walks[n].size(); ++k)
        ASSERT_LT(positive_mod(walks[n][k - 1] - n, s.period), positive_mod(walks[n][k] - n, s.period));
    }
  }
  for (int m = 0; m < num_m; ++m) {
    // Brute-force turn order: sort the touching tiles by (round, T) for rotated sequences, by
    // tile index otherwise.
    std::vector<std::tuple<int, int, int>> keyed;  // (round or index, T, n)
    for (int n = 0; n < num_n; ++n) {
      if (!touches(p, s, n, m)) continue;
      const int index = tile_index_of(p.order, TileCoord{b, h, n});
      if (s.rotate())
        keyed.emplace_back(index / p.round_tiles, positive_mod(m - n, s.period), n);
      else
        keyed.emplace_back(index, 0, n);
    }
    std::sort(keyed.begin(), keyed.end());
    ASSERT_EQ(dq_num_turns(p, s, m), (int)keyed.size()) << "m=" << m;
    for (int k = 0; k < (int)keyed.size(); ++k) {
      const int n = std::get<2>(keyed[k]);
      if (p.scheme != DqScheme::kDiagonal)
        ASSERT_EQ(dq_turn_at(dq_turn_cursor(p, s, b, h, n), p, s, m), k) << "cursor, m=" << m << " n=" << n;
      ASSERT_EQ(dq_turn(p, s, b, h, n, m), k) << "m=" << m << " n=" << n << " sq=" << seqlen_q << " sk=" << seqlen_k
                                              << " round=" << p.round_tiles;
    }
  }
}

TEST(DqTurns, TurnsAreARankingOfTheTouchingTilesAgainstBruteForce) {
  int sequences = 0;
  for (const BandCase& bc : kBands)
    for (int qb : {16, 32})
      for (int kb : {16, 32})
        for (int max_sq : {40, 96})
          for (int max_sk : {40, 130})
            for (DqScheme scheme : {DqScheme::kAuto, DqScheme::kDiagonal, DqScheme::kTileOrder,
                                    DqScheme::kLongestFirst, DqScheme::kShortestTail})
              for (int round : {1, 2, 7, 132}) {
                TileShape shape;
                shape.batch = 2, shape.heads = 4, shape.heads_kv = 2;
                shape.seqlen_q = max_sq, shape.seqlen_k = max_sk, shape.q_block = qb, shape.kv_block = kb;
                shape.causal = bc.causal, shape.window_left = bc.left, shape.window_right = bc.right;
                const DqPlan p = make_dq_plan(shape, 1LL << 30, round, scheme);
                // Varlen: shorter sequences than the max, including empty and single-row ones.
                for (int sq : {max_sq, 0, 1, max_sq / 2 + 1})
                  for (int sk : {max_sk, 0, 1, max_sk / 3 + 2}) {
                    check_sequence(p, 1, 3, sq, sk);  // the last flat head
                    ++sequences;
                    if (scheme == DqScheme::kShortestTail) check_sequence(p, 0, 1, sq, sk);
                  }
              }
  EXPECT_GT(sequences, 30000);
}

// Auto rotates exactly the sequences where every kv block touches every q block.
TEST(DqTurns, AutoRotatesExactlyTheRectangles) {
  int rectangles = 0, others = 0;
  for (const BandCase& bc : kBands)
    for (int sq : {0, 1, 40, 96})
      for (int sk : {0, 1, 40, 130}) {
        TileShape shape;
        shape.seqlen_q = sq, shape.seqlen_k = sk, shape.q_block = 16, shape.kv_block = 32;
        shape.causal = bc.causal, shape.window_left = bc.left, shape.window_right = bc.right;
        const DqPlan p = make_dq_plan(shape, 1LL << 30, 132);
        const DqSequence s = dq_sequence(p, sq, sk, 0, 0);
        bool all = s.num_q_blocks > 0 && s.num_kv_blocks > 0;
        for (int n = 0; n < s.num_kv_blocks; ++n)
          for (int m = 0; m < s.num_q_blocks; ++m) all = all && touches(p, s, n, m);
        EXPECT_EQ(s.rotate(), all) << "sq=" << sq << " sk=" << sk << " causal=" << bc.causal << " l=" << bc.left;
        (all ? rectangles : others)++;
      }
  EXPECT_GT(rectangles, 10);
  EXPECT_GT(others, 10);
}

// Causal square attention: even forced to rotate, the diagonal order is exactly shortest-first
// (walk ascending from the diagonal, the largest n adds first), whatever the rounds.
TEST(DqTurns, CausalSquareIsShortestFirst) {
  TileShape shape;
  shape.batch = 1, shape.heads = 2, shape.heads_kv = 1, shape.seqlen_q = shape.seqlen_k = 1000;
  shape.q_block = shape.kv_block = 64, shape.causal = true;
  for (int round : {1, 5, 132}) {
    const DqPlan p = make_dq_plan(shape, 1LL << 30, round, DqScheme::kDiagonal);
    const DqSequence s = dq_sequence(p, 1000, 1000, 0, 1);
    for (int n = 0; n < s.num_kv_blocks; ++n) {
      const DqWalk w = dq_walk(p, s, n);
      EXPECT_EQ(w.start, n);
      EXPECT_EQ(w.count, s.num_q_blocks - n);
      for (int m = n; m < s.num_q_blocks; ++m) EXPECT_EQ(dq_turn(p, s, 0, 1, n, m), m - n);
    }
  }
}

// With every tile of a head in one round and all starting together, one step per time unit, a
// tile never reaches m before its predecessor in turn has added there: at each m the steps at
// which the tiles visit it strictly increase with the turn.
void expect_lockstep_without_waiting(const TileShape& shape) {
  const DqPlan p = make_dq_plan(shape, 1LL << 30, /*resident_ctas=*/1 << 20, DqScheme::kAuto);
  const DqSequence s = dq_sequence(p, shape.seqlen_q, shape.seqlen_k, 0, 0);
  std::vector<std::vector<int>> step_of_turn(s.num_q_blocks);
  for (int m = 0; m < s.num_q_blocks; ++m) step_of_turn[m].assign(dq_num_turns(p, s, m), -1);
  for (int n = 0; n < s.num_kv_blocks; ++n) {
    const DqWalk w = dq_walk(p, s, n);
    for (int step = 0; step < w.count; ++step) {
      const int m = q_block_at(w, step);
      step_of_turn[m][dq_turn(p, s, 0, 0, n, m)] = step;
    }
  }
  for (int m = 0; m < s.num_q_blocks; ++m)
    for (size_t k = 1; k < step_of_turn[m].size(); ++k)
      ASSERT_LT(step_of_turn[m][k - 1], step_of_turn[m][k])
          << "m=" << m << " turn " << k << " causal=" << shape.causal << " window=" << shape.window_left;
}

TEST(DqTurns, LockstepNeverWaitsForSquareCausalFullAndSlidingWindow) {
  for (int len : {128, 1000, 4096})
    for (int block : {64, 128}) {
      TileShape shape;
      shape.seqlen_q = shape.seqlen_k = len, shape.q_block = shape.kv_block = block;
      for (BandCase bc : {BandCase{false, -1, -1}, BandCase{true, -1, -1}, BandCase{true, 300, -1}}) {
        shape.causal = bc.causal, shape.window_left = bc.left, shape.window_right = bc.right;
        expect_lockstep_without_waiting(shape);
      }
    }
}

// Longest first, and the reversed heads of kShortestTail: a head's kv blocks in ascending tile
// index, walks descending, and at every q-block the tile with the earlier turn has the lower index
// (it starts no later) and reaches m in no more steps, so started in index order no tile waits on
// one that started after it. The other heads of kShortestTail: kv blocks in descending index, walks
// ascending, the same two properties (tile order's). GQA: the q-heads of a kv head reach each kv
// block in q-head order (the dK/dV turns'). Rounds of 2 and 132 CTAs reverse some heads and all.
TEST(DqTurns, LongestFirstTurnsFollowIndexAndArrival) {
  int checked = 0, reversed_heads = 0, kept_heads = 0;
  for (DqScheme scheme : {DqScheme::kLongestFirst, DqScheme::kShortestTail})
    for (int round : {2, 132})
      for (const BandCase& bc : kBands)
        for (int sq : {1, 40, 96, 300})
          for (int sk : {1, 40, 130, 300}) {
            TileShape shape;
            shape.batch = 2, shape.heads = 4, shape.heads_kv = 2;
            shape.seqlen_q = sq, shape.seqlen_k = sk, shape.q_block = 16, shape.kv_block = 32;
            shape.causal = bc.causal, shape.window_left = bc.left, shape.window_right = bc.right;
            const DqPlan p = make_dq_plan(shape, 1LL << 30, round, scheme);
            EXPECT_EQ(p.order.head_major, scheme == DqScheme::kShortestTail);
            for (int b = 0; b < 2; ++b)
              for (int h = 0; h < 4; ++h) {
                const DqSequence s = dq_sequence(p, sq, sk, b, h);
                const bool longest = scheme == DqScheme::kLongestFirst || b * 4 + h >= 8 - p.order.reversed_heads;
                ASSERT_EQ(s.descending(), longest);
                ASSERT_FALSE(s.rotate());
                if (scheme == DqScheme::kShortestTail) (longest ? reversed_heads : kept_heads)++;
                std::vector<std::vector<std::pair<int, int>>> by_turn(s.num_q_blocks);  // (index, step) per turn
                for (int m = 0; m < s.num_q_blocks; ++m) by_turn[m].assign(dq_num_turns(p, s, m), {-1, -1});
                for (int n = 0; n < s.num_kv_blocks; ++n) {
                  const int index = tile_index_of(p.order, TileCoord{b, h, n});
                  if (n > 0) ASSERT_EQ(tile_index_of(p.order, TileCoord{b, h, n - 1}) < index, longest);
                  if (h % 2 == 1) ASSERT_LT(tile_index_of(p.order, TileCoord{b, h - 1, n}), index) << "dK/dV turn order";
                  const DqWalk w = dq_walk(p, s, n);
                  for (int step = 0; step < w.count; ++step) {
                    const int m = q_block_at(w, step);
                    if (step > 0) ASSERT_EQ(m < q_block_at(w, step - 1), longest) << "walk direction";
                    by_turn[m][dq_turn(p, s, b, h, n, m)] = {index, step};
                  }
                }
                for (int m = 0; m < s.num_q_blocks; ++m)
                  for (size_t k = 1; k < by_turn[m].size(); ++k) {
                    ASSERT_LT(by_turn[m][k - 1].first, by_turn[m][k].first) << "m=" << m;
                    ASSERT_LE(by_turn[m][k - 1].second, by_turn[m][k].second) << "m=" << m << " turn " << k;
                    ++checked;
                  }
              }
          }
  EXPECT_GT(checked, 36000);
  EXPECT_GT(reversed_heads, 100);  // 132 CTAs reverse every head of these small shapes
  EXPECT_GT(kept_heads, 100);      // 2 CTAs keep most
}

// kShortestTail's reversed heads: those of the last `tail_waves` waves of resident CTAs, at least one
// and at most all; none for any other scheme.
TEST(DqTurns, ShortestTailReversesTheLastWavesHeads) {
  TileShape shape;
  shape.batch = 4, shape.heads = 16, shape.heads_kv = 16, shape.seqlen_q = shape.seqlen_k = 4096;
  shape.q_block = 64, shape.kv_block = 128, shape.causal = true;  // 32 kv blocks, 64 heads
  EXPECT_EQ(make_dq_plan(shape, 1LL << 30, 132, DqScheme::kShortestTail).order.reversed_heads, 10);  // 2 x ceil(132 / 32)
  EXPECT_EQ(make_dq_plan(shape, 1LL << 30, 132, DqScheme::kShortestTail, 1).order.reversed_heads, 5);
  EXPECT_EQ(make_dq_plan(shape, 1LL << 30, 132, DqScheme::kShortestTail, 0).order.reversed_heads, 1);
  EXPECT_EQ(make_dq_plan(shape, 1LL << 30, 1 << 20, DqScheme::kShortestTail).order.reversed_heads, 64);
  EXPECT_EQ(make_dq_plan(shape, 1LL << 30, 132, DqScheme::kAuto).order.reversed_heads, 0);
  EXPECT_EQ(make_dq_plan(shape, 1LL << 30, 132, DqScheme::kTileOrder).order.reversed_heads, 0);
  EXPECT_EQ(first_reversed_head(make_dq_plan(shape, 1LL << 30, 132, DqScheme::kShortestTail).order), 54);
  // The L2-capped count: a head's Q, dO (bf16), dQ accumulator (fp32) and statistics, 4096 x 1032 bytes.
  EXPECT_EQ(shortest_tail_heads_in_l2(shape, 25LL << 20), (25 << 20) / (4096 * 1032));  // 6
  EXPECT_EQ(shortest_tail_heads_in_l2(shape, 1), 1);
  EXPECT_EQ(shortest_tail_heads_in_l2(shape, 1LL << 40), 64);
  TileShape d256 = shape;
  d256.batch = 2, d256.heads = d256.heads_kv = 8, d256.seqlen_q = d256.seqlen_k = 8192, d256.head_dim = 256;
  EXPECT_EQ(shortest_tail_heads_in_l2(d256, 25LL << 20), 1);  // 16.8 MB a head
  d256.heads_kv = 2;  // GQA: still one q-head's bytes
  EXPECT_EQ(shortest_tail_heads_in_l2(d256, 25LL << 20), 1);
}

TEST(DqTurns, DkvTurnsFollowTheQHeadsOfAGroup) {
  for (int group : {1, 4, 8})
    for (int kv_head = 0; kv_head < 3; ++kv_head) {
      std::vector<int> turns;
      for (int j = 0; j < group; ++j) turns.push_back(dkv_turn(kv_head * group + j, group));
      for (int j = 0; j < group; ++j) EXPECT_EQ(turns[j], j);
      EXPECT_EQ(dkv_num_turns(group), group);
    }
}

// Writers over tiles of any step counts: writer j's steps (from writer_first_step on, stride W) are
// exactly the steps g = j (mod W) counted from the first tile, and its k-th is g / W.
TEST(WriterSteps, DealAcrossTiles) {
  for (int writers = 1; writers <= 3; ++writers)
    for (int j = 0; j < writers; ++j) {
      int step0 = 0, taken = 0;
      for (int steps : {0, 1, 5, 2, 7, 3, 64, 1, 0, 9}) {
        std::vector<int> mine;
        for (int it = writer_first_step(j, step0, writers); it < steps; it += writers) mine.push_back(it);
        std::vector<int> expect;
        for (int it = 0; it < steps; ++it)
          if ((step0 + it) % writers == j) expect.push_back(it);
        EXPECT_EQ(mine, expect) << writers << " writers, writer " << j << ", step0 " << step0;
        for (int it : mine) EXPECT_EQ((step0 + it) / writers, taken++);
        step0 += steps;
      }
    }
}

}  // namespace
}  // namespace flare::sched
