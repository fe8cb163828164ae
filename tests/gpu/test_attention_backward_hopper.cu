// The Hopper attention backward against the CPU oracle, ordinary and deterministic: head dims up to
// 128 and 256 (the split tiling), every mask, GQA/MQA, seqlen_q != seqlen_k, varlen with empty and
// one-token sequences, attention sinks; the deterministic mode's bitwise reproducibility.
// (Soft-capping and other head dims run the portable backward: test_attention_backward.)
// FLARE_TEST_REDUCED=1 runs a small subset.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "flare_instantiated.h"
#include "tests/gpu/attention_case.h"
#include "tests/gpu/instantiated_dims.h"
#include "tests/gpu/unbuilt.h"
#include "src/attention/hopper/bwd_config.h"
#include "src/scheduling/tail_split.h"

namespace flare::test {
namespace {



void run_backward(const AttnCase& c, bool deterministic, Backend forward = Backend::kAuto) {
  SCOPED_TRACE(c.name() + (deterministic ? " deterministic" : ""));
  AttnProblem prob(c);
  AttentionForwardParams f = prob.forward_params(forward);
  FLARE_ASSERT_OK_OR_UNBUILT(attention_forward(f));
  AttentionBackwardParams b = prob.backward_params(Backend::kHopper, deterministic);  // draws dout
  prob.run_backward_oracle(nullptr, prob.stored_out());
  prob.poison_workspace(b);
  FLARE_ASSERT_OK_OR_UNBUILT(attention_backward(b));
  FLARE_CUDA_OK(cudaDeviceSynchronize());
  prob.check_backward();
}

#ifdef FLARE_HAS_HOPPER
TEST(HopperBackward, Sweep) {
  FLARE_REQUIRE_HOPPER();
  uint64_t seed = 6000;
  for (int d : {64, 80, 96, 128, 256})
    for (int li = 0; li < kBackwardSweepCases; ++li) {
#ifndef FLARE_HAS_HEAD_DIM_256
      if (d == 256) continue;
#endif
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

#ifdef FLARE_HAS_HEAD_DIM_256
// Head dim 256 runs the split tiling (64 keys a CTA, the head dim halved between warpgroups).
TEST(HopperBackward, HeadDim256MasksRatiosSinksVarlen) {
  FLARE_REQUIRE_HOPPER();
  uint64_t seed = 6800;
  for (const MaskParams& m : kSweepMasks)
    for (int ratio : {1, 4}) {
      AttnCase c = mask_ratio_case(m, ratio, seed++);
      c.head_dim = 256;
      c.dtype = ratio == 4 ? DType::kFloat16 : DType::kBFloat16;
      run_backward(c, ratio == 4);
      if (reduced()) return;
    }
  run_backward(varlen_sinks_case(256, 2, MaskParams{true, -1, -1}, 6900), true);
  run_backward(varlen_sinks_case(256, 4, MaskParams{false, 50, 10}, 6901), false);
}
#endif

TEST(HopperBackward, SinksVarlen) {
  FLARE_REQUIRE_HOPPER();
  for (int d : {64, 128}) {
    const AttnCase c = varlen_sinks_case(d, 2, MaskParams{true, -1, -1}, 7000 + d);
    run_backward(c, false, Backend::kPortable);
    run_backward(c, d == 128, Backend::kAuto);
  }
}

// The ordinary grid's last tiles split into parts (sched::tail_split): a few tiles more than the
// SMs, so the last round is ragged. The parts add partial dK/dV into fp32 (a tail buffer without
// GQA, the GQA accumulators with it) and a kernel converts them; ragged key blocks and query steps.
TEST(HopperBackward, TailTilesSplitIntoParts) {
  FLARE_REQUIRE_HOPPER();
  int dev = 0, sms = 0;
  FLARE_CUDA_OK(cudaGetDevice(&dev));
  FLARE_CUDA_OK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  struct Split {
    int head_dim, ratio, extra_tiles;
    DType dtype;
  };
  uint64_t seed = 8500;
  for (const Split& t : {Split{64, 1, 3, DType::kBFloat16}, Split{128, 1, 5, DType::kFloat16},
                         Split{128, 4, 4, DType::kBFloat16}, Split{256, 1, 6, DType::kBFloat16}}) {
#ifndef FLARE_HAS_HEAD_DIM_256
    if (t.head_dim == 256) continue;
#endif
    if (reduced() && t.head_dim != 128) continue;
    AttnCase c;
    c.head_dim = t.head_dim;
    c.seqlen_q = 1500;  // 12 (d64) or 24 query steps, the last ragged
    c.seqlen_k = hopper::hopper_bwd_block_n(t.head_dim) - 27;  // one ragged key block a head
    c.heads = sms + t.extra_tiles + (t.ratio - (sms + t.extra_tiles) % t.ratio) % t.ratio;
    c.heads_kv = c.heads / t.ratio;
    c.dtype = t.dtype;
    c.seed = seed++;
    const int step_rows = hopper::hopper_bwd_block_m(t.head_dim);
    ASSERT_TRUE(sched::tail_split(c.heads, (c.seqlen_q + step_rows - 1) / step_rows, sms).active()) << c.name();
    run_backward(c, false);
  }
}

TEST(HopperBackward, DeterministicIsBitwiseReproducible) {
  FLARE_REQUIRE_HOPPER();
  // Some have more tiles than the H100 holds at once (4 x 16 heads x 32 kv blocks at d128): the
  // rotated walks' residency rounds and several tiles per semaphore in flight. Head dim 256 runs the
  // split tiling, whose dQ halves have a turn chain each.
  struct Det {
    MaskParams mask;
    int head_dim, ratio, seqlen, heads, batch;
  };
  for (const Det& d : {Det{MaskParams{}, 128, 1, 1000, 8, 2}, Det{MaskParams{true, -1, -1}, 128, 4, 1000, 8, 2},
                       Det{MaskParams{false, 300, 0}, 64, 2, 1000, 8, 2}, Det{MaskParams{}, 128, 1, 4096, 16, 4},
                       Det{MaskParams{true, -1, -1}, 64, 2, 4096, 16, 4}, Det{MaskParams{}, 256, 3, 2000, 6, 2},
                       Det{MaskParams{true, -1, -1}, 256, 1, 3000, 8, 2}}) {
    if (reduced() && d.seqlen > 1000) continue;
#ifndef FLARE_HAS_HEAD_DIM_256
    if (d.head_dim == 256) continue;
#endif
    const MaskParams mask = d.mask;
    const int ratio = d.ratio;
    AttnCase c;
    c.head_dim = d.head_dim;
    c.seqlen_q = c.seqlen_k = d.seqlen;
    c.heads = d.heads;
    c.heads_kv = d.heads / ratio;
    c.batch = d.batch;
    c.mask = mask;
    c.seed = 8000 + ratio;
    expect_bitwise_reproducible(c, Backend::kHopper, reduced() ? 2 : 20);
  }
}

// The Hopper backward's tilings' head dims that this build instantiates (64, 128, 256).
std::vector<int> built_hopper_bwd_dims() {
  std::vector<int> dims;
  for (int d : instantiated_head_dims())
    if (d == 64 || d == 128 || d == 256) dims.push_back(d);
  return dims;
}

// The deterministic mode's dQ accumulator in 1-3 copies (sched::dq_replica_turn; the planner picks
// by head dim and keys, FLARE_HOPPER_BWD_DQ_REPLICAS forces a count): each count against the oracle
// and bitwise reproducible, at every built head dim, causal and not, with GQA, ragged lengths.
TEST(HopperBackward, DeterministicDqReplicas) {
  FLARE_REQUIRE_HOPPER();
  uint64_t seed = 8700;
  for (int d : built_hopper_bwd_dims())
    for (int replicas : {1, 2, 3}) {
      if (reduced() && replicas != 2) continue;
      ASSERT_EQ(setenv("FLARE_HOPPER_BWD_DQ_REPLICAS", std::to_string(replicas).c_str(), 1), 0);
      for (const MaskParams& m : {MaskParams{}, MaskParams{true, -1, -1}}) {
        AttnCase c = mask_ratio_case(m, m.causal ? 4 : 1, seed++);
        c.head_dim = d;
        c.seqlen_q = 700, c.seqlen_k = 900;
        SCOPED_TRACE("dQ copies " + std::to_string(replicas));
        run_backward(c, true);
        expect_bitwise_reproducible(c, Backend::kHopper, 3);
      }
    }
  unsetenv("FLARE_HOPPER_BWD_DQ_REPLICAS");
}

// The deterministic grid's turn orders for banded work (hopper_bwd_det_scheme): shortest first,
// longest first (sched::DqScheme::kLongestFirst) and shortest first with the last waves' heads longest first
// (kShortestTail), each against the oracle and bitwise reproducible: causal with GQA and more tiles
// than the GPU holds at once, windows, seqlen_q != seqlen_k, varlen.
TEST(HopperBackward, DeterministicTurnOrders) {
  FLARE_REQUIRE_HOPPER();
  uint64_t seed = 8800;
  for (const char* order : {"shortest", "longest", "tail"}) {
    ASSERT_EQ(setenv("FLARE_HOPPER_BWD_DET_ORDER", order, 1), 0);
    SCOPED_TRACE(std::string("turn order ") + order);
    for (int d : built_hopper_bwd_dims()) {
      AttnCase big;
      big.head_dim = d, big.seqlen_q = big.seqlen_k = reduced() ? 1000 : 3000;
      big.heads = 16, big.heads_kv = 4, big.batch = 2, big.mask = MaskParams{true, -1, -1}, big.seed = seed++;
      run_backward(big, true);
      expect_bitwise_reproducible(big, Backend::kHopper, reduced() ? 2 : 5);
      if (reduced()) continue;
      for (const MaskParams& m : {MaskParams{false, 300, 0}, MaskParams{false, 100, 50}, MaskParams{true, 200, -1}}) {
        AttnCase c = mask_ratio_case(m, 2, seed++);
        c.head_dim = d, c.seqlen_q = 700, c.seqlen_k = 900;
        run_backward(c, true);
        expect_bitwise_reproducible(c, Backend::kHopper, 3);
      }
      run_backward(varlen_sinks_case(d, 2, MaskParams{true, -1, -1}, seed++), true);
    }
  }
  unsetenv("FLARE_HOPPER_BWD_DET_ORDER");
}

// Outside its scope (soft-capping; head dims other than <= 128 and 256) a forced Hopper backward
// refuses with a reason and kAuto runs the portable one, whose result is checked.
TEST(HopperBackward, FallsBackOrRefusesOutsideItsScope) {
  FLARE_REQUIRE_HOPPER();
  std::vector<AttnCase> cases;
  AttnCase capped;
  capped.head_dim = 128;
  capped.seqlen_q = capped.seqlen_k = 100;
  capped.softcap = 30.f;
  cases.push_back(capped);
#ifdef FLARE_HAS_HEAD_DIM_192
  AttnCase d192;
  d192.head_dim = 192;
  d192.seqlen_q = d192.seqlen_k = 64;
  cases.push_back(d192);
#endif
  for (const AttnCase& c : cases) {
    SCOPED_TRACE(c.name());
    AttnProblem prob(c);
    const Status fwd = attention_forward(prob.forward_params(Backend::kAuto));
    if (unbuilt(fwd)) continue;  // a reduced build without the case's head dim
    ASSERT_TRUE(fwd.ok()) << fwd.message();
    AttentionBackwardParams forced = prob.backward_params(Backend::kHopper, false);
    const Status refused = attention_backward(forced);
    EXPECT_EQ(refused.code(), StatusCode::kNotSupported) << refused.message();
    AttentionBackwardParams automatic = prob.backward_params(Backend::kAuto, true);
    prob.run_backward_oracle(nullptr, prob.stored_out());
    const Status ran = attention_backward(automatic);
    ASSERT_TRUE(ran.ok()) << ran.message();
    FLARE_CUDA_OK(cudaDeviceSynchronize());
    prob.check_backward();
  }
}
#endif

}  // namespace
}  // namespace flare::test
