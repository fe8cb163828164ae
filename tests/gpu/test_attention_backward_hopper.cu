// The Hopper attention backward against the CPU oracle, ordinary and deterministic: head dims up to
// 128, every mask, GQA/MQA, seqlen_q != seqlen_k, varlen with empty and one-token sequences,
// attention sinks; the deterministic mode's bitwise reproducibility. (Soft-capping and head dims
// above 128 run the portable backward: test_attention_backward.)
// FLARE_TEST_REDUCED=1 runs a small subset.
#include <gtest/gtest.h>

#include <cstdlib>

#include "flare_instantiated.h"
#include "tests/gpu/attention_case.h"

namespace flare::test {
namespace {

bool reduced() { return std::getenv("FLARE_TEST_REDUCED") != nullptr; }


void run_backward(const AttnCase& c, bool deterministic, Backend forward = Backend::kAuto) {
  SCOPED_TRACE(c.name() + (deterministic ? " deterministic" : ""));
  AttnProblem prob(c);
  AttentionForwardParams f = prob.forward_params(forward);
  Status s = attention_forward(f);
  ASSERT_TRUE(s.ok()) << s.message();
  AttentionBackwardParams b = prob.backward_params(Backend::kHopper, deterministic);  // draws dout
  prob.run_backward_oracle();
  Status sb = attention_backward(b);
  ASSERT_TRUE(sb.ok()) << sb.message();
  FLARE_CUDA_OK(cudaDeviceSynchronize());
  prob.check_backward();
}

const MaskParams kMasks[] = {MaskParams{}, MaskParams{true, -1, -1}, MaskParams{false, 100, 20},
                             MaskParams{true, 64, -1}};

#ifdef FLARE_HAS_HOPPER
TEST(HopperBackward, Sweep) {
  FLARE_REQUIRE_HOPPER();
  const std::pair<int, int> lens[] = {{1, 1}, {17, 17}, {127, 129}, {129, 127}, {300, 1000}, {1000, 300}};
  const int ratios[] = {1, 4, 8};
  uint64_t seed = 6000;
  for (int d : {64, 80, 96, 128})
    for (int li = 0; li < 6; ++li) {
      if (reduced() && li != 2) continue;
      AttnCase c;
      c.head_dim = d;
      c.seqlen_q = lens[li].first;
      c.seqlen_k = lens[li].second;
      c.heads = ratios[(li + d / 16) % 3];
      c.heads_kv = 1;
      c.batch = 2;
      c.mask = kMasks[(li + d / 32) % 4];
      c.dtype = (li % 2) ? DType::kFloat16 : DType::kBFloat16;
      c.seed = seed++;
      run_backward(c, li % 3 == 0);
    }
}

TEST(HopperBackward, MasksAndRatios) {
  FLARE_REQUIRE_HOPPER();
  uint64_t seed = 6500;
  for (const MaskParams& m : kMasks)
    for (int ratio : {1, 4})
      for (bool det : {false, true}) {
        AttnCase c;
        c.head_dim = 128;
        c.seqlen_q = 200;
        c.seqlen_k = 333;
        c.heads = 4;
        c.heads_kv = 4 / ratio;
        c.mask = m;
        c.seed = seed++;
        run_backward(c, det);
        if (reduced()) return;
      }
}

TEST(HopperBackward, SinksVarlen) {
  FLARE_REQUIRE_HOPPER();
  for (int d : {64, 128}) {
    AttnCase c;
    c.head_dim = d;
    c.heads = 4;
    c.heads_kv = 2;
    c.sinks = true;
    c.mask = MaskParams{true, -1, -1};
    c.varlen_q = {0, 1, 17, 130, 1, 257};
    c.varlen_k = {5, 1, 40, 129, 0, 300};
    c.batch = 6;
    c.seed = 7000 + d;
    run_backward(c, false, Backend::kPortable);
    run_backward(c, d == 128, Backend::kAuto);
  }
}

TEST(HopperBackward, DeterministicIsBitwiseReproducible) {
  FLARE_REQUIRE_HOPPER();
  for (auto [mask, ratio] : {std::pair{MaskParams{}, 1}, {MaskParams{true, -1, -1}, 4}, {MaskParams{false, 300, 0}, 2}}) {
    AttnCase c;
    c.head_dim = ratio == 2 ? 64 : 128;
    c.seqlen_q = c.seqlen_k = 1000;
    c.heads = 8;
    c.heads_kv = 8 / ratio;
    c.batch = 2;
    c.mask = mask;
    c.seed = 8000 + ratio;
    expect_bitwise_reproducible(c, Backend::kHopper, reduced() ? 2 : 20);
  }
}

TEST(HopperBackward, FallsBackOrRefusesOutsideItsScope) {
  FLARE_REQUIRE_HOPPER();
#ifndef FLARE_HAS_HEAD_DIM_256
  GTEST_SKIP() << "head dim 256 is not instantiated in this build";
#endif
  AttnCase c;
  c.head_dim = 256;
  c.seqlen_q = c.seqlen_k = 64;
  AttnProblem prob(c);
  ASSERT_TRUE(attention_forward(prob.forward_params(Backend::kAuto)).ok());
  AttentionBackwardParams forced = prob.backward_params(Backend::kHopper, false);
  EXPECT_FALSE(attention_backward(forced).ok()) << "head dim 256 is not the Hopper backward's";
  AttentionBackwardParams automatic = prob.backward_params(Backend::kAuto, true);
  EXPECT_TRUE(attention_backward(automatic).ok()) << "kAuto runs the portable backward for it";
}
#endif

}  // namespace
}  // namespace flare::test
