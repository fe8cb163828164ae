// The simple fp32 GPU kernel (Backend::kReference) against the CPU oracle.
#include <gtest/gtest.h>

#include "tests/gpu/attention_case.h"

namespace flare::test {
namespace {

void run_case(const AttnCase& c) {
  AttnProblem prob(c);
  prob.run_oracle();
  AttentionForwardParams p = prob.forward_params(Backend::kReference);
  Status s = attention_forward(p);
  ASSERT_TRUE(s.ok()) << s.message();
  FLARE_CUDA_OK(cudaDeviceSynchronize());
  prob.check_forward();
}

TEST(NaiveAttention, Sweep) {
  FLARE_REQUIRE_GPU();
  uint64_t seed = 1;
  for (int d : {64, 80, 128, 256})
    for (auto mask : {MaskParams{}, MaskParams{true, -1, -1}, MaskParams{false, 33, 7}})
      for (auto [sq, sk] : {std::pair{1, 17}, {127, 129}, {129, 127}}) {
        AttnCase c;
        c.batch = 2;
        c.seqlen_q = sq;
        c.seqlen_k = sk;
        c.heads = 4;
        c.heads_kv = d == 80 ? 1 : 2;
        c.head_dim = d;
        c.mask = mask;
        c.dtype = (seed % 2) ? DType::kBFloat16 : DType::kFloat16;
        c.seed = seed++;
        run_case(c);
      }
}

TEST(NaiveAttention, SoftcapSinksVarlen) {
  FLARE_REQUIRE_GPU();
  AttnCase c;
  c.heads = 4;
  c.heads_kv = 1;
  c.head_dim = 64;
  c.softcap = 5.f;
  c.sinks = true;
  c.mask.causal = true;
  c.varlen_q = {0, 1, 17, 300};
  c.varlen_k = {5, 1, 40, 300};
  c.batch = 4;
  run_case(c);
  c.mask = MaskParams{};
  c.seqlen_q = 2049;
  c.seqlen_k = 1000;
  c.varlen_q.clear();
  c.varlen_k.clear();
  c.batch = 1;
  run_case(c);
}

TEST(NaiveAttention, ErrorsComeBackAsStatus) {
  FLARE_REQUIRE_GPU();
  AttnCase c;
  AttnProblem prob(c);
  AttentionForwardParams p = prob.forward_params(Backend::kReference);
  p.q.shape[3] = 72;  // head dims of q and k now differ
  Status s = attention_forward(p);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("'k'"), std::string::npos) << s.message();
}

}  // namespace
}  // namespace flare::test
