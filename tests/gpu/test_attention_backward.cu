// The portable attention backward against the CPU oracle (ordinary and deterministic), and the
// deterministic mode's bitwise reproducibility. FLARE_TEST_REDUCED=1 runs a small subset.
#include <gtest/gtest.h>

#include <cstdlib>

#include "tests/gpu/attention_case.h"

namespace flare::test {
namespace {

bool reduced() { return std::getenv("FLARE_TEST_REDUCED") != nullptr; }

// Forward on the GPU (its out and lse feed the backward), then the backward, checked.
void run_backward(const AttnCase& c, bool deterministic) {
  SCOPED_TRACE(c.name() + (deterministic ? " deterministic" : ""));
  AttnProblem prob(c);
  AttentionForwardParams f = prob.forward_params(Backend::kPortable);
  Status s = attention_forward(f);
  ASSERT_TRUE(s.ok()) << s.message();
  AttentionBackwardParams b = prob.backward_params(Backend::kPortable, deterministic);  // draws dout
  prob.run_backward_oracle();
  Status sb = attention_backward(b);
  ASSERT_TRUE(sb.ok()) << sb.message();
  FLARE_CUDA_OK(cudaDeviceSynchronize());
  prob.check_backward();
}

const MaskParams kMasks[] = {MaskParams{}, MaskParams{true, -1, -1}, MaskParams{false, 100, 20},
                             MaskParams{true, 64, -1}};

TEST(PortableBackward, Sweep) {
  FLARE_REQUIRE_GPU();
  const std::pair<int, int> lens[] = {{1, 1}, {17, 17}, {127, 129}, {129, 127}, {300, 1000}, {1000, 300}};
  const int ratios[] = {1, 4, 8};
  uint64_t seed = 2000;
  for (int d : {64, 80, 96, 128, 192, 256})
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

TEST(PortableBackward, MasksRatiosAndModes) {
  FLARE_REQUIRE_GPU();
  uint64_t seed = 2500;
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

TEST(PortableBackward, SoftcapSinksVarlen) {
  FLARE_REQUIRE_GPU();
  for (int d : {64, 256}) {
    AttnCase c;
    c.head_dim = d;
    c.heads = 4;
    c.heads_kv = 2;
    c.softcap = 8.f;
    c.sinks = true;
    c.mask = MaskParams{true, -1, -1};
    c.varlen_q = {0, 1, 17, 130, 1, 257};
    c.varlen_k = {5, 1, 40, 129, 0, 300};
    c.batch = 6;
    c.seed = 3000 + d;
    run_backward(c, d == 256);
  }
}

TEST(PortableBackward, DeterministicIsBitwiseReproducible) {
  FLARE_REQUIRE_GPU();
  for (auto [mask, ratio] : {std::pair{MaskParams{}, 1}, {MaskParams{true, -1, -1}, 4}}) {
    AttnCase c;
    c.head_dim = 128;
    c.seqlen_q = c.seqlen_k = 1000;
    c.heads = 8;
    c.heads_kv = 8 / ratio;
    c.batch = 2;
    c.mask = mask;
    c.seed = 4000 + ratio;
    expect_bitwise_reproducible(c, Backend::kPortable, reduced() ? 2 : 20);
  }
}

}  // namespace
}  // namespace flare::test
