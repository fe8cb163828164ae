// The backward workspace layouts: the portable one (dQ in 8 x 8 blocks, sequences 8-row aligned),
// and the Hopper kernel's padded row statistics and dQ tiles (sequences 64-row aligned, tiles in
// thread order).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <set>
#include <vector>

#include "src/attention/bwd_params.h"
#include "src/attention/hopper/bwd_config.h"
#include "src/attention/hopper/bwd_dq_replicas.h"

namespace flare::detail {
namespace {

// Every sequence's rows [start, start + ceil(len / tile) * tile) start `align`-aligned, are disjoint
// and inside the padded rows (start_of, rows_of: a layout's padded_start and padded_rows).
template <typename StartOf, typename RowsOf>
void expect_sequences_fit(const std::vector<int>& lens, int align, int tile, StartOf start_of, RowsOf rows_of) {
  const int batch = static_cast<int>(lens.size());
  int64_t q_start = 0, prev_end = 0, total = 0;
  for (int len : lens) total += len;
  const int64_t rows = rows_of(total, batch);
  for (int b = 0; b < batch; ++b) {
    const int64_t start = start_of(q_start, b);
    const int64_t end = start + (lens[b] + tile - 1) / tile * tile;
    EXPECT_EQ(start % align, 0) << "sequence " << b;
    EXPECT_GE(start, prev_end) << "sequence " << b << " overlaps the one before";
    EXPECT_LE(end, rows) << "sequence " << b << " past the padded rows";
    prev_end = std::max(prev_end, end);
    q_start += lens[b];
  }
}

// Random varlen batches (1-40 sequences, a quarter of them empty or one or two rows long).
template <typename F>
void for_random_batches(unsigned seed, F&& f) {
  std::mt19937 rng(seed);
  for (int trial = 0; trial < 2000; ++trial) {
    std::vector<int> lens(1 + rng() % 40);
    for (int& l : lens) l = rng() % 4 == 0 ? static_cast<int>(rng() % 3) : static_cast<int>(rng() % 700);
    f(lens);
  }
}

// The Hopper dQ tiles: 64-row tiles, 64-aligned, for batched (q_start = b * seqlen) and random
// varlen batches with empty and one-row sequences.
void expect_disjoint_tiles(const std::vector<int>& lens) {
  expect_sequences_fit(lens, kRowStatsBlockM, kRowStatsBlockM, hopper_dq_padded_start, hopper_dq_padded_rows);
}

TEST(HopperDqLayout, SequencesAreAlignedDisjointAndFit) {
  expect_disjoint_tiles({4096, 4096, 4096, 4096});
  expect_disjoint_tiles({1000, 1000, 1000});
  expect_disjoint_tiles({0, 1, 17, 130, 1, 257});
  expect_disjoint_tiles({63, 64, 65, 0, 0, 127, 128, 129});
  for_random_batches(7, expect_disjoint_tiles);
}

// The portable dQ accumulator: every sequence's rows [start, start + len) start 8-aligned, are
// disjoint and inside portable_dq_padded_rows.
void expect_portable_rows_fit(const std::vector<int>& lens) {
  expect_sequences_fit(lens, 8, 1, portable_dq_padded_start, portable_dq_padded_rows);
}

TEST(PortableDqLayout, SequencesAreAlignedDisjointAndFit) {
  expect_portable_rows_fit({4096, 4096, 4096, 4096});
  expect_portable_rows_fit({0, 1, 17, 130, 1, 257});
  expect_portable_rows_fit({7, 8, 9, 0, 0, 15, 16, 17});
  for_random_batches(11, expect_portable_rows_fit);
}

TEST(PortableDqLayout, BlocksAreAPermutationAndFragmentsContiguous) {
  for (int head_dim : {8, 64, 80, 128, 256}) {
    const int heads = 3, rows = 24;
    const int64_t size = int64_t{rows} * heads * head_dim;
    std::vector<char> seen(size, 0);
    for (int r = 0; r < rows; ++r)
      for (int h = 0; h < heads; ++h)
        for (int c = 0; c < head_dim; ++c) {
          const int64_t at = portable_dq_offset(r, h, c, heads, head_dim);
          ASSERT_GE(at, 0);
          ASSERT_LT(at, size);
          ASSERT_FALSE(seen[at]) << "offset " << at << " taken twice (head dim " << head_dim << ")";
          seen[at] = 1;
        }
    // An MMA fragment's reduction (lane (g, t): row 8 j + g, columns 8 k + 2 t, + 1) covers 64
    // contiguous floats, lane by lane: what bwd_add_dq's single base pointer relies on, with the
    // next column group 64 floats on and the next row group heads * head_dim * 8.
    for (int j = 0; j < rows / 8; ++j)
      for (int k = 0; k < head_dim / 8; ++k) {
        const int64_t base = portable_dq_offset(8 * j, 1, 8 * k, heads, head_dim);
        for (int lane = 0; lane < 32; ++lane) {
          const int g = lane / 4, t = lane % 4;
          EXPECT_EQ(portable_dq_offset(8 * j + g, 1, 8 * k + 2 * t, heads, head_dim), base + 2 * lane);
          EXPECT_EQ(portable_dq_offset(8 * j + g, 1, 8 * k + 2 * t + 1, heads, head_dim), base + 2 * lane + 1);
        }
        EXPECT_EQ(portable_dq_offset(8 * j, 1, 8 * k, heads, head_dim),
                  portable_dq_offset(8 * j, 1, 0, heads, head_dim) + 64 * k);
        if (j > 0)
          EXPECT_EQ(base, portable_dq_offset(8 * (j - 1), 1, 8 * k, heads, head_dim) + int64_t{heads} * head_dim * 8);
      }
  }
}

TEST(BwdWorkspace, PortableDqHoldsThePaddedRows) {
  AttentionShape s;
  s.batch = 6, s.heads = 4, s.heads_kv = 2, s.head_dim = 80;
  s.seqlen_q = 257, s.seqlen_k = 300, s.varlen = true, s.total_q = 406, s.total_k = 475;
  const BwdWorkspaceLayout l = bwd_workspace_layout(s, 64, 128, true);
  EXPECT_GE(l.dk_accum - l.dq_accum,
            static_cast<std::size_t>(portable_dq_padded_rows(406, 6)) * 4 * 80 * sizeof(float));
}

// 128-row steps (d64): warpgroup w's dQ fragment fills the tile of the step's 64-row block w, and
// the two tiles together are a permutation of the step's 128 rows.
TEST(HopperDqLayout, RowHalvesFillOneTileAWarpgroup) {
  using Cfg = hopper::HopperBwdConfig<64, 2, 128>;
  static_assert(Cfg::kDqRowHalves && Cfg::kRowBlocks == 2, "the 128-row tiling");
  const int tile = kRowStatsBlockM * 64, per_thread = 2 * tile / 256;
  std::set<int> seen;
  for (int ct = 0; ct < 256; ++ct)
    for (int i = 0; i < per_thread; ++i) {
      const int at = Cfg::dq_tile_offset(ct, i - i % 4) + i % 4;
      ASSERT_GE(at, (ct / 128) * tile) << "thread " << ct;
      ASSERT_LT(at, (ct / 128 + 1) * tile) << "thread " << ct;
      ASSERT_TRUE(seen.insert(at).second) << "offset " << at << " taken twice";
    }
  EXPECT_EQ(static_cast<int>(seen.size()), 2 * tile);
}

// The Hopper kernel's 64-row blocks per sequence are an even count (a 128-row step reads the
// statistics of two blocks and takes the first one's semaphore), and the workspace holds them.
TEST(BwdWorkspace, HopperRowBlocksAreEvenAndHeld) {
  for (int seqlen : {1, 63, 64, 65, 127, 128, 129, 1000, 4096}) {
    const int blocks = hopper_row_blocks(seqlen);
    EXPECT_EQ(blocks % 2, 0) << seqlen;
    EXPECT_GE(int64_t{blocks} * kRowStatsBlockM, seqlen);
    EXPECT_LT(int64_t{blocks} * kRowStatsBlockM, seqlen + 2 * kRowStatsBlockM);
    AttentionShape s;
    s.batch = 3, s.heads = 4, s.heads_kv = 4, s.head_dim = 64;
    s.seqlen_q = seqlen, s.seqlen_k = 200, s.total_q = 3 * seqlen, s.total_k = 600;
    const BwdWorkspaceLayout l = bwd_workspace_layout(s, kRowStatsBlockM, 128, true, 64, 1);
    const std::size_t per_head = static_cast<std::size_t>(blocks);
    EXPECT_GE(l.dq_accum - l.row_stats, 3 * 4 * per_head * 2 * kRowStatsBlockM * sizeof(float)) << seqlen;
    EXPECT_GE(l.dkv_semaphore - l.dq_semaphore, 3 * 4 * per_head * sizeof(int)) << seqlen;
  }
}

TEST(HopperDqLayout, TileOrderIsAPermutationOfTheTile) {
  for (int head_dim : {64, 96, 128}) {
    const int threads = 256, tile = kRowStatsBlockM * head_dim, per_thread = tile / threads;
    std::set<int> seen;
    for (int ct = 0; ct < threads; ++ct)
      for (int i = 0; i < per_thread; ++i) {
        const int at = hopper_dq_tile_offset(threads, ct, i - i % 4) + i % 4;
        ASSERT_GE(at, 0);
        ASSERT_LT(at, tile);
        ASSERT_TRUE(seen.insert(at).second) << "offset " << at << " taken twice (head dim " << head_dim << ")";
      }
    EXPECT_EQ(static_cast<int>(seen.size()), tile);
    // A warp's 16-byte stores of one group are 512 contiguous bytes.
    for (int lane = 0; lane < 32; ++lane) EXPECT_EQ(hopper_dq_tile_offset(threads, lane, 4), (threads + lane) * 4);
  }
}

TEST(BwdWorkspace, HopperLayoutSizesItsRegions) {
  AttentionShape s;
  s.batch = 6, s.heads = 4, s.heads_kv = 2, s.head_dim = 80;
  s.seqlen_q = 257, s.seqlen_k = 300, s.varlen = true, s.total_q = 406, s.total_k = 475;
  const BwdWorkspaceLayout portable = bwd_workspace_layout(s, 64, 128, true);
  const BwdWorkspaceLayout hopper = bwd_workspace_layout(s, 64, 128, true, /*hopper_head_dim=*/96);
  EXPECT_EQ(portable.row_stats, 0u);
  EXPECT_EQ(portable.hopper_head_dim, 0);
  EXPECT_EQ(hopper.hopper_head_dim, 96);
  const std::size_t m_blocks = (257 + 63) / 64;
  EXPECT_GE(hopper.dq_accum - hopper.row_stats, std::size_t{6} * 4 * m_blocks * 2 * 64 * sizeof(float));
  const std::size_t dq_bytes = static_cast<std::size_t>(hopper_dq_padded_rows(406, 6)) * 4 * 96 * sizeof(float);
  EXPECT_GE(hopper.dk_accum - hopper.dq_accum, dq_bytes);
  for (std::size_t off : {hopper.row_stats, hopper.dq_accum, hopper.dk_accum, hopper.dq_semaphore})
    EXPECT_EQ(off % 256, 0u);
  EXPECT_LT(hopper.dpsum, hopper.row_stats);
  EXPECT_LE(hopper.dkv_semaphore, hopper.total);
}

// The deterministic dense grid's dQ accumulator copies: each copy of dq_accum and of the dQ
// semaphores has the one-copy size and they lie end to end before the next region; the ordinary
// mode keeps one.
TEST(BwdWorkspace, DqReplicasAreWholeCopies) {
  AttentionShape s;
  s.batch = 3, s.heads = 4, s.heads_kv = 2, s.head_dim = 256;
  s.seqlen_q = 1000, s.seqlen_k = 1000, s.total_q = 3000, s.total_k = 3000;
  const BwdWorkspaceLayout one = bwd_workspace_layout(s, 64, 64, true, 256, 2);
  const BwdWorkspaceLayout two = bwd_workspace_layout(s, 64, 64, true, 256, 2, 0, 0, 0, 2);
  const BwdWorkspaceLayout ordinary = bwd_workspace_layout(s, 64, 64, false, 256, 2, 0, 0, 0, 2);
  EXPECT_EQ(one.dq_replicas, 1);
  EXPECT_EQ(two.dq_replicas, 2);
  EXPECT_EQ(ordinary.dq_replicas, 1);
  EXPECT_EQ(two.dq_replica_floats, one.dq_replica_floats);
  EXPECT_EQ(one.dq_replica_floats, static_cast<std::size_t>(hopper_dq_padded_rows(3000, 3)) * 4 * 256);
  EXPECT_EQ(two.dq_replica_semaphores, one.dq_replica_semaphores);
  EXPECT_EQ(one.dq_replica_semaphores, std::size_t{3} * 4 * hopper_row_blocks(1000) * 2);
  EXPECT_GE(two.dk_accum - two.dq_accum, 2 * two.dq_replica_floats * sizeof(float));
  EXPECT_GE(two.dkv_semaphore - two.dq_semaphore, 2 * two.dq_replica_semaphores * sizeof(int));
  EXPECT_EQ(ordinary.total, bwd_workspace_layout(s, 64, 64, false, 256, 2).total);
}

// Only the deterministic Hopper dense backward stores its first turns and leaves dq_accum unzeroed;
// everything after dq_accum (GQA's dK/dV accumulators, the semaphores) stays zeroed.
TEST(BwdWorkspace, DqAccumLeftUnzeroedOnlyWhereFirstTurnsStore) {
  AttentionShape s;
  s.batch = 2, s.heads = 8, s.heads_kv = 2, s.head_dim = 128;
  s.seqlen_q = 700, s.seqlen_k = 900, s.total_q = 1400, s.total_k = 1800;
  for (int replicas : {1, 2}) {
    const BwdWorkspaceLayout det = bwd_workspace_layout(s, 128, 128, true, 128, 1, 0, 0, 0, replicas);
    EXPECT_TRUE(det.dq_first_stores);
    EXPECT_EQ(det.zero_from, det.dk_accum);
    EXPECT_GE(det.zero_from, det.dq_accum + replicas * det.dq_replica_floats * sizeof(float));
    EXPECT_LT(det.zero_from, det.dq_semaphore);
  }
  const BwdWorkspaceLayout ordinary = bwd_workspace_layout(s, 128, 128, false, 128, 1);
  const BwdWorkspaceLayout sparse = bwd_workspace_layout(s, 128, 128, true, 128, 1, 12, 8);
  const BwdWorkspaceLayout portable = bwd_workspace_layout(s, 64, 64, true);
  for (const BwdWorkspaceLayout& l : {ordinary, sparse, portable}) {
    EXPECT_FALSE(l.dq_first_stores);
    EXPECT_EQ(l.zero_from, l.dq_accum);
  }
}

// The measured rule (bwd_dq_replicas.h): two copies for d256 up to 16k keys, causal up to 8k; one
// elsewhere.
TEST(BwdWorkspace, DqReplicasWhereTheyWon) {
  using hopper::hopper_bwd_dq_replicas;
  for (int keys : {1, 1024, 4096, 8192, 16384}) EXPECT_EQ(hopper_bwd_dq_replicas(256, keys, false), 2) << keys;
  for (int keys : {16385, 32768}) EXPECT_EQ(hopper_bwd_dq_replicas(256, keys, false), 1) << keys;
  for (int keys : {1, 1024, 4096, 8192}) EXPECT_EQ(hopper_bwd_dq_replicas(256, keys, true), 2) << keys;
  for (int keys : {8193, 16384}) EXPECT_EQ(hopper_bwd_dq_replicas(256, keys, true), 1) << keys;
  for (bool causal : {false, true}) {
    for (int keys : {1000, 4096, 16384}) EXPECT_EQ(hopper_bwd_dq_replicas(128, keys, causal), 1) << keys;
    for (int keys : {1000, 4096, 8192, 65536}) EXPECT_EQ(hopper_bwd_dq_replicas(64, keys, causal), 1) << keys;
  }
}

}  // namespace
}  // namespace flare::detail
