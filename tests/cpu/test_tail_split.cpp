// tail_split / tail_work (src/scheduling/tail_split.h): every step of every tile is run exactly
// once, the split grid's makespan (greedy slots in CTA order, as the hardware dispatches) is never
// longer than the unsplit one's and is shorter where the last round was nearly empty.
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <queue>
#include <vector>

#include "src/scheduling/tail_split.h"

namespace flare::sched {
namespace {

// Greedy list scheduling of CTAs (in order) on `slots` slots: the finish time of the last.
double makespan(const std::vector<double>& cta_time, int slots) {
  std::priority_queue<double, std::vector<double>, std::greater<double>> free_at;
  for (int i = 0; i < slots; ++i) free_at.push(0.0);
  double end = 0.0;
  for (double t : cta_time) {
    const double start = free_at.top();
    free_at.pop();
    free_at.push(start + t);
    end = std::max(end, start + t);
  }
  return end;
}

TEST(TailSplit, CoversEveryStepOnce) {
  for (int slots : {1, 2, 7, 132}) {
    for (int64_t tiles : {1, 3, 66, 131, 132, 133, 136, 200, 2048, 4096}) {
      for (int steps : {1, 3, 8, 17, 64, 128, 256}) {
        const TailSplit s = tail_split(tiles, steps, slots);
        ASSERT_EQ(s.whole + s.tiles, tiles);
        ASSERT_GE(s.parts, 1);
        if (s.active()) {
          EXPECT_LE(s.tiles, slots);
          EXPECT_LE(s.parts, slots);
          EXPECT_GE(steps / s.parts, 4) << "parts keep min_part_steps";
          EXPECT_EQ(s.whole % slots, 0) << "whole rounds only";
        }
        std::vector<std::vector<int>> seen(tiles, std::vector<int>(steps, 0));
        for (int64_t c = 0; c < s.ctas(); ++c) {
          const TailWork w = tail_work(s, c, steps);
          ASSERT_GE(w.tile, 0);
          ASSERT_LT(w.tile, tiles);
          EXPECT_EQ(w.part >= 0, c >= s.whole && s.active());
          for (int i = w.begin; i < w.end; ++i) ++seen[w.tile][i];
        }
        for (int64_t t = 0; t < tiles; ++t)
          for (int i = 0; i < steps; ++i)
            ASSERT_EQ(seen[t][i], 1) << "tiles " << tiles << " steps " << steps << " slots " << slots << " tile " << t
                                     << " step " << i;
      }
    }
  }
}

// One round: every part resident at once (the Hopper forward's split).
TEST(TailSplit, OneRoundFitsTheSlots) {
  for (int64_t tiles : {133, 136, 200, 1376, 1408, 4096})
    for (int steps : {16, 64, 128, 256}) {
      const TailSplit s = tail_split(tiles, steps, 132, 8, 4, /*one_round=*/true);
      if (s.active()) EXPECT_LE(s.tiles * s.parts, 132) << tiles << " tiles, " << steps << " steps";
    }
  EXPECT_EQ(tail_split(1376, 128, 132, 8, 4, true).parts, 2);   // 56 tiles: two parts each
  EXPECT_FALSE(tail_split(1408, 64, 132, 8, 4, true).active());  // 88 tiles: one part each
  EXPECT_GT(tail_split(1376, 128, 132, 4, 4).parts, 2);          // several rounds of parts without it
}

TEST(TailSplit, NoSplitWhereRoundsAreWhole) {
  EXPECT_FALSE(tail_split(264, 128, 132).active());  // two whole rounds
  EXPECT_FALSE(tail_split(4096, 3, 132).active());   // too few steps to part
  EXPECT_FALSE(tail_split(4096, 128, 1).active());
  EXPECT_FALSE(tail_split(0, 128, 132).active());
}

// The flare backward's grids on a 132-SM H100/H200 (16k tokens, hidden 2048): d64 4,096 tiles of
// 128-row steps, d128 2,048 tiles; the split must shorten the grid by most of a round.
TEST(TailSplit, ShortensTheRaggedRound) {
  const int slots = 132, cost = 2;
  struct Case {
    int64_t tiles;
    int steps;
  };
  for (const Case c : {Case{4096, 32}, Case{4096, 64}, Case{4096, 128}, Case{2048, 64}, Case{2048, 128},
                       Case{2048, 256}, Case{133, 64}, Case{200, 40}, Case{66, 64}, Case{1, 256}}) {
    const TailSplit s = tail_split(c.tiles, c.steps, slots, cost);
    std::vector<double> whole(c.tiles, c.steps), split;
    for (int64_t i = 0; i < s.ctas(); ++i) {
      const TailWork w = tail_work(s, i, c.steps);
      split.push_back(w.end - w.begin + (w.part >= 0 ? cost : 0));
    }
    const double before = makespan(whole, slots), after = makespan(split, slots);
    EXPECT_LE(after, before) << c.tiles << " tiles of " << c.steps;
    const int64_t tail = c.tiles % slots;
    if (tail > 0 && tail <= slots / 2 && c.steps >= 32) {
      ASSERT_TRUE(s.active()) << c.tiles << " tiles of " << c.steps;
      // The ragged round: the tail's steps spread over the slots, plus at most a part's cost and share.
      EXPECT_LE(after - (before - c.steps), 0.6 * c.steps) << c.tiles << " tiles of " << c.steps;
    }
  }
}

TEST(PaddedShare, RowsPastTheEnd) {
  EXPECT_DOUBLE_EQ(padded_share(1024, 192), 128.0 / 1152);
  EXPECT_DOUBLE_EQ(padded_share(2048, 192), 64.0 / 2112);
  EXPECT_DOUBLE_EQ(padded_share(1, 128), 127.0 / 128);
  EXPECT_DOUBLE_EQ(padded_share(3072, 192), 0.0);
  EXPECT_DOUBLE_EQ(padded_share(1024, 128), 0.0);
  EXPECT_DOUBLE_EQ(padded_share(0, 128), 0.0);
}

}  // namespace
}  // namespace flare::sched
