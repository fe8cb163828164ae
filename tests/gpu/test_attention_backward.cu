// The portable attention backward against the CPU oracle (ordinary and deterministic), and the
// deterministic mode's bitwise reproducibility. FLARE_TEST_REDUCED=1 runs a small subset.
#include <gtest/gtest.h>

#include <cstdlib>

#include "tests/gpu/attention_case.h"
#include "tests/gpu/unbuilt.h"

namespace flare::test {
namespace {


// Forward on the GPU (its out and lse feed the backward), then the backward, checked.
void run_backward(const AttnCase& c, bool deterministic) {
  SCOPED_TRACE(c.name() + (deterministic ? " deterministic" : ""));
  AttnProblem prob(c);
  AttentionForwardParams f = prob.forward_params(Backend::kPortable);
  FLARE_ASSERT_OK_OR_UNBUILT(attention_forward(f));
  AttentionBackwardParams b = prob.backward_params(Backend::kPortable, deterministic);  // draws dout
  prob.run_backward_oracle(nullptr, prob.stored_out());
  prob.poison_workspace(b);
  FLARE_ASSERT_OK_OR_UNBUILT(attention_backward(b));
  FLARE_CUDA_OK(cudaDeviceSynchronize());
  prob.check_backward();
}

TEST(PortableBackward, Sweep) {
  FLARE_REQUIRE_GPU();
  uint64_t seed = 2000;
  for (int d : {64, 80, 96, 128, 192, 256})
    for (int li = 0; li < kBackwardSweepCases; ++li) {
      if (reduced() && li != 2) continue;
      run_backward(backward_sweep_case(d, li, seed++), li % 3 == 0);
    }
}

TEST(PortableBackward, MasksRatiosAndModes) {
  FLARE_REQUIRE_GPU();
  uint64_t seed = 2500;
  for (const MaskParams& m : kSweepMasks)
    for (int ratio : {1, 4})
      for (bool det : {false, true}) {
        run_backward(mask_ratio_case(m, ratio, seed++), det);
        if (reduced()) return;
      }
}

TEST(PortableBackward, SoftcapSinksVarlen) {
  FLARE_REQUIRE_GPU();
  for (int d : {64, 256}) {
    AttnCase c = varlen_sinks_case(d, 2, MaskParams{true, -1, -1}, 3000 + d);
    c.softcap = 8.f;
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
