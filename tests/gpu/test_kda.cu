// The KDA / GDN chunked forward (flare::kda_forward) against the fp64 oracle (reference/kda_ref):
// T in {1, 63, 65, 300} (one token, a chunk minus one, a chunk plus one, several chunks with a
// partial last one); varlen batches with sequences of length 1 and 0; GVA ratio 2; with and
// without an initial state; each in-kernel option (q/k l2norm, beta sigmoid and its 2x variant,
// the default and the bounded gate, with and without A_log / dt_bias); GDN's scalar gate; K and V
// in {64, 128}; bf16 and fp16; fp32 and 16-bit g / beta; int32 and int64 cu_seqlens.
//
// Outputs and the workspace are poisoned (NaN) first, so anything left unwritten fails. Error
// rule (tests/gpu/gpu_harness.h): |gpu - oracle| <= k x |lowp - oracle| + atol, where lowp is
// the chunked WY form computed in fp64 with every intermediate a kernel stores in its input
// dtype rounded to it (flare::ref::kda_forward_chunked with `intermediates`).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "flare/kda.h"
#include "reference/host_tensor.h"
#include "reference/kda_ref.h"
#include "tests/gpu/gpu_harness.h"
#include "tests/gpu/kda_option_cases.h"
#include "tests/gpu/kda_state_slice.h"

namespace flare::test {
namespace {

using ref::HostTensor;

constexpr double kErrFactor = 3.0;  // the kernel rounds a few more operands than the baseline

struct Case {
  std::string name;
  int64_t B = 2, T = 65, H = 2, HV = 2, K = 128, V = 128;
  std::vector<int64_t> seqlens;  // varlen when not empty (B = 1, T = sum)
  DType dtype = DType::kBFloat16;
  DType g_dtype = DType::kFloat32, beta_dtype = DType::kFloat32, cu_dtype = DType::kInt32;
  bool gdn = false, initial_state = false, A_log = true, dt_bias = true;
  bool keep_for_backward = false;  // the training path's forward (the backward's workspace layout)
  KdaOptions options{};
};

// Rows of `len` scaled to unit norm: keeps the delta rule contractive.
void normalize_rows(HostTensor& x, int64_t len) {
  for (int64_t r = 0; r < x.numel(); r += len) {
    double sum = 0;
    for (int64_t c = 0; c < len; ++c) sum += x.get(r + c) * x.get(r + c);
    for (int64_t c = 0; c < len; ++c) x.set(r + c, x.get(r + c) / std::sqrt(sum));
  }
}

struct Problem {
  Case c;
  int64_t N = 0;
  HostTensor q, k, v, g, beta, A_log, dt_bias, h0, cu;

  KdaForwardParams params() const {
    KdaForwardParams p;
    p.q = q, p.k = k, p.v = v, p.g = g, p.beta = beta;
    if (A_log.numel() > 0 && c.options.gate_in_kernel && c.A_log) p.A_log = A_log;
    if (dt_bias.numel() > 0 && c.options.gate_in_kernel && c.dt_bias) p.dt_bias = dt_bias;
    if (c.initial_state) p.initial_state = h0;
    if (!c.seqlens.empty()) p.cu_seqlens = cu;
    p.options = c.options;
    return p;
  }
};

Problem make_problem(Case c, uint64_t seed) {
  std::mt19937_64 rng(seed);
  if (!c.seqlens.empty()) {
    c.B = 1;
    c.T = 0;
    for (int64_t len : c.seqlens) c.T += len;
  }
  Problem p;
  p.N = c.seqlens.empty() ? c.B : static_cast<int64_t>(c.seqlens.size());
  const KdaOptions& o = c.options;
  p.q.reset(c.dtype, {c.B, c.T, c.H, c.K});
  p.k.reset(c.dtype, {c.B, c.T, c.H, c.K});
  p.v.reset(c.dtype, {c.B, c.T, c.HV, c.V});
  p.beta.reset(c.beta_dtype, {c.B, c.T, c.HV});
  if (c.gdn) p.g.reset(c.g_dtype, {c.B, c.T, c.HV});
  else p.g.reset(c.g_dtype, {c.B, c.T, c.HV, c.K});
  p.q.fill_uniform(rng);
  p.k.fill_normal(rng);
  if (!o.qk_l2norm) normalize_rows(p.k, c.K);
  p.v.fill_uniform(rng);
  if (o.gate_in_kernel) p.g.fill_normal(rng);
  else p.g.fill_uniform(rng, -0.5, -0.01);
  if (o.beta_sigmoid) p.beta.fill_normal(rng);
  else p.beta.fill_uniform(rng, 0.1, 0.9);
  p.A_log.reset(DType::kFloat32, {c.HV});
  p.A_log.fill_uniform(rng, -1.0, 0.5);
  p.dt_bias.reset(DType::kFloat32, {c.gdn ? c.HV : c.HV * c.K});
  p.dt_bias.fill_uniform(rng, -0.5, 0.5);
  p.h0.reset(DType::kFloat32, {p.N, c.HV, c.K, c.V});
  p.h0.fill_uniform(rng);
  if (!c.seqlens.empty()) {
    p.cu.reset(c.cu_dtype, {static_cast<int64_t>(c.seqlens.size()) + 1});
    int64_t end = 0;
    p.cu.set(0, 0);
    for (size_t n = 0; n < c.seqlens.size(); ++n) p.cu.set(static_cast<int64_t>(n) + 1, end += c.seqlens[n]);
  }
  p.c = std::move(c);
  return p;
}

class DeviceProblem {
 public:
  explicit DeviceProblem(const Problem& p) {
    for (auto [d, h] : {std::pair{&q, &p.q}, {&k, &p.k}, {&v, &p.v}, {&g, &p.g}, {&beta, &p.beta},
                        {&A_log, &p.A_log}, {&dt_bias, &p.dt_bias}, {&h0, &p.h0}}) {
      d->allocate(*h);
      d->upload(*h);
    }
    if (!p.c.seqlens.empty()) {
      cu.allocate(p.cu);
      cu.upload(p.cu);
    }
  }
  // The host params with every view moved to its device copy.
  KdaForwardParams on_device(KdaForwardParams hp) const {
    auto swap = [](TensorView& t, const DeviceTensor& d) {
      if (t.defined()) t = d.view();
    };
    swap(hp.q, q), swap(hp.k, k), swap(hp.v, v), swap(hp.g, g), swap(hp.beta, beta);
    swap(hp.A_log, A_log), swap(hp.dt_bias, dt_bias), swap(hp.initial_state, h0), swap(hp.cu_seqlens, cu);
    return hp;
  }

 private:
  DeviceTensor q, k, v, g, beta, A_log, dt_bias, h0, cu;
};

void run_case(const Case& c, uint64_t seed = 1) {
  SCOPED_TRACE(c.name);
  const Problem p = make_problem(c, seed);
  const Case& cc = p.c;
  HostTensor out64(DType::kFloat64, {cc.B, cc.T, cc.HV, cc.V}), ht64(DType::kFloat64, {p.N, cc.HV, cc.K, cc.V});
  HostTensor out_lowp(cc.dtype, {cc.B, cc.T, cc.HV, cc.V}), ht_lowp(DType::kFloat64, {p.N, cc.HV, cc.K, cc.V});
  KdaForwardParams hp = p.params();
  hp.out = out64, hp.final_state = ht64;
  ASSERT_TRUE(flare::ref::kda_forward(hp).ok());
  hp.out = out_lowp, hp.final_state = ht_lowp;
  ASSERT_TRUE(flare::ref::kda_forward_chunked(hp, 64, cc.dtype).ok());

  HostTensor out(cc.dtype, {cc.B, cc.T, cc.HV, cc.V}), ht(DType::kFloat32, {p.N, cc.HV, cc.K, cc.V});
  DeviceProblem dp(p);
  DeviceTensor d_out(out), d_ht(ht);
  d_out.poison();
  d_ht.poison();
  KdaForwardParams dparams = dp.on_device(p.params());
  dparams.keep_for_backward = cc.keep_for_backward;
  dparams.out = d_out.view();
  dparams.final_state = d_ht.view();
  size_t bytes = 0;
  const Status ws = kda_forward_workspace_size(dparams, &bytes);
  ASSERT_TRUE(ws.ok()) << ws.message();
  void* workspace = nullptr;
  FLARE_CUDA_OK(cudaMalloc(&workspace, std::max<size_t>(bytes, 256)));
  FLARE_CUDA_OK(cudaMemset(workspace, 0xFF, std::max<size_t>(bytes, 256)));
  dparams.workspace = workspace;
  dparams.workspace_bytes = bytes;
  const Status s = kda_forward(dparams);
  ASSERT_TRUE(s.ok()) << s.message();
  FLARE_CUDA_OK(cudaDeviceSynchronize());
  FLARE_CUDA_OK(cudaFree(workspace));
  d_out.download(out);
  d_ht.download(ht);

  const ErrorReport ro = compare(out, out64, &out_lowp), rh = compare(ht, ht64, &ht_lowp);
  std::printf("  %-32s %s | %s\n", c.name.c_str(), ro.describe("out").c_str(), rh.describe("final").c_str());
  EXPECT_TRUE(within_tolerance(ro, "out", kErrFactor, 1e-4));
  EXPECT_TRUE(within_tolerance(rh, "final_state", kErrFactor, 1e-4));
}

TEST(KdaForward, LengthsAroundTheChunk) {
  FLARE_REQUIRE_GPU();
  for (int64_t T : {1, 63, 65, 300})
    for (bool h0 : {false, true}) {
      Case c;
      c.name = "T" + std::to_string(T) + (h0 ? " h0" : "");
      c.T = T;
      c.initial_state = h0;
      run_case(c, 10 + T);
    }
}

TEST(KdaForward, HeadDims) {
  FLARE_REQUIRE_GPU();
  for (int64_t K : {64, 128})
    for (int64_t V : {64, 128}) {
      Case c;
      c.name = "K" + std::to_string(K) + " V" + std::to_string(V);
      c.K = K, c.V = V, c.T = 130, c.initial_state = true;
      run_case(c, 20 + K + V);
    }
}

// Every value-slice width of the state pass (the heuristic takes the widest that fills the GPU,
// so the small cases above see only the narrow ones), forced through FLARE_KDA_STATE_BV.
TEST(KdaForward, StateSliceWidths) {
  FLARE_REQUIRE_GPU();
  with_each_state_slice_width({16, 32, 64, 128}, [](int bv) {
    Case c;
    c.name = "BV " + std::to_string(bv);
    c.T = 300, c.HV = 4, c.H = 2, c.initial_state = true;
    run_case(c, 40 + bv);
  });
}

// The segmented state pass (kda_state_segments.h: segment 0 beside the transitions, the combine,
// the other segments), which the heuristic takes only for batches that leave SMs idle: forced
// through FLARE_KDA_STATE_SEGMENT (chunks per segment) at 1, 2 and 3 chunks (the last segment
// short), at each value-slice width, with and without an initial state, KDA, GDN and K 64 / V 128.
TEST(KdaForward, SegmentedStatePass) {
  FLARE_REQUIRE_GPU();
  // FLARE_TEST_REDUCED (the sanitizer runs, where this test took 80 s of racecheck): 1 and 3
  // chunks per segment, two slice widths, the long sequence once by the rule and once forced.
  const std::vector<int> chunk_counts = reduced() ? std::vector<int>{1, 3} : std::vector<int>{1, 2, 3};
  const std::vector<int> widths = reduced() ? std::vector<int>{32, 128} : std::vector<int>{16, 32, 64, 128};
  for (int chunks : chunk_counts) {
    ASSERT_EQ(setenv("FLARE_KDA_STATE_SEGMENT", std::to_string(chunks).c_str(), 1), 0);
    SCOPED_TRACE("FLARE_KDA_STATE_SEGMENT=" + std::to_string(chunks));
    with_each_state_slice_width(widths, [&](int bv) {
      Case c;
      c.name = "segments of " + std::to_string(chunks) + ", BV " + std::to_string(bv);
      c.T = 300, c.HV = 4, c.H = 2, c.initial_state = bv != 64;
      run_case(c, 60 + chunks * 8 + bv);
    });
    Case gdn;
    gdn.name = "GDN K64 segments of " + std::to_string(chunks);
    gdn.gdn = true, gdn.K = 64, gdn.B = 1, gdn.T = 257, gdn.initial_state = true;
    run_case(gdn, 90 + chunks);
  }
  unsetenv("FLARE_KDA_STATE_SEGMENT");
  // The rule's own choice (one sequence of 48 chunks, 2 value heads: 3 segments of 16), plain and
  // in the training path's forward (its arrays then live in the backward's dh array); forced to
  // 4 segments of 12 there too.
  Case rule;
  rule.B = 1, rule.T = 3072 - 17, rule.HV = 2, rule.initial_state = true;
  for (bool keep : {false, true}) {
    if (keep && reduced()) continue;
    rule.keep_for_backward = keep;
    rule.name = std::string("long sequence") + (keep ? ", kept" : "");
    run_case(rule, 97);
  }
  ASSERT_EQ(setenv("FLARE_KDA_STATE_SEGMENT", "12", 1), 0);
  rule.name = "long sequence, kept, 4 segments";
  run_case(rule, 98);
  unsetenv("FLARE_KDA_STATE_SEGMENT");
  // Segment 0 weighted (FLARE_KDA_SEGMENT0_WEIGHT, kda_segments_weighted): longer and shorter than
  // the others, by the rule's count.
  rule.keep_for_backward = false;
  for (const char* weight : {"160", "50"}) {
    ASSERT_EQ(setenv("FLARE_KDA_SEGMENT0_WEIGHT", weight, 1), 0);
    rule.name = std::string("long sequence, segment 0 weighted ") + weight + " %";
    run_case(rule, 99);
  }
  unsetenv("FLARE_KDA_SEGMENT0_WEIGHT");
}

// Both forms of the state passes at the wide slices, where an sm_90 device takes the wgmma one (64-
// and 128-column slices; the transitions but at K = V = 128) and FLARE_KDA_STATE_GMMA=0 the
// portable (mma.sync) one: each head-dim pair at both widths, and the segmented pass.
TEST(KdaForward, StatePassForms) {
  FLARE_REQUIRE_GPU();
  for (const char* gmma : {"1", "0"}) {
    ASSERT_EQ(setenv("FLARE_KDA_STATE_GMMA", gmma, 1), 0);
    const std::string form = gmma[0] == '1' ? "wgmma" : "portable";
    for (int64_t K : {64, 128})
      for (int64_t V : {64, 128})
        with_each_state_slice_width({64, 128}, [&](int bv) {
          if (bv > V) return;
          Case c;
          c.name = form + " K" + std::to_string(K) + " V" + std::to_string(V) + " BV " + std::to_string(bv);
          c.K = K, c.V = V, c.T = 200, c.HV = 4, c.H = 2, c.initial_state = true;
          run_case(c, 100 + K + V + bv);
          ASSERT_EQ(setenv("FLARE_KDA_STATE_SEGMENT", "2", 1), 0);
          c.name += ", segments of 2";
          run_case(c, 101 + K + V + bv);
          unsetenv("FLARE_KDA_STATE_SEGMENT");
        });
  }
  unsetenv("FLARE_KDA_STATE_GMMA");
}

TEST(KdaForward, GroupedValueHeads) {
  FLARE_REQUIRE_GPU();
  Case c;
  c.name = "GVA 2";
  c.H = 2, c.HV = 4, c.T = 100, c.initial_state = true;
  run_case(c, 3);
}

TEST(KdaForward, Varlen) {
  FLARE_REQUIRE_GPU();
  Case c;
  c.name = "varlen int32";
  c.seqlens = {1, 0, 130, 64, 7, 65};
  c.initial_state = true;
  run_case(c, 4);
  c.name = "varlen int64 no h0";
  c.cu_dtype = DType::kInt64;
  c.initial_state = false;
  c.seqlens = {0, 300, 1};
  run_case(c, 5);
}

TEST(KdaForward, InKernelOptions) {
  FLARE_REQUIRE_GPU();
  Case base;
  base.T = 100;
  base.initial_state = true;
  const std::vector<KdaOptionCase> cases = kda_option_cases();
  for (size_t i = 0; i < cases.size(); ++i) run_case(with_option_case(base, cases[i]), 6 + i);
}

TEST(KdaForward, GatedDeltaRule) {
  FLARE_REQUIRE_GPU();
  Case c;
  c.name = "GDN";
  c.gdn = true, c.T = 200, c.initial_state = true;
  run_case(c, 15);
  c.name = "GDN gate in kernel varlen";
  c.options.gate_in_kernel = true;
  c.seqlens = {70, 0, 1, 129};
  run_case(c, 16);
}

TEST(KdaForward, Dtypes) {
  FLARE_REQUIRE_GPU();
  Case c;
  c.name = "fp16";
  c.dtype = DType::kFloat16, c.T = 130, c.initial_state = true;
  run_case(c, 17);
  c.name = "bf16 g and beta";
  c.dtype = DType::kBFloat16, c.g_dtype = c.beta_dtype = DType::kBFloat16;
  run_case(c, 18);
}

TEST(KdaForward, Arguments) {
  FLARE_REQUIRE_GPU();
  Case c;
  c.K = 96, c.T = 10;
  Problem p = make_problem(c, 19);
  DeviceProblem dp(p);
  HostTensor out(c.dtype, {c.B, c.T, c.HV, c.V});
  DeviceTensor d_out(out);
  KdaForwardParams params = dp.on_device(p.params());
  params.out = d_out.view();
  size_t bytes = 0;
  EXPECT_EQ(kda_forward_workspace_size(params, &bytes).code(), StatusCode::kNotSupported);

  Case ok;
  ok.T = 10;
  Problem p2 = make_problem(ok, 20);
  DeviceProblem dp2(p2);
  DeviceTensor d_out2(out);
  params = dp2.on_device(p2.params());
  params.out = d_out2.view();
  ASSERT_TRUE(kda_forward_workspace_size(params, &bytes).ok());
  EXPECT_GT(bytes, 0u);
  EXPECT_EQ(kda_forward(params).code(), StatusCode::kInvalidArgument);  // no workspace
}

}  // namespace
}  // namespace flare::test
