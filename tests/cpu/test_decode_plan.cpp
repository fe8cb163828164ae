// The decode planner: the heuristic's properties and its agreement with a brute-force search, the
// split layout the kernels will rely on, the tuning table's classes and file format, and the
// planner's purity (no allocation, no device).
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <initializer_list>
#include <new>
#include <set>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "flare/decode_plan.h"
#include "reference/host_tensor.h"

// Every heap allocation of the process is counted, so a test can show a call allocates nothing.
namespace {
std::atomic<long> g_heap_allocations{0};
}  // namespace

void* operator new(std::size_t bytes) {
  g_heap_allocations.fetch_add(1, std::memory_order_relaxed);
  if (void* p = std::malloc(bytes == 0 ? 1 : bytes)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }

namespace flare {
namespace {

constexpr int kH100Sms = 132;

// The benchmark shape: heads_q 32 over heads_kv 8, head dim 128, bf16, one new token.
DecodeShapeKey bench_key(int batch, int64_t max_cache_len, int page_size = 0) {
  DecodeShapeKey k;
  k.batch = batch;
  k.heads_q = 32;
  k.heads_kv = 8;
  k.head_dim = 128;
  k.q_len = 1;
  k.max_cache_len = max_cache_len;
  k.page_size = page_size;
  return k;
}

DecodePlan plan_or_fail(const DecodeShapeKey& key, const DecodeTuningTable* table = nullptr,
                        int num_sms = kH100Sms) {
  DecodePlan plan;
  Status s = decode_plan(key, table, num_sms, &plan);
  EXPECT_TRUE(s.ok()) << s.message();
  return plan;
}

// ---------------------------------------------------------------------------------------------
// An independent statement of the rules in decode_plan.h, written for clarity, not speed.

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

int expected_kv_align(const DecodeShapeKey& k) { return std::max(k.page_size, kDecodeKvAlign); }

int64_t expected_span(const DecodeShapeKey& k) {
  if (k.window_left < 0) return k.max_cache_len;
  return std::min<int64_t>(k.max_cache_len, int64_t{k.window_left} + k.q_len + expected_kv_align(k) - 1);
}

int fitted_split_count(const DecodeShapeKey& k, int requested) {
  const int64_t span = expected_span(k), align = expected_kv_align(k);
  const int64_t chunk = ceil_div(ceil_div(span, requested), align) * align;
  return static_cast<int>(ceil_div(span, chunk));
}

// Every fitted split count a tuner may try: splits averaging >= kDecodeKvAlign keys, the grid
// within kDecodeMaxWaves waves.
std::set<int> brute_force_candidates(const DecodeShapeKey& k, int num_sms) {
  std::set<int> counts;
  const int64_t ctas_per_split = int64_t{k.batch} * k.heads_kv;
  for (int requested = 1; requested <= kMaxDecodeSplits; ++requested) {
    const int s = fitted_split_count(k, requested);
    const bool enough_keys = expected_span(k) >= int64_t{s} * kDecodeKvAlign;
    const bool few_waves = ctas_per_split * s <= int64_t{kDecodeMaxWaves} * num_sms;
    if (s == 1 || (enough_keys && few_waves)) counts.insert(s);
  }
  return counts;
}

int brute_force_heuristic(const DecodeShapeKey& k, int num_sms) {
  const int64_t ctas_per_split = int64_t{k.batch} * k.heads_kv;
  std::vector<int> eligible;
  for (int s : brute_force_candidates(k, num_sms))
    if (s == 1 || expected_span(k) >= int64_t{s} * kDecodeMinKvPerSplit) eligible.push_back(s);
  const int slots = std::max(1, num_sms / 2);  // half the SMs: the key-group engine's grids
  double best = 0;
  for (int s : eligible) best = std::max(best, decode_wave_efficiency(ctas_per_split * s, slots));
  for (int s : eligible)  // ascending: the fewest splits within the slack
    if (decode_wave_efficiency(ctas_per_split * s, slots) >= best - kDecodeWaveEfficiencySlack) return s;
  return 0;
}

// The layout facts the kernels rely on, for any plan of `key`.
void expect_consistent_plan(const DecodePlan& p, const DecodeShapeKey& key) {
  SCOPED_TRACE("batch " + std::to_string(key.batch) + ", max_cache_len " + std::to_string(key.max_cache_len) +
               ", page_size " + std::to_string(key.page_size) + ", window_left " + std::to_string(key.window_left) +
               ", q_len " + std::to_string(key.q_len));
  EXPECT_EQ(p.shape, key);
  ASSERT_GE(p.num_splits, 1);
  ASSERT_LE(p.num_splits, kMaxDecodeSplits);
  EXPECT_EQ(p.kernel == DecodeKernel::kStandard, p.num_splits == 1);

  EXPECT_EQ(p.kv_align, expected_kv_align(key));
  EXPECT_EQ(p.kv_chunk % p.kv_align, 0);
  if (key.paged()) {
    EXPECT_EQ(p.kv_align % key.page_size, 0);
  }
  // The splits cover the span from the origin, and the last one starts inside it (none empty).
  const int64_t span = expected_span(key);
  EXPECT_GE(int64_t{p.num_splits} * p.kv_chunk, span);
  EXPECT_LT(int64_t{p.num_splits - 1} * p.kv_chunk, span);

  // partial_out, partial_lse, then one int32 arrival counter per (sequence, KV head) at a 16-byte
  // boundary.
  const std::size_t partial_rows = std::size_t(key.batch) * key.heads_q * key.q_len * p.num_splits;
  const std::size_t lse_bytes = partial_rows * sizeof(float), padded_lse_bytes = (lse_bytes + 15) / 16 * 16;
  const std::size_t counter_bytes = std::size_t(key.batch) * key.heads_kv * sizeof(int32_t);
  const std::size_t expected_workspace =
      p.num_splits == 1 ? 0 : partial_rows * key.head_dim * sizeof(float) + padded_lse_bytes + counter_bytes;
  EXPECT_EQ(p.workspace_bytes, expected_workspace);
  EXPECT_EQ(p.partial_lse_offset, p.num_splits == 1 ? 0 : partial_rows * key.head_dim * sizeof(float));
  EXPECT_EQ(p.partial_lse_offset % 256, 0u);
  EXPECT_EQ(p.counters_offset, p.num_splits == 1 ? 0 : p.partial_lse_offset + padded_lse_bytes);
  EXPECT_EQ(p.counters_offset % 16, 0u);
  EXPECT_EQ(p.engine, DecodeEngine::kKeyGroups);
  EXPECT_EQ(p.combine, DecodeCombine::kCluster);

  Status s = check_decode_plan(p, key);
  EXPECT_TRUE(s.ok()) << s.message();
}

// ---------------------------------------------------------------------------------------------
// Heuristic

TEST(DecodeHeuristic, OneSequenceWithALongCacheIsSplit) {
  for (int64_t cache_len : {4096, 16384, 65536, 1 << 20}) {
    const DecodePlan p = plan_or_fail(bench_key(1, cache_len));
    EXPECT_EQ(p.kernel, DecodeKernel::kSplitKv) << cache_len;
    EXPECT_EQ(p.source, DecodePlanSource::kHeuristic);
    // 8 CTAs unsplit on 132 SMs (66 slots): splitting into 8 fills 64 of the slots.
    EXPECT_EQ(p.num_splits, 8) << cache_len;
  }
}

TEST(DecodeHeuristic, LargeBatchesUseTheStandardKernel) {
  for (int batch : {16, 32, 64, 128, 256})
    for (int64_t cache_len : {1024, 8192, 65536}) {
      const DecodePlan p = plan_or_fail(bench_key(batch, cache_len));
      EXPECT_EQ(p.kernel, DecodeKernel::kStandard) << "batch " << batch << ", cache " << cache_len;
      EXPECT_EQ(p.workspace_bytes, 0u);
    }
}

TEST(DecodeHeuristic, CachesUnderTwoMinimumSplitsAreNotSplit) {
  for (int64_t cache_len = 1; cache_len < 2 * kDecodeMinKvPerSplit; cache_len += 17)
    EXPECT_EQ(plan_or_fail(bench_key(1, cache_len)).num_splits, 1) << cache_len;
  EXPECT_EQ(plan_or_fail(bench_key(1, 2 * kDecodeMinKvPerSplit)).num_splits, 2);
}

TEST(DecodeHeuristic, SplitsAverageTheMinimumKeys) {
  for (int64_t cache_len : {512, 600, 1000, 1024, 3000, 4096})
    for (int batch : {1, 2, 4}) {
      const DecodePlan p = plan_or_fail(bench_key(batch, cache_len));
      if (p.num_splits > 1) {
        EXPECT_GE(cache_len, int64_t{p.num_splits} * kDecodeMinKvPerSplit) << cache_len;
      }
    }
}

// The examples printed in decode_plan.h, so the documentation cannot drift from the code.
TEST(DecodeHeuristic, DocumentedExamples) {
  struct Example {
    int batch;
    int64_t cache_len;
    int num_splits, kv_chunk;
  };
  for (const Example& e : {Example{1, 1024, 4, 256}, Example{1, 4096, 8, 512}, Example{1, 65536, 8, 8192},
                           Example{8, 4096, 1, 4096}, Example{64, 65536, 1, 65536}, Example{8, 511, 1, 512}}) {
    const DecodePlan p = plan_or_fail(bench_key(e.batch, e.cache_len));
    EXPECT_EQ(p.num_splits, e.num_splits) << "batch " << e.batch << ", cache " << e.cache_len;
    EXPECT_EQ(p.kv_chunk, e.kv_chunk) << "batch " << e.batch << ", cache " << e.cache_len;
  }
  const int slots = decode_heuristic_slots(kH100Sms);
  EXPECT_EQ(slots, 66);
  EXPECT_NEAR(decode_wave_efficiency(8 * 8, slots), 0.97, 0.005);
  EXPECT_NEAR(decode_wave_efficiency(8 * 4, slots), 0.48, 0.005);
  EXPECT_NEAR(decode_wave_efficiency(64, slots), 0.97, 0.005);
  EXPECT_NEAR(decode_wave_efficiency(512, slots), 0.97, 0.005);
  EXPECT_EQ(decode_heuristic_slots(1), 1);
  EXPECT_EQ(decode_heuristic_slots(0), 1);
}

TEST(DecodeHeuristic, WaveEfficiency) {
  EXPECT_DOUBLE_EQ(decode_wave_efficiency(132, 132), 1.0);
  EXPECT_DOUBLE_EQ(decode_wave_efficiency(66, 132), 0.5);
  EXPECT_DOUBLE_EQ(decode_wave_efficiency(133, 132), 133.0 / 264.0);
  EXPECT_DOUBLE_EQ(decode_wave_efficiency(0, 132), 0.0);
  EXPECT_DOUBLE_EQ(decode_wave_efficiency(5, 0), 0.0);
}

// The planner against the rule stated plainly, over a grid of shapes and devices.
TEST(DecodeHeuristic, MatchesBruteForceSearch) {
  struct Heads {
    int q, kv;
  };
  int checked = 0;
  for (Heads heads : {Heads{32, 8}, Heads{8, 1}, Heads{16, 16}})
    for (int batch : {1, 2, 3, 5, 8, 17, 33, 64})
      for (int64_t cache_len : {1, 15, 16, 17, 255, 256, 511, 512, 1000, 4095, 4096, 12345, 65536, 1 << 20})
        for (int page_size : {0, 16, 64, 256})
          for (int window_left : {-1, 0, 100, 4095})
            for (int num_sms : {1, 108, 132}) {
              DecodeShapeKey key = bench_key(batch, cache_len, page_size);
              key.heads_q = heads.q;
              key.heads_kv = heads.kv;
              key.window_left = window_left;
              key.q_len = batch % 2 == 0 ? 4 : 1;
              const DecodePlan p = plan_or_fail(key, nullptr, num_sms);
              ASSERT_EQ(p.num_splits, brute_force_heuristic(key, num_sms))
                  << "batch " << batch << ", heads " << heads.q << "/" << heads.kv << ", cache " << cache_len
                  << ", page " << page_size << ", window " << window_left << ", sms " << num_sms;
              expect_consistent_plan(p, key);
              ++checked;
            }
  EXPECT_EQ(checked, 3 * 8 * 14 * 4 * 4 * 3);
}

// ---------------------------------------------------------------------------------------------
// Split layout

// Without a window, at the maximum cache length split i covers [i * kv_chunk, (i + 1) * kv_chunk)
// clipped to the cache: none may be empty, and together they cover every key.
TEST(DecodeSplits, NoSplitIsEmptyAtTheMaxCacheLength) {
  for (int64_t cache_len : {1, 63, 64, 65, 255, 257, 1000, 4095, 4097, 65536, 65537})
    for (int requested = 1; requested <= kMaxDecodeSplits; requested += 7) {
      DecodePlan p;
      ASSERT_TRUE(decode_plan_for_splits(bench_key(1, cache_len), requested, &p).ok());
      EXPECT_LE(p.num_splits, requested);
      int64_t covered = 0;
      for (int i = 0; i < p.num_splits; ++i) {
        const int64_t begin = int64_t{i} * p.kv_chunk, end = std::min<int64_t>(begin + p.kv_chunk, cache_len);
        EXPECT_LT(begin, end) << "split " << i << " of " << p.num_splits << " is empty, cache " << cache_len;
        covered += end - begin;
      }
      EXPECT_EQ(covered, cache_len);
    }
}

// With a window, the kernels start the splits at the span's first key rounded down to kv_align.
// For every cache length, the splits reach the end of the span and start on kv_align boundaries.
TEST(DecodeSplits, WindowedSplitsCoverTheSpanAtEveryLength) {
  for (int window_left : {0, 17, 100, 4095})
    for (int page_size : {0, 16, 256})
      for (int q_len : {1, 8}) {
        DecodeShapeKey key = bench_key(1, 8192, page_size);
        key.window_left = window_left;
        key.q_len = q_len;
        const DecodePlan p = plan_or_fail(key);
        expect_consistent_plan(p, key);
        for (int64_t len = q_len; len <= key.max_cache_len; len += 13) {
          const int64_t span_begin = std::max<int64_t>(0, len - q_len - window_left);
          const int64_t origin = span_begin / p.kv_align * p.kv_align;
          EXPECT_GE(origin + int64_t{p.num_splits} * p.kv_chunk, len)
              << "window " << window_left << ", page " << page_size << ", q_len " << q_len << ", len " << len;
        }
      }
}

TEST(DecodeSplits, PagedChunksArePageAligned) {
  for (int page_size : {16, 32, 64, 128, 256, 1024})
    for (int64_t pages : {1, 3, 64, 4096}) {
      const DecodeShapeKey key = bench_key(1, pages * page_size, page_size);
      for (const DecodePlan& p : decode_candidates(key, kH100Sms)) {
        EXPECT_EQ(p.kv_chunk % page_size, 0) << "page " << page_size << ", pages " << pages;
        EXPECT_EQ(p.kv_align, std::max(page_size, kDecodeKvAlign));
      }
    }
}

TEST(DecodeSplits, WorkspaceSizeFormula) {
  DecodeShapeKey key = bench_key(2, 4096);
  key.q_len = 2;
  DecodePlan p;
  ASSERT_TRUE(decode_plan_for_splits(key, 4, &p).ok());
  EXPECT_EQ(p.kernel, DecodeKernel::kSplitKv);
  EXPECT_EQ(p.num_splits, 4);
  EXPECT_EQ(p.kv_chunk, 1024);
  // partial_out fp32 [2, 32, 2, 4, 128], then partial_lse fp32 [2, 32, 2, 4], then the counters
  // int32 [2, 8].
  EXPECT_EQ(p.partial_lse_offset, 2u * 32 * 2 * 4 * 128 * 4);
  EXPECT_EQ(p.counters_offset, 2u * 32 * 2 * 4 * 128 * 4 + 2u * 32 * 2 * 4 * 4);
  EXPECT_EQ(p.workspace_bytes, 2u * 32 * 2 * 4 * 128 * 4 + 2u * 32 * 2 * 4 * 4 + 2u * 8 * 4);
  EXPECT_EQ(p.workspace_bytes, 264256u);
  // partial_lse bytes not a multiple of 16: the counters start at the next 16-byte boundary.
  DecodeShapeKey odd = key;
  odd.batch = 1;
  odd.heads_q = 8;
  odd.heads_kv = 8;
  odd.q_len = 1;
  ASSERT_TRUE(decode_plan_for_splits(odd, 3, &p).ok());
  EXPECT_EQ(p.num_splits, 3);
  EXPECT_EQ(p.partial_lse_offset, 8u * 3 * 128 * 4);
  EXPECT_EQ(p.counters_offset, 8u * 3 * 128 * 4 + 96);  // 24 floats: 96 bytes
  odd.heads_q = 1;
  odd.heads_kv = 1;
  ASSERT_TRUE(decode_plan_for_splits(odd, 3, &p).ok());
  EXPECT_EQ(p.counters_offset, 3u * 128 * 4 + 16);  // 3 floats padded to 16 bytes
  EXPECT_EQ(p.workspace_bytes, 3u * 128 * 4 + 16 + 4);

  ASSERT_TRUE(decode_plan_for_splits(key, 1, &p).ok());
  EXPECT_EQ(p.kernel, DecodeKernel::kStandard);
  EXPECT_EQ(p.workspace_bytes, 0u);
  EXPECT_EQ(p.kv_chunk, 4096);
}

TEST(DecodeSplits, ForcedSplitCountsAreFittedToTheCache) {
  DecodePlan p;
  ASSERT_TRUE(decode_plan_for_splits(bench_key(1, 1000), 128, &p).ok());
  EXPECT_EQ(p.kv_chunk, kDecodeKvAlign);
  EXPECT_EQ(p.num_splits, 16);  // ceil(1000 / 64)
  EXPECT_EQ(p.source, DecodePlanSource::kForced);
  ASSERT_TRUE(decode_plan_for_splits(bench_key(1, 17), 4, &p).ok());
  EXPECT_EQ(p.kernel, DecodeKernel::kStandard);  // 17 keys fit one 64-key chunk
  // A fitted count asked for again gives the same plan: tuners and tables can store it.
  for (int requested = 1; requested <= kMaxDecodeSplits; ++requested) {
    DecodePlan first, again;
    ASSERT_TRUE(decode_plan_for_splits(bench_key(1, 12345), requested, &first).ok());
    ASSERT_TRUE(decode_plan_for_splits(bench_key(1, 12345), first.num_splits, &again).ok());
    EXPECT_EQ(again.kv_chunk, first.kv_chunk) << requested;
    EXPECT_EQ(again.num_splits, first.num_splits) << requested;
  }
}

// ---------------------------------------------------------------------------------------------
// Candidates

TEST(DecodeCandidates, StandardFirstThenDistinctSplitCounts) {
  for (int batch : {1, 8, 64})
    for (int64_t cache_len : {100, 4096, 65536})
      for (int page_size : {0, 64}) {
        const DecodeShapeKey key = bench_key(batch, cache_len, page_size);
        const std::vector<DecodePlan> candidates = decode_candidates(key, kH100Sms);
        ASSERT_FALSE(candidates.empty());
        EXPECT_EQ(candidates.front().kernel, DecodeKernel::kStandard);
        std::set<int> counts;
        for (size_t i = 0; i < candidates.size(); ++i) {
          expect_consistent_plan(candidates[i], key);
          if (i > 0) {
            EXPECT_GT(candidates[i].num_splits, candidates[i - 1].num_splits);
          }
          counts.insert(candidates[i].num_splits);
        }
        EXPECT_EQ(counts, brute_force_candidates(key, kH100Sms));
        EXPECT_EQ(counts.count(plan_or_fail(key).num_splits), 1u) << "the heuristic's choice is a candidate";
      }
}

TEST(DecodeCandidates, LongCacheOfOneSequenceReachesTheMaximumSplits) {
  const std::vector<DecodePlan> candidates = decode_candidates(bench_key(1, 65536), kH100Sms);
  EXPECT_EQ(candidates.back().num_splits, kMaxDecodeSplits);
  EXPECT_GT(candidates.size(), 30u);
}

TEST(DecodeCandidates, GridStaysWithinTheWaveLimit) {
  for (const DecodePlan& p : decode_candidates(bench_key(64, 65536), kH100Sms))
    EXPECT_LE(64 * 8 * p.num_splits, kDecodeMaxWaves * kH100Sms) << p.num_splits;
}

TEST(DecodeCandidates, InvalidInputsGiveNone) {
  EXPECT_TRUE(decode_candidates(bench_key(0, 4096), kH100Sms).empty());
  EXPECT_TRUE(decode_candidates(bench_key(1, 4096), 0).empty());
  EXPECT_TRUE(decode_candidates_with_heads_per_cta(bench_key(0, 4096), kH100Sms).empty());
}

// The tuner's set: every split-count candidate with every valid explicit heads_per_cta, widest first.
TEST(DecodeCandidates, WithHeadsPerCtaCrossesSplitCountsAndHeadBlocks) {
  struct Case {
    int heads_q, heads_kv, head_dim;
    std::vector<int> heads;
  };
  const Case cases[] = {{32, 8, 128, {8, 4, 2, 1}}, {32, 8, 256, {4, 2, 1}}, {12, 6, 64, {2, 1}}, {5, 1, 128, {1}},
                        {64, 16, 128, {8, 4, 2, 1}}};
  for (const Case& c : cases) {
    DecodeShapeKey key = bench_key(2, 8192);
    key.heads_q = c.heads_q;
    key.heads_kv = c.heads_kv;
    key.head_dim = c.head_dim;
    const std::vector<DecodePlan> splits = decode_candidates(key, kH100Sms);
    const std::vector<DecodePlan> crossed = decode_candidates_with_heads_per_cta(key, kH100Sms);
    ASSERT_EQ(crossed.size(), splits.size() * c.heads.size());
    for (size_t i = 0; i < crossed.size(); ++i) {
      const DecodePlan& p = crossed[i];
      expect_consistent_plan(p, key);
      EXPECT_EQ(p.num_splits, splits[i / c.heads.size()].num_splits);
      EXPECT_EQ(p.kv_chunk, splits[i / c.heads.size()].kv_chunk);
      EXPECT_EQ(p.heads_per_cta, c.heads[i % c.heads.size()]);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Validation and purity

void expect_key_rejected(const DecodeShapeKey& key, const std::string& field) {
  DecodePlan plan;
  Status s = decode_plan(key, nullptr, kH100Sms, &plan);
  ASSERT_FALSE(s.ok()) << "accepted; expected an error about " << field;
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("'" + field + "'"), std::string::npos) << s.message();
}

TEST(DecodePlanValidation, RejectsInvalidKeysNamingTheField) {
  DecodeShapeKey k = bench_key(1, 4096);
  auto with = [&](auto edit) {
    DecodeShapeKey bad = k;
    edit(bad);
    return bad;
  };
  expect_key_rejected(with([](DecodeShapeKey& b) { b.batch = 0; }), "key.batch");
  expect_key_rejected(with([](DecodeShapeKey& b) { b.heads_q = 0; }), "key.heads_q");
  expect_key_rejected(with([](DecodeShapeKey& b) { b.heads_kv = 5; }), "key.heads_kv");
  expect_key_rejected(with([](DecodeShapeKey& b) { b.head_dim = 96; }), "key.head_dim");
  expect_key_rejected(with([](DecodeShapeKey& b) { b.q_len = 9; }), "key.q_len");
  expect_key_rejected(with([](DecodeShapeKey& b) { b.q_len = 0; }), "key.q_len");
  expect_key_rejected(with([](DecodeShapeKey& b) { b.max_cache_len = 0; }), "key.max_cache_len");
  expect_key_rejected(with([](DecodeShapeKey& b) { b.max_cache_len = (int64_t{1} << 30) + 1; }),
                      "key.max_cache_len");
  expect_key_rejected(with([](DecodeShapeKey& b) { b.page_size = 8; }), "key.page_size");
  expect_key_rejected(with([](DecodeShapeKey& b) { b.page_size = 48; }), "key.page_size");
  expect_key_rejected(with([](DecodeShapeKey& b) { b.window_left = -2; }), "key.window_left");
  expect_key_rejected(with([](DecodeShapeKey& b) { b.dtype = DType::kFloat32; }), "key.dtype");

  DecodePlan plan;
  Status s = decode_plan(k, nullptr, 0, &plan);
  EXPECT_NE(s.message().find("'num_sms'"), std::string::npos) << s.message();
  for (int bad_splits : {0, kMaxDecodeSplits + 1}) {
    s = decode_plan_for_splits(k, bad_splits, &plan);
    EXPECT_NE(s.message().find("'num_splits'"), std::string::npos) << s.message();
  }
}

// The plan is a pure function of (key, table, num_sms): the SM count is an argument rather than
// a device query, this binary links no CUDA runtime (so the planner cannot call one), and a plan
// is a trivially copyable value that can be kept across CUDA-graph replays. Planning must also
// allocate nothing, so it can sit on a decode step's hot path.
TEST(DecodePlanPurity, PlansAllocateNothingAndRepeat) {
  static_assert(std::is_trivially_copyable_v<DecodePlan>);
  DecodeTuningTable table;
  ASSERT_TRUE(table.insert(bench_key(8, 4096), {DecodeKernel::kSplitKv, 4}).ok());
  const std::vector<DecodeShapeKey> keys = {bench_key(1, 65536), bench_key(8, 4096), bench_key(64, 300),
                                            bench_key(3, 1 << 20, 16)};
  std::vector<DecodePlan> first(keys.size()), second(keys.size());

  const long before = g_heap_allocations.load();
  for (size_t i = 0; i < keys.size(); ++i) {
    Status a = decode_plan(keys[i], nullptr, kH100Sms, &first[i]);
    Status b = decode_plan(keys[i], &table, kH100Sms, &second[i]);  // a hit for keys[1], misses else
    Status c = check_decode_plan(first[i], keys[i]);
    if (!a.ok() || !b.ok() || !c.ok()) ADD_FAILURE() << "planning failed for key " << i;
  }
  EXPECT_EQ(g_heap_allocations.load() - before, 0) << "planning allocated";

  for (size_t i = 0; i < keys.size(); ++i) {
    EXPECT_EQ(second[i].source, i == 1 ? DecodePlanSource::kTuningTable : DecodePlanSource::kHeuristic);
    if (i != 1) {
      EXPECT_EQ(std::memcmp(&first[i], &second[i], sizeof(DecodePlan)), 0) << i;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// From params, and back to the run

TEST(DecodeShapeKeyFromParams, ContiguousAndPaged) {
  using ref::HostTensor;
  HostTensor q{DType::kBFloat16, {2, 2, 8, 64}}, out{DType::kBFloat16, {2, 2, 8, 64}},
      k{DType::kBFloat16, {2, 100, 2, 64}}, v{DType::kBFloat16, {2, 100, 2, 64}}, seqlens{DType::kInt32, {2}};
  seqlens.set(0, 10);
  seqlens.set(1, 100);
  DecodeParams p;
  p.q = q;
  p.k_cache = k;
  p.v_cache = v;
  p.cache_seqlens = seqlens;
  p.out = out;
  p.window_left = 32;

  DecodeShapeKey key;
  Status s = decode_shape_key(p, &key);
  ASSERT_TRUE(s.ok()) << s.message();
  DecodeShapeKey expected;
  expected.batch = 2;
  expected.q_len = 2;
  expected.heads_q = 8;
  expected.heads_kv = 2;
  expected.head_dim = 64;
  expected.max_cache_len = 100;
  expected.page_size = 0;
  expected.window_left = 32;
  expected.dtype = DType::kBFloat16;
  EXPECT_EQ(key, expected);

  HostTensor pk{DType::kBFloat16, {8, 16, 2, 64}}, pv{DType::kBFloat16, {8, 16, 2, 64}},
      page_table{DType::kInt32, {2, 4}};
  for (int i = 0; i < 8; ++i) page_table.set(i, i);
  p.k_cache = pk;
  p.v_cache = pv;
  p.page_table = page_table;
  seqlens.set(1, 64);
  s = decode_shape_key(p, &key);
  ASSERT_TRUE(s.ok()) << s.message();
  EXPECT_EQ(key.page_size, 16);
  EXPECT_EQ(key.max_cache_len, 4 * 16);

  seqlens.set(1, 65);  // beyond the pages: validation's error comes through
  s = decode_shape_key(p, &key);
  EXPECT_NE(s.message().find("'cache_seqlens'"), std::string::npos) << s.message();
}

TEST(CheckDecodePlan, RejectsPlansForOtherShapesOrEdited) {
  const DecodeShapeKey key = bench_key(1, 65536);
  const DecodePlan plan = plan_or_fail(key);
  EXPECT_TRUE(check_decode_plan(plan, key).ok());

  DecodeShapeKey other = key;
  other.batch = 2;
  Status s = check_decode_plan(plan, other);
  EXPECT_NE(s.message().find("'plan'"), std::string::npos) << s.message();
  other = key;
  other.page_size = 16;
  EXPECT_FALSE(check_decode_plan(plan, other).ok());

  DecodePlan edited = plan;
  edited.kv_chunk /= 2;
  EXPECT_FALSE(check_decode_plan(edited, key).ok());
  edited = plan;
  edited.workspace_bytes -= 4;
  EXPECT_FALSE(check_decode_plan(edited, key).ok());
  edited = plan;
  edited.kernel = DecodeKernel::kStandard;
  EXPECT_FALSE(check_decode_plan(edited, key).ok());
  edited = plan;
  edited.counters_offset += 16;
  EXPECT_FALSE(check_decode_plan(edited, key).ok());

  // How it runs may be edited, to valid values only.
  for (DecodeEngine e : {DecodeEngine::kKeyGroups, DecodeEngine::kHeadWarps, DecodeEngine::kPortable})
    for (DecodeCombine c : {DecodeCombine::kInKernel, DecodeCombine::kSeparateKernel, DecodeCombine::kInKernelPrezeroed,
                            DecodeCombine::kCluster})
      for (int h : {0, 1, 2, 4, 8}) {
        edited = plan;
        edited.engine = e;
        edited.combine = c;
        edited.heads_per_cta = h;
        s = check_decode_plan(edited, key);
        EXPECT_TRUE(s.ok()) << s.message();
      }
  for (int h : {-1, 3, 16}) {
    edited = plan;
    edited.heads_per_cta = h;
    s = check_decode_plan(edited, key);
    EXPECT_NE(s.message().find("heads_per_cta"), std::string::npos) << h << ": " << s.message();
  }
  DecodeShapeKey wide = key;
  wide.head_dim = 256;  // at most 4 heads per CTA
  DecodePlan wide_plan = plan_or_fail(wide);
  wide_plan.heads_per_cta = 8;
  EXPECT_FALSE(check_decode_plan(wide_plan, wide).ok());
  wide_plan.heads_per_cta = 4;
  EXPECT_TRUE(check_decode_plan(wide_plan, wide).ok());
  edited = plan;
  edited.engine = static_cast<DecodeEngine>(7);
  EXPECT_FALSE(check_decode_plan(edited, key).ok());
  edited = plan;
  edited.combine = static_cast<DecodeCombine>(7);
  EXPECT_FALSE(check_decode_plan(edited, key).ok());
}

TEST(DecodePlanNames, EnginesAndCombines) {
  EXPECT_STREQ(decode_engine_name(DecodeEngine::kKeyGroups), "key_groups");
  EXPECT_STREQ(decode_engine_name(DecodeEngine::kHeadWarps), "head_warps");
  EXPECT_STREQ(decode_engine_name(DecodeEngine::kPortable), "portable");
  EXPECT_STREQ(decode_combine_name(DecodeCombine::kInKernel), "in_kernel");
  EXPECT_STREQ(decode_combine_name(DecodeCombine::kSeparateKernel), "separate_kernel");
  EXPECT_STREQ(decode_combine_name(DecodeCombine::kInKernelPrezeroed), "in_kernel_prezeroed");
  EXPECT_STREQ(decode_combine_name(DecodeCombine::kCluster), "cluster");
}

// ---------------------------------------------------------------------------------------------
// Tuning table

TEST(DecodeTuningTable, NearbyShapesShareAClass) {
  DecodeTuningTable table;
  const DecodeShapeKey tuned = bench_key(4, 4096);
  ASSERT_TRUE(table.insert(tuned, {DecodeKernel::kSplitKv, 8}).ok());
  EXPECT_EQ(table.size(), 1u);

  auto hits = [&](const DecodeShapeKey& k) { return table.lookup(k).has_value(); };
  for (int batch : {4, 5, 7})
    for (int64_t cache_len : {4096, 5000, 8191}) EXPECT_TRUE(hits(bench_key(batch, cache_len))) << batch << " " << cache_len;
  EXPECT_FALSE(hits(bench_key(3, 4096)));
  EXPECT_FALSE(hits(bench_key(8, 4096)));
  EXPECT_FALSE(hits(bench_key(4, 4095)));
  EXPECT_FALSE(hits(bench_key(4, 8192)));

  DecodeShapeKey k = tuned;
  k.dtype = DType::kFloat16;  // same bytes, same class
  EXPECT_TRUE(hits(k));
  k = tuned;
  k.heads_q = 64;  // group 8 instead of 4
  EXPECT_FALSE(hits(k));
  k = tuned;
  k.heads_q = 64;
  k.heads_kv = 16;  // same group, twice the CTAs
  EXPECT_FALSE(hits(k));
  k = tuned;
  k.head_dim = 64;
  EXPECT_FALSE(hits(k));
  k = tuned;
  k.q_len = 2;
  EXPECT_FALSE(hits(k));
  k = tuned;
  k.window_left = 1000;  // attends about 1k keys, not 4k
  EXPECT_FALSE(hits(k));
  EXPECT_FALSE(hits(bench_key(4, 4096, 16)));  // paged is its own class...

  ASSERT_TRUE(table.insert(bench_key(4, 4096, 16), {DecodeKernel::kStandard, 1}).ok());
  EXPECT_TRUE(hits(bench_key(5, 6144, 64)));  // ...whatever the page size
  EXPECT_EQ(table.lookup(bench_key(5, 6144, 64))->kernel, DecodeKernel::kStandard);
  EXPECT_EQ(table.lookup(bench_key(5, 6144))->num_splits, 8);
}

TEST(DecodeTuningTable, AHitWinsOverTheHeuristic) {
  DecodeTuningTable table;
  ASSERT_TRUE(table.insert(bench_key(64, 65536), {DecodeKernel::kSplitKv, 4}).ok());
  ASSERT_TRUE(table.insert(bench_key(1, 65536), {DecodeKernel::kStandard, 1}).ok());

  DecodePlan p = plan_or_fail(bench_key(64, 65536), &table);
  EXPECT_EQ(p.source, DecodePlanSource::kTuningTable);
  EXPECT_EQ(p.kernel, DecodeKernel::kSplitKv);
  EXPECT_EQ(p.num_splits, 4);
  expect_consistent_plan(p, bench_key(64, 65536));

  p = plan_or_fail(bench_key(1, 65536), &table);
  EXPECT_EQ(p.source, DecodePlanSource::kTuningTable);
  EXPECT_EQ(p.kernel, DecodeKernel::kStandard);

  p = plan_or_fail(bench_key(2, 65536), &table);  // not in the table
  EXPECT_EQ(p.source, DecodePlanSource::kHeuristic);
}

// A winner tuned at the bottom of its cache bucket applies to longer caches of the class as is;
// only its chunks are refitted to the actual length, so still no split is empty.
TEST(DecodeTuningTable, HitIsFittedToTheActualCache) {
  DecodeTuningTable table;
  ASSERT_TRUE(table.insert(bench_key(1, 1024), {DecodeKernel::kSplitKv, 16}).ok());
  for (int64_t cache_len : {1024, 1100, 1500, 2047}) {
    const DecodePlan p = plan_or_fail(bench_key(1, cache_len), &table);
    EXPECT_EQ(p.source, DecodePlanSource::kTuningTable);
    EXPECT_LE(p.num_splits, 16);
    expect_consistent_plan(p, bench_key(1, cache_len));
  }
  EXPECT_EQ(plan_or_fail(bench_key(1, 1024), &table).num_splits, 16);
  EXPECT_EQ(plan_or_fail(bench_key(1, 1100), &table).num_splits, 9);  // chunks of 128 keys
}

TEST(DecodeTuningTable, InsertRejectsInconsistentWinners) {
  DecodeTuningTable table;
  EXPECT_FALSE(table.insert(bench_key(1, 4096), {DecodeKernel::kStandard, 2}).ok());
  EXPECT_FALSE(table.insert(bench_key(1, 4096), {DecodeKernel::kSplitKv, 1}).ok());
  EXPECT_FALSE(table.insert(bench_key(1, 4096), {DecodeKernel::kSplitKv, kMaxDecodeSplits + 1}).ok());
  EXPECT_FALSE(table.insert(bench_key(0, 4096), {DecodeKernel::kStandard, 1}).ok());
  EXPECT_EQ(table.size(), 0u);
  EXPECT_FALSE(table.lookup(bench_key(0, 4096)).has_value());
}

DecodeTuningTable sample_table() {
  DecodeTuningTable table;
  DecodeShapeKey windowed = bench_key(2, 65536);
  windowed.window_left = 4000;
  DecodeShapeKey multi_token = bench_key(16, 2048, 64);
  multi_token.q_len = 4;
  multi_token.head_dim = 256;
  for (auto [key, winner] : {std::pair{bench_key(1, 65536), DecodeTuningEntry{DecodeKernel::kSplitKv, 32}},
                             {bench_key(8, 4096), {DecodeKernel::kSplitKv, 2}},
                             {bench_key(64, 1024, 16), {DecodeKernel::kStandard, 1}},
                             {windowed, {DecodeKernel::kSplitKv, 8}},
                             {multi_token, {DecodeKernel::kSplitKv, 3, 2}}})
    EXPECT_TRUE(table.insert(key, winner).ok());
  return table;
}

TEST(DecodeTuningTable, SaveLoadRoundTrip) {
  const DecodeTuningTable table = sample_table();
  const std::string path = testing::TempDir() + "flare_decode_tuning_roundtrip.txt";
  Status s = table.save(path);
  ASSERT_TRUE(s.ok()) << s.message();

  std::ifstream file(path);
  std::string first_line;
  std::getline(file, first_line);
  EXPECT_EQ(first_line, "flare-decode-tuning 1");

  DecodeTuningTable loaded;
  s = loaded.load(path);
  ASSERT_TRUE(s.ok()) << s.message();
  EXPECT_EQ(loaded.entries(), table.entries());
  EXPECT_EQ(loaded.size(), 5u);
  for (const DecodeShapeKey& key : {bench_key(1, 65536), bench_key(9, 5000), bench_key(100, 1500, 16)}) {
    const DecodePlan a = plan_or_fail(key, &table), b = plan_or_fail(key, &loaded);
    EXPECT_EQ(std::memcmp(&a, &b, sizeof(DecodePlan)), 0);
  }
  std::remove(path.c_str());
}

TEST(DecodeTuningTable, ReadsCommentsBlankLinesAndAnyFieldOrder) {
  std::istringstream text(
      "flare-decode-tuning 1\n"
      "\n"
      "# measured on an H100\n"
      "  splits=16 kernel=split_kv layout=contiguous kv_len=65536 q_len=1 head_dim=128 group=4 heads_kv=8 batch=1  \n"
      "batch=8 heads_kv=8 group=4 head_dim=128 q_len=1 kv_len=4096 layout=paged kernel=standard splits=1\r\n");
  DecodeTuningTable table;
  Status s = table.read(text, "inline");
  ASSERT_TRUE(s.ok()) << s.message();
  EXPECT_EQ(table.size(), 2u);
  EXPECT_EQ(table.lookup(bench_key(1, 70000))->num_splits, 16);
  EXPECT_EQ(table.lookup(bench_key(8, 4096, 16))->kernel, DecodeKernel::kStandard);
  EXPECT_EQ(table.lookup(bench_key(1, 70000))->heads_per_cta, 0);  // absent: the engine's rule
}

// heads_per_cta is optional: written only when set, read back into the plan.
TEST(DecodeTuningTable, HeadsPerCtaIsAnOptionalField) {
  std::istringstream text(
      "flare-decode-tuning 1\n"
      "batch=1 heads_kv=8 group=4 head_dim=128 q_len=1 kv_len=65536 layout=contiguous kernel=split_kv splits=16 "
      "heads_per_cta=1\n"
      "batch=8 heads_kv=8 group=4 head_dim=128 q_len=1 kv_len=4096 layout=paged kernel=standard splits=1\n");
  DecodeTuningTable table;
  Status s = table.read(text, "inline");
  ASSERT_TRUE(s.ok()) << s.message();
  EXPECT_EQ(table.lookup(bench_key(1, 65536))->heads_per_cta, 1);
  EXPECT_EQ(table.lookup(bench_key(8, 4096, 64))->heads_per_cta, 0);
  const DecodePlan p = plan_or_fail(bench_key(1, 65536), &table);
  EXPECT_EQ(p.heads_per_cta, 1);
  EXPECT_EQ(p.num_splits, 16);
  EXPECT_TRUE(check_decode_plan(p, bench_key(1, 65536)).ok());

  std::ostringstream out;
  table.write(out);
  EXPECT_NE(out.str().find("splits=16 heads_per_cta=1\n"), std::string::npos) << out.str();
  EXPECT_NE(out.str().find("kernel=standard splits=1\n"), std::string::npos) << out.str();

  EXPECT_FALSE(table.insert(bench_key(1, 4096), {DecodeKernel::kSplitKv, 4, 3}).ok());
  EXPECT_FALSE(table.insert(bench_key(1, 4096), {DecodeKernel::kSplitKv, 4, 16}).ok());
  DecodeShapeKey wide = bench_key(1, 4096);
  wide.head_dim = 256;
  EXPECT_FALSE(table.insert(wide, {DecodeKernel::kSplitKv, 4, 8}).ok());
  EXPECT_TRUE(table.insert(wide, {DecodeKernel::kSplitKv, 4, 4}).ok());
}

// engine, combine and l2 are optional: written only when set, read back into the plan; absent,
// the plan keeps DecodePlan's defaults.
TEST(DecodeTuningTable, EngineCombineAndL2AreOptionalFields) {
  std::istringstream text(
      "flare-decode-tuning 1\n"
      "batch=1 heads_kv=8 group=4 head_dim=128 q_len=1 kv_len=2048 layout=contiguous kernel=split_kv splits=32 "
      "engine=head_warps combine=separate_kernel\n"
      "batch=1 heads_kv=8 group=4 head_dim=128 q_len=1 kv_len=4096 layout=contiguous kernel=split_kv splits=8 "
      "heads_per_cta=1 combine=in_kernel l2=evict_first\n"
      "batch=8 heads_kv=8 group=4 head_dim=128 q_len=1 kv_len=4096 layout=paged kernel=standard splits=1\n");
  DecodeTuningTable table;
  Status s = table.read(text, "inline");
  ASSERT_TRUE(s.ok()) << s.message();
  const DecodePlan a = plan_or_fail(bench_key(1, 2048), &table);
  EXPECT_EQ(a.engine, DecodeEngine::kHeadWarps);
  EXPECT_EQ(a.combine, DecodeCombine::kSeparateKernel);
  EXPECT_EQ(a.num_splits, 32);
  const DecodePlan b = plan_or_fail(bench_key(1, 4096), &table);
  EXPECT_EQ(b.engine, DecodePlan{}.engine);
  EXPECT_EQ(b.combine, DecodeCombine::kInKernel);
  EXPECT_TRUE(b.l2_evict_first);
  EXPECT_FALSE(a.l2_evict_first);  // absent: normal
  const DecodePlan c = plan_or_fail(bench_key(8, 4096, 16), &table);
  EXPECT_EQ(c.engine, DecodePlan{}.engine);
  EXPECT_EQ(c.combine, DecodePlan{}.combine);
  for (const DecodePlan& p : {a, b}) EXPECT_TRUE(check_decode_plan(p, p.shape).ok());

  std::ostringstream out;
  table.write(out);
  EXPECT_NE(out.str().find("splits=32 engine=head_warps combine=separate_kernel\n"), std::string::npos) << out.str();
  EXPECT_NE(out.str().find("splits=8 heads_per_cta=1 combine=in_kernel l2=evict_first\n"), std::string::npos)
      << out.str();
  EXPECT_NE(out.str().find("kernel=standard splits=1\n"), std::string::npos) << out.str();

  DecodeTuningEntry prezeroed{DecodeKernel::kSplitKv, 4};
  prezeroed.combine = DecodeCombine::kInKernelPrezeroed;
  EXPECT_FALSE(table.insert(bench_key(1, 4096), prezeroed).ok());
}

TEST(DecodeTuningTable, MalformedFilesNameTheLine) {
  const std::string version = "flare-decode-tuning 1\n";
  const std::string good = "batch=1 heads_kv=8 group=4 head_dim=128 q_len=1 kv_len=4096 layout=contiguous ";
  struct Case {
    std::string text, error;
  };
  const Case cases[] = {
      {"", "t:1: empty file"},
      {"flare-decode-tuning 2\n", "t:1: flare-decode-tuning version 2 is not supported"},
      {"decode table\n", "t:1: expected the version line 'flare-decode-tuning 1', got 'decode table'"},
      {"flare-decode-tuning 1 extra\n", "t:1: expected the version line"},
      {version + "# ok\n" + good + "kernel=split_kv\n", "t:3: missing field 'splits'"},
      {version + good + "kernel=split_kv splits=4 colour=red\n", "t:2: unknown field 'colour'"},
      {version + good + "kernel=split_kv splits=4 q_len=1\n", "t:2: field 'q_len' given twice"},
      {version + good + "kernel=split_kv splits\n", "t:2: expected name=value, got 'splits'"},
      {version + good + "kernel=split_kv splits=x\n", "t:2: 'splits=x': not an integer"},
      {version + good + "kernel=split_kv splits=4x\n", "t:2: 'splits=4x': not an integer"},
      {version + good + "kernel=split_kv splits=200\n", "t:2: 'splits=200': must be in [1, 128]"},
      {version + good + "kernel=fast splits=4\n", "t:2: 'kernel=fast': kernel must be standard or split_kv"},
      {version + good + "kernel=standard splits=4\n", "t:2: the standard kernel has num_splits 1, got 4"},
      {version + good + "kernel=split_kv splits=1\n", "t:2: split_kv needs num_splits in [2, 128], got 1"},
      {version + "batch=3 heads_kv=8 group=4 head_dim=128 q_len=1 kv_len=4096 layout=paged kernel=standard splits=1\n",
       "t:2: 'batch=3': a bucket value must be a power of two"},
      {version + "batch=1 heads_kv=8 group=4 head_dim=96 q_len=1 kv_len=4096 layout=paged kernel=standard splits=1\n",
       "t:2: 'head_dim=96': must be 64, 128 or 256"},
      {version + "batch=1 heads_kv=8 group=4 head_dim=64 q_len=9 kv_len=4096 layout=paged kernel=standard splits=1\n",
       "t:2: 'q_len=9': must be in [1, 8]"},
      {version + "batch=1 heads_kv=8 group=4 head_dim=64 q_len=1 kv_len=0 layout=paged kernel=standard splits=1\n",
       "t:2: 'kv_len=0': must be in [1, 1073741824]"},
      {version + "batch=1 heads_kv=8 group=4 head_dim=64 q_len=1 kv_len=64 layout=ragged kernel=standard splits=1\n",
       "t:2: 'layout=ragged': layout must be contiguous or paged"},
      {version + good + "kernel=split_kv splits=4\n\n" + good + "kernel=standard splits=1\n",
       "t:4: the same shape class as line 2"},
      {version + good + "kernel=split_kv splits=4 heads_per_cta=3\n", "t:2: heads_per_cta must be 0 or a power of two"},
      {version + good + "kernel=split_kv splits=4 heads_per_cta=16\n", "t:2: 'heads_per_cta=16': must be in [0, 8]"},
      {version + good + "kernel=split_kv splits=4 engine=warp_heads\n",
       "t:2: 'engine=warp_heads': engine must be key_groups, head_warps or portable"},
      {version + good + "kernel=split_kv splits=4 combine=in_kernel_prezeroed\n",
       "t:2: 'combine=in_kernel_prezeroed': a table may not choose in_kernel_prezeroed"},
      {version + good + "kernel=split_kv splits=4 l2=evict_last\n",
       "t:2: 'l2=evict_last': l2 must be normal or evict_first"},
      {version + good + "kernel=split_kv splits=4 engine=portable engine=portable\n",
       "t:2: field 'engine' given twice"},
      {version + "batch=1 heads_kv=2 group=4 head_dim=128 q_len=1 kv_len=4096 layout=paged kernel=standard splits=1 "
                 "heads_per_cta=4\n",
       "t:2: heads_per_cta must be 0 or a power of two up to 8 (head dim 128) dividing heads_kv 2, got 4"},
  };
  for (const Case& c : cases) {
    DecodeTuningTable table = sample_table();
    std::istringstream in(c.text);
    Status s = table.read(in, "t");
    ASSERT_FALSE(s.ok()) << "accepted:\n" << c.text;
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find(c.error), std::string::npos) << "got: " << s.message() << "\nwanted: " << c.error;
    EXPECT_EQ(table.entries(), sample_table().entries()) << "a failed read changed the table";
  }
}

TEST(DecodeTuningTable, MissingFileNamesThePath) {
  DecodeTuningTable table;
  Status s = table.load("/nonexistent/flare_tuning.txt");
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("/nonexistent/flare_tuning.txt"), std::string::npos) << s.message();
}

}  // namespace
}  // namespace flare
