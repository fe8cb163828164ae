// Mask arithmetic against brute force over many small shapes and bands.
#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "reference/attention_ref.h"
#include "src/scheduling/mask_math.h"

namespace flare::sched {
namespace {

struct Case {
  bool causal;
  int left, right;
};
const Case kCases[] = {{false, -1, -1}, {true, -1, -1}, {false, 3, 2}, {true, 5, -1},
                       {false, 0, 0},   {false, -1, 4}, {false, 7, -1}, {true, 0, 0}};

TEST(Band, VisibleMatchesOracle) {
  for (const Case& c : kCases)
    for (int sq : {1, 5, 13})
      for (int sk : {1, 6, 13, 20}) {
        Band band = Band::make(c.causal, c.left, c.right, sq, sk);
        MaskParams m{c.causal, c.left, c.right};
        for (int i = 0; i < sq; ++i) {
          int lo = sk, hi = 0;
          for (int j = 0; j < sk; ++j) {
            bool v = ref::dense_visible(m, i, j, sq, sk);
            ASSERT_EQ(band.visible(i, j), v) << sq << " " << sk << " " << i << " " << j;
            if (v) lo = std::min(lo, j), hi = std::max(hi, j + 1);
          }
          if (lo < hi) {
            EXPECT_EQ(band.row_lo(i), lo);
            EXPECT_EQ(band.row_hi(i, sk), hi);
          } else {
            EXPECT_GE(band.row_lo(i), band.row_hi(i, sk));
          }
        }
      }
}

// The rows that see a key, from a base row and within a limit, as the backward's key rows test them.
TEST(Band, KeyRowsMatchVisible) {
  for (const Case& c : kCases)
    for (int sq : {1, 5, 13, 40})
      for (int sk : {1, 6, 13, 20, 37}) {
        const Band band = Band::make(c.causal, c.left, c.right, sq, sk);
        for (int base : {0, 3, 8, 16})
          for (int limit : {4, 8, 16})
            for (int j = 0; j < sk; ++j) {
              const Band::RowSpan span = band.key_rows(j, base, limit);
              for (int r = 0; r < limit; ++r)
                ASSERT_EQ(span.contains(r), band.visible(base + r, j))
                    << sq << " " << sk << " base " << base << " limit " << limit << " key " << j << " row " << r;
            }
      }
}

// A tile of rows [t0, t1) walks its key blocks from the last down; each warpgroup-sized slice of
// its rows passes the leading blocks that are empty for it: every passed block is empty for every
// row of the slice, the next block is not (unless all are), and one block always stays.
TEST(Band, LeadingEmptyBlocksMatchBruteForce) {
  int passed = 0;  // slices that pass at least one block: the sweep reaches the case it is for
  for (const Case& c : kCases)
    for (int sq : {1, 7, 16, 33, 50})
      for (int sk : {1, 9, 16, 40, 64})
        for (int bt : {4, 12})      // tile rows
          for (int bw : {1, 2, 4})  // slices of the tile
            for (int bk : {1, 4, 16}) {
              const Band band = Band::make(c.causal, c.left, c.right, sq, sk);
              for (int t0 = 0; t0 < sq; t0 += bt) {
                const int t1 = std::min(sq, t0 + bt);
                const BlockRange range = kv_block_range(band, t0, t1, sk, bk);
                const int blocks = range.last - range.first;
                for (int w0 = t0; w0 < t1; w0 += bt / bw) {
                  const int w1 = std::min(t1, w0 + bt / bw);
                  auto empty = [&](int n) {
                    for (int i = w0; i < w1; ++i)
                      for (int j = n * bk; j < std::min(sk, (n + 1) * bk); ++j)
                        if (band.visible(i, j)) return false;
                    return true;
                  };
                  int want = 0;
                  while (want < blocks && empty(range.last - 1 - want)) ++want;
                  if (blocks > 0 && want == blocks) want = blocks - 1;
                  passed += want > 0;
                  EXPECT_EQ(leading_empty_blocks(band, range, w0, w1, sk, bk), want)
                      << "sq=" << sq << " sk=" << sk << " tile " << t0 << "-" << t1 << " rows " << w0 << "-" << w1
                      << " bk=" << bk << " causal=" << c.causal << " l=" << c.left << " r=" << c.right;
                }
              }
            }
  EXPECT_GT(passed, 100);
}

// The shifted row tiles cover the sequence exactly once, the shift is below a tile, and where it
// is not zero (causal-like bands) the tiles' walks (kv_block_range of their rows) add up to no more
// key blocks than unshifted tiles do; other bands keep 0.
TEST(Band, RowTileShiftCoversTheRowsAndShortensCausalWalks) {
  auto walked = [](const Band& band, int sq, int sk, int rows, int bk, int shift) {
    long long blocks = 0;
    for (int m = 0; m * rows < sq; ++m) {
      const int r0 = std::max(0, m * rows - shift), r1 = std::min(sq, (m + 1) * rows - shift);
      const BlockRange r = kv_block_range(band, r0, r1, sk, bk);
      blocks += std::max(0, r.last - r.first);
    }
    return blocks;
  };
  int shifted = 0;
  for (const Case& c : kCases)
    for (int sq : {1, 5, 64, 100, 191, 192, 193, 1000, 1024})
      for (int sk : {1, 64, 200, 1024, 1500})
        for (int rows : {64, 128, 192}) {
          const Band band = Band::make(c.causal, c.left, c.right, sq, sk);
          const int shift = row_tile_shift(band, sq, rows);
          ASSERT_GE(shift, 0);
          ASSERT_LT(shift, rows);
          const bool grows = band.right < kUnbounded && band.left >= kUnbounded;
          if (!grows) EXPECT_EQ(shift, 0) << "l=" << c.left << " r=" << c.right;
          std::vector<int> seen(sq, 0);
          for (int m = 0; m * rows < sq; ++m)
            for (int i = m * rows - shift; i < (m + 1) * rows - shift; ++i)
              if (i >= 0 && i < sq) ++seen[i];
          for (int i = 0; i < sq; ++i) ASSERT_EQ(seen[i], 1) << "row " << i << " sq=" << sq << " rows=" << rows;
          EXPECT_LE(walked(band, sq, sk, rows, 128, shift), walked(band, sq, sk, rows, 128, 0))
              << "sq=" << sq << " sk=" << sk << " rows=" << rows << " causal=" << c.causal << " r=" << c.right;
          shifted += shift > 0;
        }
  EXPECT_GT(shifted, 50);
  // The case it is for: 1024 causal rows in tiles of 192 over key blocks of 128.
  const Band causal = Band::make(true, -1, -1, 1024, 1024);
  EXPECT_EQ(row_tile_shift(causal, 1024, 192), 128);
  EXPECT_EQ(walked(causal, 1024, 1024, 192, 128, 0), 32);
  EXPECT_EQ(walked(causal, 1024, 1024, 192, 128, 128), 27);
}

TEST(Band, TileClassificationAndBlockRangesMatchBruteForce) {
  for (const Case& c : kCases)
    for (int sq : {1, 7, 16, 33})
      for (int sk : {1, 9, 16, 40})
        for (int bq : {1, 4, 8})
          for (int bk : {1, 4, 16}) {
            Band band = Band::make(c.causal, c.left, c.right, sq, sk);
            for (int r0 = 0; r0 < sq; r0 += bq) {
              int r1 = std::min(sq, r0 + bq);
              int first = -1, last = -1;
              for (int c0 = 0; c0 < sk; c0 += bk) {
                int vis = 0, all = 0;
                for (int i = r0; i < r1; ++i)
                  for (int j = c0; j < c0 + bk; ++j) vis += j < sk && band.visible(i, j), ++all;
                TileKind want = vis == 0 ? TileKind::kEmpty : vis == all ? TileKind::kFull : TileKind::kPartial;
                ASSERT_EQ(classify_tile(band, r0, r1, c0, c0 + bk, sk), want)
                    << "sq=" << sq << " sk=" << sk << " rows " << r0 << " cols " << c0 << " causal=" << c.causal
                    << " l=" << c.left << " r=" << c.right;
                if (vis) {
                  if (first < 0) first = c0 / bk;
                  last = c0 / bk + 1;
                }
              }
              // The FULL blocks as one range, past the sequence's blocks too (never FULL there), for
              // the clipped rows and for a whole block of rows running past the sequence (as a
              // kernel's last row tile asks).
              for (int rows_end : {r1, r0 + bq}) {
                const BlockRange full = full_kv_blocks(band, r0, rows_end, sk, bk);
                for (int n = 0; n * bk < sk + 2 * bk; ++n)
                  ASSERT_EQ(n >= full.first && n < full.last,
                            classify_tile(band, r0, rows_end, n * bk, (n + 1) * bk, sk) == TileKind::kFull)
                      << "sq=" << sq << " sk=" << sk << " rows " << r0 << "-" << rows_end << " block " << n
                      << " causal=" << c.causal << " l=" << c.left << " r=" << c.right;
              }
              BlockRange r = kv_block_range(band, r0, r1, sk, bk);
              if (first < 0) {
                EXPECT_GE(r.first, r.last);
              } else {
                EXPECT_EQ(r.first, first);
                EXPECT_EQ(r.last, last);
              }
            }
            // The FULL row tiles of each key block, for every first row (past the sequence too).
            for (int c0 = 0; c0 < sk + bk; c0 += bk) {
              const RowSpan span = full_row_tiles(band, c0, c0 + bk, sk, bq);
              for (int q0 = 0; q0 < sq + bq; ++q0)
                ASSERT_EQ(span.contains(q0), classify_tile(band, q0, q0 + bq, c0, c0 + bk, sk) == TileKind::kFull)
                    << "sq=" << sq << " sk=" << sk << " rows " << q0 << "+" << bq << " cols " << c0 << "+" << bk
                    << " causal=" << c.causal << " l=" << c.left << " r=" << c.right;
            }
            // The transposed range: q blocks that see each key block.
            for (int c0 = 0; c0 < sk; c0 += bk) {
              int c1 = std::min(sk, c0 + bk);
              int first = -1, last = -1;
              for (int r0 = 0; r0 < sq; r0 += bq) {
                bool any = false;
                for (int i = r0; i < std::min(sq, r0 + bq); ++i)
                  for (int j = c0; j < c1; ++j) any |= band.visible(i, j);
                if (any) {
                  if (first < 0) first = r0 / bq;
                  last = r0 / bq + 1;
                }
              }
              BlockRange r = q_block_range(band, c0, c1, sq, bq);
              if (first < 0) {
                EXPECT_GE(r.first, r.last);
              } else {
                EXPECT_EQ(r.first, first) << "cols " << c0;
                EXPECT_EQ(r.last, last) << "cols " << c0;
              }
            }
          }
}

}  // namespace
}  // namespace flare::sched
