// The attention forward against the CPU oracle, on each backend (portable mma.sync, Hopper
// wgmma/TMA), over the sweep of issue 3: head dims, dtypes, masks, GQA ratios, awkward sequence
// lengths, seqlen_q != seqlen_k, varlen, strided operands.
// FLARE_TEST_REDUCED=1 runs a small subset (for compute-sanitizer).
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstdio>
#include <memory>
#include <thread>
#include <vector>

#include "flare_instantiated.h"
#include "tests/gpu/attention_case.h"
#include "tests/gpu/unbuilt.h"

namespace flare::test {
namespace {


void run_forward(const AttnCase& c, Backend backend) {
  SCOPED_TRACE(c.name());
  AttnProblem prob(c);
  prob.run_oracle();
  AttentionForwardParams p = prob.forward_params(backend);
  FLARE_ASSERT_OK_OR_UNBUILT(attention_forward(p));
  FLARE_CUDA_OK(cudaDeviceSynchronize());
  prob.check_forward();
}

class Forward : public ::testing::TestWithParam<Backend> {
 protected:
  void SetUp() override {
    FLARE_REQUIRE_GPU();
    if (GetParam() != Backend::kHopper) return;
#ifndef FLARE_HAS_HOPPER
    GTEST_SKIP() << "built without the Hopper kernels";
#endif
    FLARE_REQUIRE_HOPPER();
  }
};

TEST_P(Forward, Sweep) {
  const std::pair<int, int> lens[] = {{1, 1}, {17, 17}, {127, 129}, {129, 127}, {1000, 1000}, {2049, 300},
                                      {1, 1000}, {300, 2049}};
  const int ratios[] = {1, 4, 8};
  uint64_t seed = 100;
  int count = 0;
  for (int d : {64, 80, 96, 128, 192, 256}) {
    for (int li = 0; li < 8; ++li) {
      if (reduced() && li % 4 != 2) continue;
      AttnCase c;
      c.head_dim = d;
      c.seqlen_q = lens[li].first;
      c.seqlen_k = lens[li].second;
      c.heads_kv = 1;
      c.heads = ratios[(li + d / 16) % 3];
      c.batch = c.seqlen_q * c.seqlen_k > 500000 ? 1 : 2;
      c.mask = kSweepMasks[(li + d / 32) % 4];
      c.dtype = (li % 2) ? DType::kFloat16 : DType::kBFloat16;
      c.seed = seed++;
      run_forward(c, GetParam());
      ++count;
    }
  }
  EXPECT_GT(count, 0);
}

TEST_P(Forward, EveryMaskEveryRatio) {
  uint64_t seed = 500;
  for (const MaskParams& m : kSweepMasks)
    for (int ratio : {1, 4, 8}) {
      AttnCase c;
      c.head_dim = 128;
      c.seqlen_q = 257;
      c.seqlen_k = 385;
      c.heads = 8;
      c.heads_kv = 8 / ratio;
      c.mask = m;
      c.seed = seed++;
      run_forward(c, GetParam());
      if (reduced()) return;
    }
}

TEST_P(Forward, SoftcapSinksAndScale) {
  for (int d : {64, 128, 256}) {
    AttnCase c;
    c.head_dim = d;
    c.seqlen_q = 200;
    c.seqlen_k = 333;
    c.heads = 4;
    c.heads_kv = 2;
    c.softcap = 10.f;
    c.sinks = true;
    c.mask = MaskParams{true, -1, -1};
    c.seed = 900 + d;
    run_forward(c, GetParam());
  }
}

TEST_P(Forward, VarlenWithEmptyAndSingleTokenSequences) {
  for (int d : {64, 128, 256})
    for (const MaskParams& m : kSweepMasks) {
      run_forward(varlen_sinks_case(d, 1, m, 1000 + d), GetParam());
      if (reduced()) return;
    }
}

TEST_P(Forward, StridedInputs) {
  // q/k/v as slices of a packed qkv tensor: non-contiguous head and row strides.
  AttnCase c;
  c.head_dim = 64;
  c.seqlen_q = c.seqlen_k = 100;
  c.heads = c.heads_kv = 2;
  AttnProblem prob(c);
  prob.run_oracle();
  ref::HostTensor qkv(c.dtype, {1, 100, 3, 2, 64});
  for (int64_t r = 0; r < 100; ++r)
    for (int h = 0; h < 2; ++h)
      for (int d = 0; d < 64; ++d) {
        int64_t src = (r * 2 + h) * 64 + d;
        qkv.set(((r * 3 + 0) * 2 + h) * 64 + d, prob.q.get(src));
        qkv.set(((r * 3 + 1) * 2 + h) * 64 + d, prob.k.get(src));
        qkv.set(((r * 3 + 2) * 2 + h) * 64 + d, prob.v.get(src));
      }
  DeviceTensor dqkv(qkv);
  dqkv.upload(qkv);
  AttentionForwardParams p = prob.forward_params(GetParam());
  for (int which = 0; which < 3; ++which) {
    TensorView t;
    t.data = static_cast<char*>(dqkv.view().data) + which * 2 * 64 * dtype_size(c.dtype);
    t.dtype = c.dtype;
    t.rank = 4;
    int64_t shape[4] = {1, 100, 2, 64}, stride[4] = {100 * 3 * 2 * 64, 3 * 2 * 64, 64, 1};
    for (int i = 0; i < 4; ++i) t.shape[i] = shape[i], t.stride[i] = stride[i];
    (which == 0 ? p.q : which == 1 ? p.k : p.v) = t;
  }
  Status s = attention_forward(p);
  ASSERT_TRUE(s.ok()) << s.message();
  FLARE_CUDA_OK(cudaDeviceSynchronize());
  prob.check_forward();
}

// The Hopper grid's last tiles split into key ranges (fwd_grid.h: a few tiles more than the SMs,
// so the last round is ragged, or fewer tiles than SMs): each part's O and LSE in its workspace slot, merged by LSE after
// the grid. Ragged query and key blocks, sinks (the first part's) and soft-capping; the workspace
// the caller gives (poisoned; one too small or misaligned is refused), and the one the call allocates.
TEST(HopperForward, TailTilesSplitIntoKeyRanges) {
  FLARE_REQUIRE_HOPPER();
  int dev = 0, sms = 0;
  FLARE_CUDA_OK(cudaGetDevice(&dev));
  FLARE_CUDA_OK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  uint64_t seed = 9100;
  auto run_case = [&](int d, int shape) {  // a lambda: FLARE_ASSERT_OK_OR_UNBUILT returns from it
    AttnCase c;
    c.head_dim = d;
    // 3,000 keys: 24 key blocks of 128 at d128, 47 of 64 at d256, the last ragged; tiles this long
    // take one CTA per tile (fwd_grid.h, hopper_fwd_persistent), where the last round splits.
    c.seqlen_k = 3000;
    if (shape == 0) {  // one ragged query block a head (185 rows: 128 + 57), 6 tiles past two rounds
      c.seqlen_q = 185;
      c.heads = c.heads_kv = sms + 3;
    } else if (shape == 2) {  // a few rows against many keys: 8 tiles, mostly padding, split anyway
      c.seqlen_q = 100;
      c.heads = c.heads_kv = 8;
    } else {  // 4 x 128 + 48 rows of two sequences, GQA 2, sinks, softcap
      c.seqlen_q = 560;
      c.batch = 2;
      c.heads = 2 * ((sms + 36) / 12);  // 132 SMs: 28 heads, 280 tiles (16 split)
      c.heads_kv = c.heads / 2;
      c.sinks = true;
      c.softcap = 20.f;
      c.dtype = DType::kFloat16;
    }
    c.seed = seed++;
    SCOPED_TRACE(c.name());
    AttnProblem prob(c);
    AttentionForwardParams p = prob.forward_params(Backend::kHopper);
    std::size_t bytes = 0;
    ASSERT_TRUE(attention_forward_workspace_size(p, &bytes).ok());
    if (bytes == 0) {  // the head dim unbuilt, or its tiles not split here
      FLARE_ASSERT_OK_OR_UNBUILT(attention_forward(p));
      ADD_FAILURE() << "no split: the case should leave a ragged last round";
      return;
    }
    prob.run_oracle();  // the CPU's fp64 oracle (10-30 s at these sizes), only for a split case
    void* ws = nullptr;
    FLARE_CUDA_OK(cudaMalloc(&ws, bytes));
    FLARE_CUDA_OK(cudaMemset(ws, 0xFF, bytes));
    p.workspace = ws;
    p.workspace_bytes = bytes - 4;  // too small: named
    const Status small = attention_forward(p);
    EXPECT_FALSE(small.ok());
    EXPECT_NE(small.message().find("workspace"), std::string::npos) << small.message();
    p.workspace_bytes = bytes;
    p.workspace = static_cast<char*>(ws) + 4;  // misaligned: named (refused before any launch)
    const Status misaligned = attention_forward(p);
    EXPECT_FALSE(misaligned.ok());
    EXPECT_NE(misaligned.message().find("aligned"), std::string::npos) << misaligned.message();
    p.workspace = ws;
    ASSERT_TRUE(attention_forward(p).ok());
    FLARE_CUDA_OK(cudaDeviceSynchronize());
    prob.check_forward();
    p = prob.forward_params(Backend::kHopper);  // poisoned again; no workspace: allocated
    ASSERT_TRUE(attention_forward(p).ok());
    FLARE_CUDA_OK(cudaDeviceSynchronize());
    prob.check_forward();
    FLARE_CUDA_OK(cudaFree(ws));
  };
  for (int d : {128, 256})
    for (int shape = 0; shape < 3; ++shape) run_case(d, shape);
}

// The persistent grid with several tiles a CTA (about 1.7): ragged last tiles whose second
// warpgroup has no rows (946 = 7 x 128 + 50), causal tiles (shifted, sched::row_tile_shift), GQA,
// sinks, soft-capping; against the oracle. (Session 50 overlapped each tile's last P V with the
// next tile's first S GEMM here; it lost and was removed, bench/RESULTS.md.)
TEST(HopperForward, PersistentTilesInTurn) {
  FLARE_REQUIRE_HOPPER();
  int dev = 0, sms = 0;
  FLARE_CUDA_OK(cudaGetDevice(&dev));
  FLARE_CUDA_OK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  // The GPU runs first, case by case (a hang names its case), then the oracles on threads: one
  // case's oracle at d256 takes about a minute on one core.
  std::vector<std::unique_ptr<AttnProblem>> probs;
  uint64_t seed = 9300;
  auto run_case = [&](int d, bool causal) {  // a lambda: FLARE_ASSERT_OK_OR_UNBUILT returns from it
    AttnCase c;
    c.head_dim = d;
    c.batch = 1;
    c.seqlen_q = c.seqlen_k = causal ? 1000 : 946;  // persistent at d64 and d128 (fwd_grid.h), d256 causal
    c.heads = 4 * ((3 * sms + 63) / 64);  // 8 q tiles a head: about 1.7 tiles a CTA
    c.heads_kv = causal ? c.heads : c.heads / 4;
    c.mask.causal = causal;
    c.sinks = !causal;
    c.softcap = causal ? 15.f : 0.f;
    c.dtype = causal ? DType::kFloat16 : DType::kBFloat16;
    c.seed = seed++;
    SCOPED_TRACE(c.name());
    auto prob = std::make_unique<AttnProblem>(c);
    FLARE_ASSERT_OK_OR_UNBUILT(attention_forward(prob->forward_params(Backend::kHopper)));
    FLARE_CUDA_OK(cudaDeviceSynchronize());
    std::fprintf(stderr, "[ persistent ] %s ran\n", c.name().c_str());
    probs.push_back(std::move(prob));
  };
  for (int d : {64, 128, 256})
    for (bool causal : {false, true}) {
      if (reduced() && d != 128) continue;
      run_case(d, causal);
      if (HasFatalFailure()) return;
    }
  std::vector<std::thread> oracles;
  for (auto& p : probs) oracles.emplace_back([&p] { p->run_oracle(); });
  for (auto& t : oracles) t.join();
  for (auto& p : probs) p->check_forward();
}

INSTANTIATE_TEST_SUITE_P(Backends, Forward, ::testing::Values(Backend::kPortable, Backend::kHopper),
                         [](const ::testing::TestParamInfo<Backend>& i) {
                           return i.param == Backend::kHopper ? std::string("Hopper") : std::string("Portable");
                         });

}  // namespace
}  // namespace flare::test
