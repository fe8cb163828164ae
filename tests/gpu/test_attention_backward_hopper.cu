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

#ifdef FLARE_HAS_HOPPER
TEST(HopperBackward, Sweep) {
  FLARE_REQUIRE_HOPPER();
  uint64_t seed = 6000;
  for (int d : {64, 80, 96, 128})
    for (int li = 0; li < kBackwardSweepCases; ++li) {
      if (reduced() && li != 2) continue;
      run_backward(backward_sweep_case(d, li, seed++), li % 3 == 0);
    }
}

TEST(HopperBackward, MasksAndRatios) {
  FLARE_REQUIRE_HOPPER();
  uint64_t seed = 6500;
  for (const MaskParams& m : kSweepMasks)
    for (int ratio : {1, 4})
      for (bool det : {false, true}) {
        run_backward(mask_ratio_case(m, ratio, seed++), det);
        if (reduced()) return;
      }
}

TEST(HopperBackward, SinksVarlen) {
  FLARE_REQUIRE_HOPPER();
  for (int d : {64, 128}) {
    const AttnCase c = varlen_sinks_case(d, 2, MaskParams{true, -1, -1}, 7000 + d);
    run_backward(c, false, Backend::kPortable);
    run_backward(c, d == 128, Backend::kAuto);
  }
}

TEST(HopperBackward, DeterministicIsBitwiseReproducible) {
  FLARE_REQUIRE_HOPPER();
  // The last two have more tiles than the H100 holds at once (4 x 16 heads x 32 kv blocks): the
  // rotated walks' residency rounds and several tiles per semaphore in flight.
  struct Det {
    MaskParams mask;
    int ratio, seqlen, heads, batch;
  };
  for (const Det& d : {Det{MaskParams{}, 1, 1000, 8, 2}, Det{MaskParams{true, -1, -1}, 4, 1000, 8, 2},
                       Det{MaskParams{false, 300, 0}, 2, 1000, 8, 2}, Det{MaskParams{}, 1, 4096, 16, 4},
                       Det{MaskParams{true, -1, -1}, 2, 4096, 16, 4}}) {
    if (reduced() && d.seqlen > 1000) continue;
    const MaskParams mask = d.mask;
    const int ratio = d.ratio;
    AttnCase c;
    c.head_dim = ratio == 2 ? 64 : 128;
    c.seqlen_q = c.seqlen_k = d.seqlen;
    c.heads = d.heads;
    c.heads_kv = d.heads / ratio;
    c.batch = d.batch;
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
