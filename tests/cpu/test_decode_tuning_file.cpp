// The shipped decode tuning tables (data/decode_tuning_h100.txt and decode_tuning_h200.txt, each
// written on its GPU by `bench_decode --tune`; both GPUs have 132 SMs): each parses, the planner takes every benchmarked shape from it, and each
// winner is a split count the planner reproduces for its class, so a loaded entry plans exactly
// the kernel that was timed.
#include <gtest/gtest.h>

#include <filesystem>
#include <sstream>
#include <string>

#include "flare/decode_plan.h"

namespace flare {
namespace {

constexpr int kH100Sms = 132;  // the H200's count too

std::string shipped_table_path(const std::string& name) {
  return (std::filesystem::path(__FILE__).parent_path().parent_path().parent_path() / "data" / name).string();
}

// bench_decode's shapes: bf16, heads 32 / 8, head dim 128, one query token.
DecodeShapeKey bench_key(int batch, int64_t cache_len, int page_size) {
  DecodeShapeKey k;
  k.batch = batch;
  k.heads_q = 32;
  k.heads_kv = 8;
  k.head_dim = 128;
  k.max_cache_len = cache_len;
  k.page_size = page_size;
  return k;
}

class ShippedDecodeTable : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    const Status s = table_.load(shipped_table_path(GetParam()));
    ASSERT_TRUE(s.ok()) << s.message();
  }
  DecodeTuningTable table_;
};

TEST_P(ShippedDecodeTable, CoversTheBenchmarkShapes) {
  for (int batch : {1, 8})
    for (int64_t len = 256; len <= 65536; len *= 2)
      for (int page_size : {0, 16, 64}) {
        DecodePlan plan;
        ASSERT_TRUE(decode_plan(bench_key(batch, len, page_size), &table_, kH100Sms, &plan).ok());
        EXPECT_EQ(plan.source, DecodePlanSource::kTuningTable) << batch << " " << len << " " << page_size;
      }
}

TEST_P(ShippedDecodeTable, WinnersAreTheSplitCountsThatWereTimed) {
  ASSERT_GT(table_.size(), 0u);
  for (const auto& [c, winner] : table_.entries()) {
    DecodeShapeKey k = bench_key(c.batch_bucket, c.kv_len_bucket, c.paged ? 16 : 0);
    k.heads_kv = c.heads_kv;
    k.heads_q = c.heads_kv * c.group;
    k.head_dim = c.head_dim;
    k.q_len = c.q_len;
    DecodePlan plan;
    ASSERT_TRUE(decode_plan(k, &table_, kH100Sms, &plan).ok());
    EXPECT_EQ(plan.source, DecodePlanSource::kTuningTable);
    EXPECT_EQ(plan.num_splits, winner.num_splits) << "batch " << c.batch_bucket << " kv_len " << c.kv_len_bucket;
    EXPECT_EQ(plan.kernel, winner.kernel);
    // A candidate the tuner could have timed: within the candidate set of its shape.
    bool candidate = false;
    for (const DecodePlan& p : decode_candidates(k, kH100Sms)) candidate |= p.num_splits == winner.num_splits;
    EXPECT_TRUE(candidate) << "batch " << c.batch_bucket << " kv_len " << c.kv_len_bucket << " splits "
                           << winner.num_splits;
  }
}

TEST_P(ShippedDecodeTable, RoundTripsThroughItsTextFormat) {
  std::ostringstream text;
  table_.write(text);
  DecodeTuningTable again;
  std::istringstream in(text.str());
  ASSERT_TRUE(again.read(in, "round trip").ok());
  EXPECT_EQ(again.entries(), table_.entries());
}

TEST_P(ShippedDecodeTable, UnseenShapesFallBackToTheHeuristic) {
  DecodeShapeKey k = bench_key(1, 4096, 0);
  k.head_dim = 64;  // only head dim 128 was tuned
  DecodePlan plan;
  ASSERT_TRUE(decode_plan(k, &table_, kH100Sms, &plan).ok());
  EXPECT_EQ(plan.source, DecodePlanSource::kHeuristic);
}

INSTANTIATE_TEST_SUITE_P(Tables, ShippedDecodeTable,
                         ::testing::Values("decode_tuning_h100.txt", "decode_tuning_h200.txt"),
                         [](const auto& info) { return info.param.substr(14, 4); });

}  // namespace
}  // namespace flare
