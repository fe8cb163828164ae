// The key-group decode kernel's scheduling math (src/decode/decode_schedule.h) against brute
// force: the CTA layout fits the shared memory and feeds every warp, a walk's sub-tiles cover its
// keys exactly once and lie inside what the producer copied, a sub-tile never straddles a page,
// speculative stages stay inside the split and the cache, the heads-per-CTA rule, the arrival
// counters and the combine's warps per row; the key-group stage's 128-byte lines (cache_box_line).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "src/decode/decode_schedule.h"
#include "src/decode/decode_tensor_maps.h"

namespace flare::decode {
namespace {

constexpr int kMaxSmemPerBlock = 227 * 1024;  // H100: dynamic + static per block
constexpr int kStaticSmemAllowance = 2048;    // barriers and per-warp statistics (ptxas: ~1.2 KB)

std::vector<int> heads_options(int head_dim) {
  std::vector<int> h;
  for (int x = 1; x <= key_group_consumer_warps(head_dim); x *= 2) h.push_back(x);
  return h;
}

TEST(KeyGroupLayout, FitsTheSharedMemoryAndFeedsEveryWarp) {
  for (int head_dim : {64, 128, 256})
    for (int heads : heads_options(head_dim))
      for (int64_t max_keys : {int64_t{1}, int64_t{15}, int64_t{16}, int64_t{17}, int64_t{64}, int64_t{100},
                               int64_t{1000}, int64_t{65536}, int64_t{1} << 30}) {
        SCOPED_TRACE("d" + std::to_string(head_dim) + " heads " + std::to_string(heads) + " keys " +
                     std::to_string(max_keys));
        const KeyGroupLayout l = key_group_layout(head_dim, 2, heads, max_keys);
        EXPECT_EQ(l.consumer_warps, key_group_consumer_warps(head_dim));
        EXPECT_EQ(l.heads_per_cta * l.key_groups, l.consumer_warps);
        EXPECT_EQ(l.stage_keys, kSubTileKeys * l.key_groups);
        EXPECT_EQ(l.row_elems, heads * head_dim + kKeyGroupRowPad);
        EXPECT_EQ(l.stage_elems, 2 * l.stage_keys * l.row_elems);
        EXPECT_EQ(l.row_elems * 2 % 128, 0) << "rows are whole 128-byte lines (64-column TMA boxes)";
        EXPECT_GE(l.stages, 1);
        EXPECT_LE(l.stages, kKeyGroupMaxStages);
        const int stage_bytes = l.stage_elems * 2;
        EXPECT_EQ(stage_bytes % kKeyGroupSmemAlign, 0) << "every stage starts on a swizzle atom";
        EXPECT_EQ(l.stage_keys * l.row_elems / (head_dim / 64) * 2 % kKeyGroupSmemAlign, 0)
            << "so does every 64-column block of a stage's K or V";
        EXPECT_GE(l.smem_bytes, l.stages * stage_bytes + kKeyGroupSmemAlign);
        EXPECT_GE(l.smem_bytes, key_group_merge_bytes(head_dim));
        EXPECT_GE(key_group_merge_bytes(head_dim), key_group_combine_bytes(head_dim));
        EXPECT_LE(l.smem_bytes, kKeyGroupSmemBudget);
        EXPECT_LE(kKeyGroupSmemBudget + kStaticSmemAllowance, kMaxSmemPerBlock);
        // No more stages than the walk can fill; and a long walk gets the designed depth.
        const int64_t tiles = (max_keys + kSubTileKeys - 1) / kSubTileKeys;
        EXPECT_LE(l.stages, std::max<int64_t>(1, (tiles + l.key_groups - 1) / l.key_groups));
        if (max_keys >= 65536) EXPECT_GE(l.stages, 3);
      }
}

// Stage i of a walk holds keys [begin + i SK, begin + (i + 1) SK) (copied below the end); key
// group g computes its 16 keys from begin + i SK + 16 g. Every key of the walk is computed by
// exactly one (stage, group), every sub-tile that starts below the end reads only copied rows or
// rows past the end (zeroed / masked by the kernel), and no issued stage starts at or past the end.
TEST(KeyGroupWalk, SubTilesCoverTheKeysOnceInsideTheCopiedStages) {
  for (int key_groups : {1, 2, 4, 8})
    for (int walk_begin : {0, 16, 64, 4096, 1000 * 16})
      for (int length = 1; length <= 700; ++length) {
        const int kv_end = walk_begin + length;
        const int num_tiles = (kv_end - walk_begin + kSubTileKeys - 1) / kSubTileKeys;
        const int stage_keys = kSubTileKeys * key_groups;
        const int stages = key_group_walk_stages(num_tiles, key_groups);
        std::vector<int> seen(static_cast<size_t>(length), 0);
        for (int i = 0; i < stages; ++i) {
          const int stage0 = key_group_stage_key0(walk_begin, i, stage_keys);
          ASSERT_LT(stage0, kv_end) << "an empty stage was issued";
          const int copied_end = stage0 + std::min(stage_keys, kv_end - stage0);
          for (int g = 0; g < key_groups; ++g) {
            const int k0 = key_group_sub_tile_key0(walk_begin, i, stage_keys, g);
            EXPECT_EQ(k0 % kSubTileKeys, walk_begin % kSubTileKeys);
            if (k0 >= kv_end) continue;  // not visible: the kernel skips it
            EXPECT_GE(k0, stage0);
            EXPECT_LE(k0 + kSubTileKeys, stage0 + stage_keys);
            for (int k = k0; k < k0 + kSubTileKeys && k < kv_end; ++k) {
              EXPECT_LT(k, copied_end);
              ++seen[static_cast<size_t>(k - walk_begin)];
            }
          }
        }
        for (int k = 0; k < length; ++k)
          ASSERT_EQ(seen[static_cast<size_t>(k)], 1)
              << "key " << walk_begin + k << " groups " << key_groups << " end " << kv_end;
      }
}

// Walks start at multiples of 16 (key_range's tile_begin), so a sub-tile lies in one page of any
// page size the planner allows (powers of two >= 16): the producer reads one page id per sub-tile.
TEST(KeyGroupWalk, ASubTileNeverStraddlesAPage) {
  for (int page_shift = 4; page_shift <= 10; ++page_shift)
    for (int key_groups : {1, 2, 4, 8})
      for (int walk_begin = 0; walk_begin < 4096; walk_begin += 16)
        for (int i = 0; i < 4; ++i)
          for (int g = 0; g < key_groups; ++g) {
            const int k0 = key_group_sub_tile_key0(walk_begin, i, kSubTileKeys * key_groups, g);
            ASSERT_EQ(k0 >> page_shift, (k0 + kSubTileKeys - 1) >> page_shift);
          }
}

// Speculative stages copy keys [split_begin, split_begin + n SK) below min(split end, capacity):
// inside the cache and the split, at most `stages`, none empty; and they are the walk's first
// stages whenever the split holds keys (the walk then starts at split_begin).
TEST(KeyGroupWalk, SpeculativeStagesStayInsideTheSplitAndTheCache) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 20000; ++trial) {
    const int key_groups = 1 << (rng() % 4);
    const int stage_keys = kSubTileKeys * key_groups;
    const int stages = 1 + static_cast<int>(rng() % kKeyGroupMaxStages);
    const int64_t capacity = 1 + rng() % 5000;
    const int64_t chunk = 64 * (1 + rng() % 40);
    const int64_t split_begin = chunk * (rng() % 8);
    const bool speculate = rng() % 4 != 0;
    const int n = key_group_speculative_stages(speculate, split_begin, split_begin + chunk, capacity, stage_keys, stages);
    if (!speculate || split_begin >= capacity) {
      EXPECT_EQ(n, 0);
      continue;
    }
    const int64_t cap = std::min(split_begin + chunk, capacity);
    EXPECT_GE(n, 1);
    EXPECT_LE(n, stages);
    EXPECT_LT(split_begin + int64_t{n - 1} * stage_keys, cap) << "an empty speculative stage";
    if (n < stages) EXPECT_GE(split_begin + int64_t{n} * stage_keys, cap) << "fewer stages than the split fills";
    // The walk of any sequence length L that leaves the split non-empty starts at split_begin.
    for (int64_t L : {split_begin + 1, cap, capacity}) {
      if (L <= split_begin) continue;
      const int64_t kv_end = std::min(split_begin + chunk, L);
      const int tiles = static_cast<int>((kv_end - split_begin + kSubTileKeys - 1) / kSubTileKeys);
      const int walk = key_group_walk_stages(tiles, key_groups);
      for (int i = 0; i < std::min(n, walk); ++i)
        EXPECT_EQ(key_group_stage_key0(static_cast<int>(split_begin), i, stage_keys),
                  split_begin + int64_t{i} * stage_keys);
    }
  }
}

TEST(KeyGroupHeads, MaximumIsTheWidestPowerOfTwoDividingHeadsKv) {
  EXPECT_EQ(key_group_max_heads_per_cta(128, 8), 8);
  EXPECT_EQ(key_group_max_heads_per_cta(64, 16), 8);
  EXPECT_EQ(key_group_max_heads_per_cta(256, 8), 4);
  EXPECT_EQ(key_group_max_heads_per_cta(128, 6), 2);
  EXPECT_EQ(key_group_max_heads_per_cta(128, 12), 4);
  EXPECT_EQ(key_group_max_heads_per_cta(128, 1), 1);
  EXPECT_EQ(key_group_max_heads_per_cta(128, 5), 1);
}

TEST(KeyGroupHeads, ExplicitValuesAreKeptAndTheRuleFillsHalfTheSms) {
  // Explicit: kept, capped at the maximum.
  EXPECT_EQ(key_group_heads_per_cta(2, 8, 1, 8, 16, 132), 2);
  EXPECT_EQ(key_group_heads_per_cta(8, 4, 1, 8, 16, 132), 4);
  // The rule, brute force: the widest h = max, max/2, ... whose grid reaches half the SMs, else 1.
  for (int max_heads : {1, 2, 4, 8})
    for (int64_t batch : {1, 2, 3, 8, 64})
      for (int splits : {1, 2, 7, 16, 64, 128}) {
        const int heads_kv = 8;
        int want = 1;
        for (int h = max_heads; h >= 1; h /= 2)
          if (batch * (heads_kv / h) * splits >= 66) {
            want = h;
            break;
          }
        EXPECT_EQ(key_group_heads_per_cta(0, max_heads, batch, heads_kv, splits, 132), want)
            << max_heads << " " << batch << " " << splits;
      }
  // Issue 7's batch 1 (8 KV heads): 16 splits run one head per CTA (128 CTAs of 8 warps).
  EXPECT_EQ(key_group_heads_per_cta(0, 8, 1, 8, 16, 132), 1);
  EXPECT_EQ(key_group_heads_per_cta(0, 8, 8, 8, 16, 132), 8);
}

TEST(KeyGroupCounters, OnePerSequenceAndHeadBlockInsideTheWorkspace) {
  for (int heads_kv : {1, 2, 8, 16})
    for (int heads = 1; heads <= 8 && heads <= heads_kv; heads *= 2) {
      if (heads_kv % heads != 0) continue;
      std::set<int64_t> used;
      const int batch = 5;
      for (int b = 0; b < batch; ++b)
        for (int hb = 0; hb < heads_kv / heads; ++hb) {
          const int64_t c = key_group_counter_index(b, heads_kv, hb);
          EXPECT_GE(c, 0);
          EXPECT_LT(c, int64_t{batch} * heads_kv);  // the planner's [batch, heads_kv] counters
          EXPECT_TRUE(used.insert(c).second);
        }
    }
}

// The arrival protocol, simulated: counters start at 0, each split's CTA adds 1 in any order, the
// one that reads num_splits - 1 merges and resets. Exactly one merger per call, after every split
// arrived, and the counter is 0 again for the next call (CUDA-graph replays).
TEST(KeyGroupCounters, ExactlyOneLastArriverAndTheCounterReturnsToZero) {
  std::mt19937 rng(11);
  int counter = 0;
  for (int call = 0; call < 2000; ++call) {
    const int splits = 2 + static_cast<int>(rng() % 127);
    std::vector<int> order(static_cast<size_t>(splits));
    for (int s = 0; s < splits; ++s) order[static_cast<size_t>(s)] = s;
    std::shuffle(order.begin(), order.end(), rng);
    int mergers = 0, arrived = 0;
    for (int s : order) {
      (void)s;
      const int old = counter++;
      ++arrived;
      if (old == splits - 1) {
        ++mergers;
        EXPECT_EQ(arrived, splits) << "merged before every split arrived";
        counter = 0;
      }
    }
    ASSERT_EQ(mergers, 1);
    ASSERT_EQ(counter, 0);
  }
}

TEST(KeyGroupCombine, WarpsPerRowCoverTheWarpsAndRows) {
  for (int warps : {4, 8})
    for (int rows = 1; rows <= 128; ++rows) {
      const int wpr = combine_warps_per_row(warps, rows);
      EXPECT_GE(wpr, 1);
      EXPECT_EQ(wpr & (wpr - 1), 0) << "a power of two";
      EXPECT_EQ(warps % wpr, 0);
      EXPECT_TRUE(wpr * rows <= warps || wpr == 1);
      EXPECT_TRUE(2 * wpr * rows > warps) << "the widest that fits";
    }
  EXPECT_EQ(combine_warps_per_row(8, 4), 2);  // batch 1, 4 query heads per KV head, 1 head per CTA
  EXPECT_EQ(combine_warps_per_row(8, 1), 8);
  EXPECT_EQ(combine_warps_per_row(8, 32), 1);
}

// The line of each (sub-tile, key, head) of column block cb in the layout the kernel runs at
// heads_per_cta heads a CTA (head-major from 2 heads: cache_boxes_head_major), boxes of box_tokens.
int kernel_line(int head_dim, int sub, int key, int head, int heads_per_cta, int box_tokens, int cb) {
  const int cbs = cache_box_col_blocks(head_dim);
  const int stage_keys = key_group_layout(head_dim, 2, heads_per_cta, 65536).stage_keys;
  const int box_subs = box_tokens / kCacheBoxTokens;
  const int line0 = cache_boxes_head_major(heads_per_cta)
                        ? cache_box_line<true>(sub, key, head, heads_per_cta, cbs, box_subs)
                        : cache_box_line<false>(sub, key, head, heads_per_cta, cbs, box_subs);
  return line0 + cb * cache_col_block_lines(heads_per_cta, stage_keys, box_subs);
}

// A stage's K lines (every column block) are a permutation of [0, stage lines); a box (a sub-tile,
// or the whole stage: cache_box_tokens) fills its own lines (row boxes: box_tokens x heads_per_cta
// x d / 64 lines, each column block box_tokens x heads_per_cta of them; per column block boxes:
// box_tokens x heads_per_cta lines of each column block's region); and the 8 keys an ldmatrix reads
// (keys 0-7 or 8-15 of one head of one sub-tile, one column block) lie in 8 distinct 128-byte
// swizzle phases (line % 8), so they hit 8 bank groups.
TEST(CacheBoxLines, EightKeysOfAnLdmatrixTakeEightSwizzlePhases) {
  for (int head_dim : {64, 128, 256})
    for (int heads : heads_options(head_dim))
      for (bool contiguous : {false, true}) {
        const int key_groups = key_group_consumer_warps(head_dim) / heads, cbs = head_dim / kCacheBoxCols;
        const int stage_keys = key_groups * kCacheBoxTokens, box_tokens = cache_box_tokens(contiguous, stage_keys);
        SCOPED_TRACE("d" + std::to_string(head_dim) + " heads " + std::to_string(heads) + " box tokens " +
                     std::to_string(box_tokens));
        ASSERT_EQ(stage_keys % box_tokens, 0);
        ASSERT_LE(box_tokens, 256);  // a TMA box dimension
        const int box_lines = box_tokens * heads * cache_box_col_blocks(head_dim);
        const int lines = stage_keys * heads * cbs;
        std::vector<int> seen(lines, 0);
        for (int sub = 0; sub < key_groups; ++sub)
          for (int head = 0; head < heads; ++head)
            for (int cb = 0; cb < cbs; ++cb) {
              for (int key = 0; key < kCacheBoxTokens; ++key) {
                const int line = kernel_line(head_dim, sub, key, head, heads, box_tokens, cb);
                ASSERT_GE(line, 0);
                ASSERT_LT(line, lines);
                // the box that loads this line: the one holding token sub x 16 + key
                const int box = kCacheRowBoxes ? line / box_lines : (line % (lines / cbs)) / box_lines;
                EXPECT_EQ(box, (sub * kCacheBoxTokens + key) / box_tokens) << "key " << key << " cb " << cb;
                ++seen[line];
              }
              for (int first : {0, 8}) {
                std::set<int> phases;
                for (int key = first; key < first + 8; ++key)
                  phases.insert(kernel_line(head_dim, sub, key, head, heads, box_tokens, cb) % 8);
                EXPECT_EQ(phases.size(), 8u) << "sub-tile " << sub << " head " << head << " keys " << first << "+";
              }
            }
        EXPECT_EQ(std::count(seen.begin(), seen.end(), 1), lines);
      }
  // One head a CTA: both orders give the same lines (the token-major kernel serves it).
  for (int sub = 0; sub < 8; ++sub)
    for (int key = 0; key < kCacheBoxTokens; ++key)
      for (int box_subs : {1, 8})
        EXPECT_EQ(cache_box_line<true>(sub, key, 0, 1, 2, box_subs),
                  cache_box_line<false>(sub, key, 0, 1, 2, box_subs));
  // What the head-major order fixes: token-major lines put 8 heads' keys in one phase.
  std::set<int> token_major;
  for (int key = 0; key < 8; ++key) token_major.insert(cache_box_line<false>(0, key, 3, 8, 2) % 8);
  EXPECT_EQ(token_major.size(), 1u);
}

// The boxes' L2 promotion: 256 bytes for walks of up to kCacheMapShortWalkKeys keys (the row's other
// half comes along for the next column block's box), 128 beyond (256 cost long walks 5-7 %).
TEST(CacheMapL2Promotion, WholeRowsForShortWalksLinesForLongOnes) {
  if (FLARE_DECODE_MAP_L2_PROMOTION_BYTES >= 0)
    GTEST_SKIP() << "promotion forced by FLARE_DECODE_MAP_L2_PROMOTION_BYTES";
  for (int64_t keys : {int64_t{1}, int64_t{16}, int64_t{512}, kCacheMapShortWalkKeys})
    EXPECT_EQ(cache_map_l2_promotion_bytes(keys), 256) << keys;
  for (int64_t keys : {kCacheMapShortWalkKeys + 1, int64_t{4096}, int64_t{65536}, int64_t{1} << 31})
    EXPECT_EQ(cache_map_l2_promotion_bytes(keys), 128) << keys;
  EXPECT_EQ(cache_map_l2_promotion(256), CU_TENSOR_MAP_L2_PROMOTION_L2_256B);
  EXPECT_EQ(cache_map_l2_promotion(128), CU_TENSOR_MAP_L2_PROMOTION_L2_128B);
  EXPECT_EQ(cache_map_l2_promotion(0), CU_TENSOR_MAP_L2_PROMOTION_NONE);
}

}  // namespace
}  // namespace flare::decode
