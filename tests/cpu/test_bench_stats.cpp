// The host-only half of the benchmark harness: statistics, FLOP counting, the table, JSON and
// the command line.
#include "bench/common/bench_stats.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace flare::bench {
namespace {

// ---- summarize ---------------------------------------------------------------------------------

TEST(Summarize, OddCountUnsorted) {
  const Timing t = summarize({5.0, 1.0, 3.0, 2.0, 4.0});
  EXPECT_EQ(t.repeats, 5);
  EXPECT_DOUBLE_EQ(t.median_ms, 3.0);
  EXPECT_DOUBLE_EQ(t.mean_ms, 3.0);
  EXPECT_DOUBLE_EQ(t.min_ms, 1.0);
  EXPECT_DOUBLE_EQ(t.max_ms, 5.0);
  EXPECT_DOUBLE_EQ(t.stddev_ms, std::sqrt(2.5));  // sum of squares 10 over n - 1 = 4
  // Linear interpolation between ranks: rank 0.4 and 3.6 of 0..4.
  EXPECT_DOUBLE_EQ(t.p10_ms, 1.4);
  EXPECT_DOUBLE_EQ(t.p90_ms, 4.6);
}

TEST(Summarize, EvenCountMedianIsMeanOfMiddleTwo) {
  const Timing t = summarize({4.0, 1.0, 3.0, 2.0});
  EXPECT_DOUBLE_EQ(t.median_ms, 2.5);
  EXPECT_DOUBLE_EQ(t.mean_ms, 2.5);
}

TEST(Summarize, OneSample) {
  const Timing t = summarize({0.125});
  EXPECT_EQ(t.repeats, 1);
  EXPECT_DOUBLE_EQ(t.median_ms, 0.125);
  EXPECT_DOUBLE_EQ(t.p10_ms, 0.125);
  EXPECT_DOUBLE_EQ(t.p90_ms, 0.125);
  EXPECT_DOUBLE_EQ(t.stddev_ms, 0.0);
}

TEST(Summarize, IdenticalSamplesHaveNoSpread) {
  const Timing t = summarize(std::vector<double>(50, 0.1));
  EXPECT_DOUBLE_EQ(t.median_ms, 0.1);
  EXPECT_NEAR(t.stddev_ms, 0.0, 1e-15);
  EXPECT_DOUBLE_EQ(t.min_ms, t.max_ms);
}

TEST(Summarize, OrderedStatistics) {
  std::vector<double> samples;
  for (int i = 0; i < 101; ++i) samples.push_back(std::fmod(i * 37.0, 101.0) * 0.01);  // 0..1
  const Timing t = summarize(samples);
  EXPECT_EQ(t.repeats, 101);
  EXPECT_DOUBLE_EQ(t.median_ms, 0.5);
  EXPECT_NEAR(t.p10_ms, 0.1, 1e-12);
  EXPECT_NEAR(t.p90_ms, 0.9, 1e-12);
  EXPECT_LE(t.min_ms, t.p10_ms);
  EXPECT_LE(t.p10_ms, t.median_ms);
  EXPECT_LE(t.median_ms, t.p90_ms);
  EXPECT_LE(t.p90_ms, t.max_ms);
}

TEST(Summarize, EmptyThrows) { EXPECT_THROW(summarize({}), std::invalid_argument); }

TEST(Percentile, EndsAndClamping) {
  const std::vector<double> s = {1.0, 2.0, 4.0};
  EXPECT_DOUBLE_EQ(percentile_of_sorted(s, 0.0), 1.0);
  EXPECT_DOUBLE_EQ(percentile_of_sorted(s, 1.0), 4.0);
  EXPECT_DOUBLE_EQ(percentile_of_sorted(s, 0.75), 3.0);
  EXPECT_DOUBLE_EQ(percentile_of_sorted(s, -1.0), 1.0);
  EXPECT_DOUBLE_EQ(percentile_of_sorted(s, 2.0), 4.0);
}

// ---- FLOPs and rates ---------------------------------------------------------------------------

TEST(Flops, ForwardMatchesFlashAttentionFormula) {
  // 4 · b · h · sq · sk · d
  EXPECT_DOUBLE_EQ(attention_fwd_flops(2, 16, 4096, 4096, 128, false),
                   4.0 * 2 * 16 * 4096.0 * 4096.0 * 128);
  EXPECT_DOUBLE_EQ(attention_fwd_flops(1, 1, 3, 5, 7, false), 4.0 * 3 * 5 * 7);
}

TEST(Flops, CausalIsHalfEvenWhenSeqlensDiffer) {
  EXPECT_DOUBLE_EQ(attention_fwd_flops(2, 16, 4096, 4096, 128, true),
                   0.5 * attention_fwd_flops(2, 16, 4096, 4096, 128, false));
  EXPECT_DOUBLE_EQ(attention_fwd_flops(1, 8, 1024, 8192, 64, true),
                   0.5 * attention_fwd_flops(1, 8, 1024, 8192, 64, false));
}

TEST(Flops, BackwardIsTwoAndAHalfForward) {
  for (bool causal : {false, true}) {
    EXPECT_DOUBLE_EQ(attention_bwd_flops(4, 32, 2048, 2048, 64, causal),
                     2.5 * attention_fwd_flops(4, 32, 2048, 2048, 64, causal));
  }
}

TEST(Flops, LargeShapesDoNotOverflow) {
  // 4 · 64 · 128 · 2^20 · 2^20 · 256 = 2^53: past int32, and int64 products of bigger shapes.
  const double f = attention_fwd_flops(64, 128, 1 << 20, 1 << 20, 256, false);
  EXPECT_DOUBLE_EQ(f, std::ldexp(1.0, 2 + 6 + 7 + 20 + 20 + 8));
  EXPECT_GT(attention_fwd_flops(1 << 20, 1 << 10, 1 << 20, 1 << 20, 256, false), 0.0);
}

TEST(Flops, FromPairsAgreesWithDenseAndCausalCounts) {
  const int64_t b = 2, h = 8, s = 1024, d = 128;
  // Dense: every pair visible.
  EXPECT_DOUBLE_EQ(attention_flops_from_pairs(s * s, b * h, d),
                   attention_fwd_flops(b, h, s, s, d, false));
  // Causal counted exactly (s(s+1)/2 pairs) is a little over FlashAttention's half.
  const double exact_causal = attention_flops_from_pairs(s * (s + 1) / 2, b * h, d);
  EXPECT_GT(exact_causal, attention_fwd_flops(b, h, s, s, d, true));
  EXPECT_DOUBLE_EQ(exact_causal, 4.0 * (s * (s + 1) / 2) * b * h * d);
}

TEST(Rates, Units) {
  EXPECT_DOUBLE_EQ(tflops(1e12, 1000.0), 1.0);  // 1e12 FLOP in one second
  EXPECT_DOUBLE_EQ(tflops(2e9, 1.0), 2.0);      // 2e9 FLOP in one millisecond
  EXPECT_DOUBLE_EQ(gbps(1e9, 1000.0), 1.0);
  EXPECT_DOUBLE_EQ(gbps(3e6, 1.0), 3.0);
  EXPECT_TRUE(std::isnan(tflops(1e12, 0.0)));
  EXPECT_TRUE(std::isnan(gbps(1e9, -1.0)));
}

// ---- table -------------------------------------------------------------------------------------

TEST(Table, AlignsTextLeftAndNumbersRight) {
  Table t;
  t.add_row({{"case", "fwd d64"}, {"ms", 1.5}, {"n", 7}});
  t.add_row({{"case", "fwd d128 causal"}, {"ms", 12.25}, {"n", 1234}});
  const std::string expected =
      "case                 ms     n\n"
      "---------------  ------  ----\n"
      "fwd d64           1.500     7\n"
      "fwd d128 causal  12.250  1234\n";
  EXPECT_EQ(t.str(), expected);
}

TEST(Table, ColumnsInFirstUseOrderAndMissingCellsBlank) {
  Table t;
  t.add_row({{"a", "x"}, {"b", Table::Cell(2.0, 1)}});
  t.add_row({{"c", "zz"}, {"a", "yyy"}});
  const std::string expected =
      "a      b  c\n"
      "---  ---  --\n"
      "x    2.0\n"
      "yyy       zz\n";
  EXPECT_EQ(t.str(), expected);
}

TEST(Table, MixedColumnIsLeftAligned) {
  Table t;
  t.add_row({{"v", 1.0}});
  t.add_row({{"v", "n/a"}});
  EXPECT_EQ(t.str(), "v\n-----\n1.000\nn/a\n");
}

TEST(Table, WidthCountsCodePointsNotBytes) {
  Table t;
  t.add_row({{"µs", 1}});
  EXPECT_EQ(t.str(), "µs\n--\n 1\n");
}

TEST(Table, EmptyAndPrecision) {
  Table t;
  EXPECT_TRUE(t.empty());
  EXPECT_EQ(t.str(), "");
  EXPECT_EQ(Table::format_number(3.14159, 2), "3.14");
  EXPECT_EQ(Table::format_number(2.5, 0), "2");  // printf rounds half to even
  EXPECT_EQ(Table::Cell(1.0f).text, "1.000");
  EXPECT_EQ(Table::Cell(int64_t{1} << 40).text, "1099511627776");
}

// ---- JSON --------------------------------------------------------------------------------------

TEST(Json, StringEscaping) {
  EXPECT_EQ(json_string("plain"), "\"plain\"");
  EXPECT_EQ(json_string(""), "\"\"");
  EXPECT_EQ(json_string("a\"b"), "\"a\\\"b\"");
  EXPECT_EQ(json_string("back\\slash"), "\"back\\\\slash\"");
  EXPECT_EQ(json_string("l1\nl2\r\t"), "\"l1\\nl2\\r\\t\"");
  EXPECT_EQ(json_string("\b\f"), "\"\\b\\f\"");
  EXPECT_EQ(json_string(std::string("nul\0x", 5)), "\"nul\\u0000x\"");
  EXPECT_EQ(json_string("\x01\x1f"), "\"\\u0001\\u001f\"");
  EXPECT_EQ(json_string("/"), "\"/\"");            // '/' needs no escape
  EXPECT_EQ(json_string("\x7f"), "\"\x7f\"");      // DEL is not a JSON control character
  EXPECT_EQ(json_string("Q·Kᵀ µs"), "\"Q·Kᵀ µs\"");  // UTF-8 passes through
}

TEST(Json, Numbers) {
  EXPECT_EQ(json_number(1.0), "1");
  EXPECT_EQ(json_number(0.1), "0.1");
  EXPECT_EQ(json_number(-2.5), "-2.5");
  EXPECT_EQ(json_number(1e300), "1e+300");
  EXPECT_EQ(json_number(std::numeric_limits<double>::quiet_NaN()), "null");
  EXPECT_EQ(json_number(std::numeric_limits<double>::infinity()), "null");
  EXPECT_EQ(json_number(-std::numeric_limits<double>::infinity()), "null");
  // Shortest form that reads back exactly.
  const double v = 612.3456789012345;
  EXPECT_EQ(std::stod(json_number(v)), v);
}

TEST(Json, Records) {
  std::vector<Record> records(2);
  records[0].name = "fwd \"d128\"";
  records[0].metrics = {{"median_ms", 1.25}, {"tflops", 600.0}};
  records[0].tags = {{"dtype", "bf16"}, {"note", "a\nb"}};
  records[1].name = "empty";
  const std::string expected =
      "[\n"
      "  {\"name\": \"fwd \\\"d128\\\"\", \"metrics\": {\"median_ms\": 1.25, \"tflops\": 600}, "
      "\"tags\": {\"dtype\": \"bf16\", \"note\": \"a\\nb\"}},\n"
      "  {\"name\": \"empty\", \"metrics\": {}, \"tags\": {}}\n"
      "]\n";
  EXPECT_EQ(to_json(records), expected);
  EXPECT_EQ(to_json({}), "[]\n");
}

TEST(Json, WriteJsonWritesTheFile) {
  const std::string path = ::testing::TempDir() + "flare_test_bench_stats.json";
  std::vector<Record> records(1);
  records[0].name = "r";
  records[0].metrics["x"] = std::numeric_limits<double>::quiet_NaN();
  write_json(path, records);
  std::ifstream in(path);
  std::stringstream contents;
  contents << in.rdbuf();
  EXPECT_EQ(contents.str(), to_json(records));
  EXPECT_NE(contents.str().find("\"x\": null"), std::string::npos);
  std::remove(path.c_str());
}

TEST(JsonDeathTest, UnwritablePathExits) {
  EXPECT_EXIT(write_json("/nonexistent-dir/x.json", {}), ::testing::ExitedWithCode(1),
              "cannot write JSON to '/nonexistent-dir/x.json'");
}

// ---- command line ------------------------------------------------------------------------------

bool parse(std::vector<const char*> argv, Args* args, std::string* error = nullptr) {
  argv.insert(argv.begin(), "bench_test");
  return parse_args(static_cast<int>(argv.size()), argv.data(), args, error);
}

TEST(Args, Defaults) {
  Args a;
  ASSERT_TRUE(parse({}, &a));
  EXPECT_TRUE(a.json_path.empty());
  EXPECT_FALSE(a.repeats.has_value());
  EXPECT_FALSE(a.warmup.has_value());
  EXPECT_FALSE(a.seqlen.has_value());
  EXPECT_FALSE(a.graph || a.no_flush || a.quick || a.forward_only || a.help);
  EXPECT_TRUE(a.selected("anything"));
  const TimingOptions t = a.timing();
  EXPECT_EQ(t.repeats, TimingOptions{}.repeats);
  EXPECT_EQ(t.warmup, TimingOptions{}.warmup);
  EXPECT_TRUE(t.flush_l2);
  EXPECT_FALSE(t.cuda_graph);
  EXPECT_EQ(t.calls, 1);
}

TEST(Args, AllOptionsSeparateValues) {
  Args a;
  std::string error;
  ASSERT_TRUE(parse({"--json", "out/r.json", "--repeats", "20", "--warmup", "0", "--graph",
                     "--no-flush", "--filter", "d128", "--quick", "--seqlen", "1024", "--calls", "20", "--forward-only"},
                    &a, &error))
      << error;
  EXPECT_EQ(a.seqlen, 1024);
  EXPECT_EQ(a.calls, 20);
  EXPECT_EQ(a.json_path, "out/r.json");
  EXPECT_EQ(a.repeats, 20);
  EXPECT_EQ(a.warmup, 0);
  EXPECT_TRUE(a.graph);
  EXPECT_TRUE(a.no_flush);
  EXPECT_EQ(a.filter, "d128");
  EXPECT_TRUE(a.quick);
  EXPECT_TRUE(a.forward_only);
  EXPECT_TRUE(a.selected("fwd d128 causal"));
  EXPECT_FALSE(a.selected("fwd d64"));

  TimingOptions defaults;
  defaults.graph_batch = 8;
  const TimingOptions t = a.timing(defaults);
  EXPECT_EQ(t.repeats, 20);  // explicit beats --quick
  EXPECT_EQ(t.warmup, 0);
  EXPECT_TRUE(t.cuda_graph);
  EXPECT_FALSE(t.flush_l2);
  EXPECT_EQ(t.graph_batch, 8);  // not a command-line setting: kept
  EXPECT_EQ(t.calls, 20);
}

TEST(Args, EqualsForm) {
  Args a;
  ASSERT_TRUE(parse({"--json=r.json", "--repeats=7", "--warmup=2", "--filter=bwd"}, &a));
  EXPECT_EQ(a.json_path, "r.json");
  EXPECT_EQ(a.repeats, 7);
  EXPECT_EQ(a.warmup, 2);
  EXPECT_EQ(a.filter, "bwd");
  Args b;
  ASSERT_TRUE(parse({"--filter="}, &b));  // an empty filter selects everything
  EXPECT_TRUE(b.selected("x"));
}

TEST(Args, QuickLowersDefaultsOnly) {
  Args a;
  ASSERT_TRUE(parse({"--quick"}, &a));
  TimingOptions t = a.timing();
  EXPECT_EQ(t.repeats, kQuickRepeats);
  EXPECT_EQ(t.warmup, kQuickWarmup);
  TimingOptions few;
  few.repeats = 3;
  few.warmup = 1;
  t = a.timing(few);  // never raises a benchmark's own smaller defaults
  EXPECT_EQ(t.repeats, 3);
  EXPECT_EQ(t.warmup, 1);
}

TEST(Args, Help) {
  Args a;
  ASSERT_TRUE(parse({"-h"}, &a));
  EXPECT_TRUE(a.help);
  Args b;
  ASSERT_TRUE(parse({"--help"}, &b));
  EXPECT_TRUE(b.help);
  const std::string u = usage("bench_attention_fwd");
  EXPECT_EQ(u.rfind("usage: bench_attention_fwd [options]\n", 0), 0u);
  for (const char* option : {"--json", "--repeats", "--warmup", "--graph", "--no-flush",
                             "--filter", "--quick", "--seqlen", "--calls", "--forward-only", "--help"}) {
    EXPECT_NE(u.find(option), std::string::npos) << option;
  }
}

TEST(Args, Errors) {
  struct Case {
    std::vector<const char*> argv;
    std::string message;
  };
  const std::vector<Case> cases = {
      {{"--bogus"}, "unknown option '--bogus'"},
      {{"--seqlen", "0"}, "--seqlen: expected an integer >= 1, got '0'"},
      {{"positional"}, "unexpected argument 'positional'"},
      {{"-x"}, "unexpected argument '-x'"},
      {{"--json"}, "--json needs a value"},
      {{"--json", "--quick"}, "--json needs a value"},
      {{"--json="}, "--json needs a path"},
      {{"--repeats"}, "--repeats needs a value"},
      {{"--repeats", "0"}, "--repeats: expected an integer >= 1, got '0'"},
      {{"--repeats", "-3"}, "--repeats: expected an integer >= 1, got '-3'"},
      {{"--repeats", "12x"}, "--repeats: expected an integer >= 1, got '12x'"},
      {{"--repeats="}, "--repeats: expected an integer >= 1, got ''"},
      {{"--repeats", "99999999999"}, "--repeats: expected an integer >= 1, got '99999999999'"},
      {{"--warmup", "-1"}, "--warmup: expected an integer >= 0, got '-1'"},
      {{"--calls", "0"}, "--calls: expected an integer >= 1, got '0'"},
      {{"--graph=1"}, "--graph takes no value"},
      {{"--quick=yes"}, "--quick takes no value"},
  };
  for (const Case& c : cases) {
    Args a;
    std::string error;
    EXPECT_FALSE(parse(c.argv, &a, &error)) << c.message;
    EXPECT_EQ(error, c.message);
  }
  Args a;
  EXPECT_FALSE(parse({"--bogus"}, &a, nullptr));  // a null error pointer is allowed
}

TEST(ArgsDeathTest, ParseOrExit) {
  const char* bad[] = {"bench_x", "--repeats", "0"};
  EXPECT_EXIT(parse_args_or_exit(3, const_cast<char**>(bad)), ::testing::ExitedWithCode(2),
              "bench_x: --repeats: expected an integer >= 1");
  const char* help[] = {"bench_x", "--help"};
  EXPECT_EXIT(parse_args_or_exit(2, const_cast<char**>(help)), ::testing::ExitedWithCode(0), "");
}

}  // namespace
}  // namespace flare::bench
