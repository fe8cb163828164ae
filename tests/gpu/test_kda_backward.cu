// The KDA / GDN chunked backward (flare::kda_backward) against the fp64 oracle
// (flare::ref::kda_backward, the exact recurrence's reverse mode): every gradient (dq, dk, dv, dg,
// dbeta, d_initial_state, dA_log, ddt_bias) for T in {1, 63, 65, 300}; with and without an
// initial state and a d_final_state seed; varlen batches with sequences of length 0 and 1 (int32
// and int64 cu_seqlens); GVA ratio 2; each in-kernel option (q/k l2norm, beta sigmoid and its 2x
// variant, the default and the bounded gate, with and without A_log / dt_bias); GDN's scalar gate;
// K and V in {64, 128}; bf16 and fp16; 16-bit g / beta and their gradients; strided inputs.
//
// Outputs and the workspace are poisoned (NaN) first, so anything left unwritten fails. Error
// rule (tests/gpu/gpu_harness.h): |gpu - oracle| <= 4 |lowp - oracle| + atol per gradient, where
// lowp is the same chunked algorithm in fp64 with what the kernels keep in their input dtype
// rounded to it (flare::ref::kda_backward_chunked with `intermediates`), written in the GPU
// outputs' dtypes, and atol is 1e-4 of the gradient's largest magnitude (one unit of the dtype
// for the sums dA_log and ddt_bias). tests/cpu/test_kda_backward_emulated.cpp runs the same
// kernels on the CPU under an emulation of the warp-level operations.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "flare/kda.h"
#include "reference/host_tensor.h"
#include "reference/kda_ref.h"
#include "tests/common/status_checks.h"
#include "tests/gpu/gpu_harness.h"
#include "tests/gpu/kda_option_cases.h"
#include "tests/gpu/kda_state_slice.h"

namespace flare::test {
namespace {

using ref::HostTensor;

constexpr double kErrFactor = 4.0;  // the kernels round a few more operands than the baseline

// The absolute slack, relative to the gradient's largest magnitude: 1e-4, and for dA_log and
// ddt_bias, sums over every token whose baseline error can cancel by luck, one unit of the dtype.
double abs_slack(const std::string& name, DType dtype) {
  if (name != "dA_log" && name != "ddt_bias") return 1e-4;
  return dtype == DType::kBFloat16 ? 0x1p-8 : 0x1p-11;
}

struct Case {
  std::string name;
  int64_t B = 2, T = 65, H = 2, HV = 2, K = 128, V = 128;
  std::vector<int64_t> seqlens;  // varlen when not empty (B = 1, T = sum)
  DType dtype = DType::kBFloat16;
  DType g_dtype = DType::kFloat32, beta_dtype = DType::kFloat32, cu_dtype = DType::kInt32;
  DType dg_dtype = DType::kFloat32, dbeta_dtype = DType::kFloat32;
  bool gdn = false, initial_state = true, d_final_state = true, A_log = true, dt_bias = true;
  bool strided = false;  // q, k, v, dout, dq, dk, dv with a padded token stride
  KdaOptions options{};
};

// A view of the first `inner` elements of each token row of a [B, T, H, pad] tensor: [B, T, H, D].
TensorView narrowed(const TensorView& padded, int64_t D) {
  TensorView v = padded;
  v.shape[3] = D;
  return v;
}

// Inputs, seeds and the shapes of the gradients. Tensors that may be strided are allocated with
// `pad` extra elements per head row and viewed narrowed.
struct Problem {
  Case c;
  int64_t N = 0, pad = 0;
  HostTensor q, k, v, g, beta, A_log, dt_bias, h0, cu, dout, dht;

  TensorView qk_view(const HostTensor& x) const { return narrowed(x.view(), c.K); }
  TensorView v_view(const HostTensor& x) const { return narrowed(x.view(), c.V); }

  KdaBackwardParams params() const {
    KdaBackwardParams p;
    p.q = qk_view(q), p.k = qk_view(k), p.v = v_view(v), p.g = g, p.beta = beta;
    if (c.options.gate_in_kernel && c.A_log) p.A_log = A_log;
    if (c.options.gate_in_kernel && c.dt_bias) p.dt_bias = dt_bias;
    if (c.initial_state) p.initial_state = h0;
    if (!c.seqlens.empty()) p.cu_seqlens = cu;
    p.dout = v_view(dout);
    if (c.d_final_state) p.d_final_state = dht;
    p.options = c.options;
    return p;
  }
};

void fill_padded(HostTensor& x, std::mt19937_64& rng, bool normal) {
  if (normal) x.fill_normal(rng);
  else x.fill_uniform(rng);
}

void make_problem(Case c, uint64_t seed, Problem* p) {
  std::mt19937_64 rng(seed);
  if (!c.seqlens.empty()) {
    c.B = 1, c.T = 0;
    for (int64_t len : c.seqlens) c.T += len;
  }
  p->N = c.seqlens.empty() ? c.B : static_cast<int64_t>(c.seqlens.size());
  p->pad = c.strided ? 8 : 0;
  const KdaOptions& o = c.options;
  p->q.reset(c.dtype, {c.B, c.T, c.H, c.K + p->pad});
  p->k.reset(c.dtype, {c.B, c.T, c.H, c.K + p->pad});
  p->v.reset(c.dtype, {c.B, c.T, c.HV, c.V + p->pad});
  p->dout.reset(c.dtype, {c.B, c.T, c.HV, c.V + p->pad});
  p->beta.reset(c.beta_dtype, {c.B, c.T, c.HV});
  if (c.gdn) p->g.reset(c.g_dtype, {c.B, c.T, c.HV});
  else p->g.reset(c.g_dtype, {c.B, c.T, c.HV, c.K});
  fill_padded(p->q, rng, false);
  fill_padded(p->k, rng, true);
  if (!o.qk_l2norm) {  // unit rows over the K used elements
    for (int64_t r = 0; r < p->k.numel(); r += c.K + p->pad) {
      double sum = 0;
      for (int64_t e = 0; e < c.K; ++e) sum += p->k.get(r + e) * p->k.get(r + e);
      for (int64_t e = 0; e < c.K; ++e) p->k.set(r + e, p->k.get(r + e) / std::sqrt(sum));
    }
  }
  fill_padded(p->v, rng, false);
  fill_padded(p->dout, rng, false);
  if (o.gate_in_kernel) p->g.fill_normal(rng);
  else p->g.fill_uniform(rng, -0.5, -0.01);
  if (o.beta_sigmoid) p->beta.fill_normal(rng);
  else p->beta.fill_uniform(rng, 0.1, 0.9);
  p->A_log.reset(DType::kFloat32, {c.HV});
  p->A_log.fill_uniform(rng, -1.0, 0.5);
  p->dt_bias.reset(DType::kFloat32, {c.gdn ? c.HV : c.HV * c.K});
  p->dt_bias.fill_uniform(rng, -0.5, 0.5);
  p->h0.reset(DType::kFloat32, {p->N, c.HV, c.K, c.V});
  p->h0.fill_uniform(rng);
  p->dht.reset(DType::kFloat32, {p->N, c.HV, c.K, c.V});
  p->dht.fill_uniform(rng);
  if (!c.seqlens.empty()) {
    p->cu.reset(c.cu_dtype, {static_cast<int64_t>(c.seqlens.size()) + 1});
    int64_t end = 0;
    p->cu.set(0, 0);
    for (size_t n = 0; n < c.seqlens.size(); ++n) p->cu.set(static_cast<int64_t>(n) + 1, end += c.seqlens[n]);
  }
  p->c = std::move(c);
}

// The gradients of one run, in given dtypes. dq, dk, dv are allocated padded like their inputs.
struct Grads {
  int64_t pad = 0, K = 0, V = 0;
  HostTensor dq, dk, dv, dg, dbeta, dh0, dA_log, ddt_bias;

  Grads(const Problem& p, DType qkv, DType dg_dtype, DType dbeta_dtype, DType fp32) : pad(p.pad), K(p.c.K), V(p.c.V) {
    const Case& c = p.c;
    dq.reset(qkv, {c.B, c.T, c.H, c.K + pad});
    dk.reset(qkv, {c.B, c.T, c.H, c.K + pad});
    dv.reset(qkv, {c.B, c.T, c.HV, c.V + pad});
    if (c.gdn) dg.reset(dg_dtype, {c.B, c.T, c.HV});
    else dg.reset(dg_dtype, {c.B, c.T, c.HV, c.K});
    dbeta.reset(dbeta_dtype, {c.B, c.T, c.HV});
    if (c.initial_state) dh0.reset(fp32, {p.N, c.HV, c.K, c.V});
    if (c.options.gate_in_kernel && c.A_log) dA_log.reset(fp32, {c.HV});
    if (c.options.gate_in_kernel && c.dt_bias) ddt_bias.reset(fp32, {c.gdn ? c.HV : c.HV * c.K});
  }
  // The output views of `params` (host tensors; the GPU run swaps in device copies).
  void attach(KdaBackwardParams* p) const {
    p->dq = narrowed(dq.view(), K), p->dk = narrowed(dk.view(), K), p->dv = narrowed(dv.view(), V);
    p->dg = dg, p->dbeta = dbeta;
    if (dh0.view().defined()) p->d_initial_state = dh0;
    if (dA_log.view().defined()) p->dA_log = dA_log;
    if (ddt_bias.view().defined()) p->ddt_bias = ddt_bias;
  }
  std::vector<std::pair<const char*, const HostTensor*>> named() const {
    std::vector<std::pair<const char*, const HostTensor*>> all = {
        {"dq", &dq}, {"dk", &dk}, {"dv", &dv}, {"dg", &dg}, {"dbeta", &dbeta}};
    if (dh0.view().defined()) all.push_back({"d_initial_state", &dh0});
    if (dA_log.view().defined()) all.push_back({"dA_log", &dA_log});
    if (ddt_bias.view().defined()) all.push_back({"ddt_bias", &ddt_bias});
    return all;
  }
};

// A tensor's elements without the padding of its rows (the padding is never written).
HostTensor unpadded(const HostTensor& x, int64_t used, int64_t pad) {
  if (pad == 0) return HostTensor();  // the caller compares x itself
  const TensorView& v = x.view();
  std::vector<int64_t> shape(v.shape, v.shape + v.rank);
  shape.back() = used;
  HostTensor y(v.dtype, shape);
  for (int64_t i = 0; i < y.numel(); ++i) y.set(i, x.get(i / used * (used + pad) + i % used));
  return y;
}

// Device copies of every host tensor of a params struct, and the params pointing at them.
class DeviceParams {
 public:
  explicit DeviceParams(const KdaBackwardParams& host, std::vector<const HostTensor*> owners) {
    params_ = host;
    for (TensorView* t : views(&params_)) {
      if (!t->defined()) continue;
      const HostTensor* owner = nullptr;
      for (const HostTensor* h : owners)
        if (h->view().data == t->data) owner = h;
      if (owner == nullptr) continue;  // stays a host view (a test of the device rule)
      buffers_.emplace_back(new DeviceTensor(*owner));
      buffers_.back()->upload(*owner);
      const TensorView whole = buffers_.back()->view();
      TensorView d = *t;
      d.data = whole.data;
      d.device = whole.device;
      *t = d;
      map_.push_back({owner, buffers_.back().get()});
    }
  }
  KdaBackwardParams& params() { return params_; }
  void poison_outputs() {
    for (TensorView* t : output_views(&params_))
      if (t->defined()) cudaMemset(t->data, 0xFF, find(t->data)->view().numel() * dtype_size(t->dtype));
  }
  void download(HostTensor* h) const {
    for (const auto& [owner, dev] : map_)
      if (owner == h) dev->download(*h);
  }

 private:
  static std::vector<TensorView*> views(KdaBackwardParams* p) {
    return {&p->q, &p->k, &p->v, &p->g, &p->beta, &p->A_log, &p->dt_bias, &p->initial_state, &p->cu_seqlens,
            &p->dout, &p->d_final_state, &p->dq, &p->dk, &p->dv, &p->dg, &p->dbeta, &p->d_initial_state,
            &p->dA_log, &p->ddt_bias};
  }
  static std::vector<TensorView*> output_views(KdaBackwardParams* p) {
    return {&p->dq, &p->dk, &p->dv, &p->dg, &p->dbeta, &p->d_initial_state, &p->dA_log, &p->ddt_bias};
  }
  const DeviceTensor* find(const void* data) const {
    for (const auto& [owner, dev] : map_)
      if (dev->view().data == data) return dev;
    return nullptr;
  }
  KdaBackwardParams params_;
  std::vector<std::unique_ptr<DeviceTensor>> buffers_;
  std::vector<std::pair<const HostTensor*, DeviceTensor*>> map_;
};

std::vector<const HostTensor*> all_tensors(const Problem& p, const Grads& g) {
  return {&p.q, &p.k, &p.v, &p.g, &p.beta, &p.A_log, &p.dt_bias, &p.h0, &p.cu, &p.dout, &p.dht,
          &g.dq, &g.dk, &g.dv, &g.dg, &g.dbeta, &g.dh0, &g.dA_log, &g.ddt_bias};
}

// Runs kda_backward on the device with poisoned outputs and workspace; with from_forward, first
// kda_forward with keep_for_backward into that workspace, and the backward reads what it kept.
void run_gpu(const Problem& p, Grads* out, bool from_forward = false) {
  KdaBackwardParams hp = p.params();
  out->attach(&hp);
  DeviceParams dp(hp, all_tensors(p, *out));
  dp.poison_outputs();
  KdaBackwardParams& params = dp.params();
  size_t bytes = 0;
  const Status ws = kda_backward_workspace_size(params, &bytes);
  ASSERT_TRUE(ws.ok()) << ws.message();
  void* workspace = nullptr;
  FLARE_CUDA_OK(cudaMalloc(&workspace, std::max<size_t>(bytes, 256)));
  FLARE_CUDA_OK(cudaMemset(workspace, 0xFF, std::max<size_t>(bytes, 256)));
  params.workspace = workspace;
  params.workspace_bytes = bytes;
  std::unique_ptr<DeviceTensor> fwd_out;
  if (from_forward) {
    KdaForwardParams f;
    f.q = params.q, f.k = params.k, f.v = params.v, f.g = params.g, f.beta = params.beta;
    f.A_log = params.A_log, f.dt_bias = params.dt_bias, f.initial_state = params.initial_state;
    f.cu_seqlens = params.cu_seqlens, f.options = params.options;
    const TensorView& v = params.v;
    fwd_out = std::make_unique<DeviceTensor>(HostTensor(params.q.dtype, {v.shape[0], v.shape[1], v.shape[2], v.shape[3]}));
    f.out = fwd_out->view();
    f.keep_for_backward = true;
    size_t fwd_bytes = 0;
    ASSERT_TRUE(kda_forward_workspace_size(f, &fwd_bytes).ok());
    ASSERT_EQ(fwd_bytes, bytes) << "the kept forward's workspace is the backward's";
    f.workspace = workspace, f.workspace_bytes = bytes;
    const Status fs = kda_forward(f);
    ASSERT_TRUE(fs.ok()) << fs.message();
    params.workspace_from_forward = true;
  }
  const Status s = kda_backward(params);
  ASSERT_TRUE(s.ok()) << s.message();
  FLARE_CUDA_OK(cudaDeviceSynchronize());
  FLARE_CUDA_OK(cudaFree(workspace));
  for (const auto& [name, t] : out->named()) dp.download(const_cast<HostTensor*>(t));
}

void run_case(const Case& c, uint64_t seed = 1) {
  SCOPED_TRACE(c.name);
  Problem p;
  make_problem(c, seed, &p);
  const Case& cc = p.c;
  const DType f64 = DType::kFloat64;
  Grads want(p, f64, f64, f64, f64), lowp(p, cc.dtype, cc.dg_dtype, cc.dbeta_dtype, DType::kFloat32);
  Grads got(p, cc.dtype, cc.dg_dtype, cc.dbeta_dtype, DType::kFloat32);
  KdaBackwardParams hp = p.params();
  want.attach(&hp);
  Status st = ref::kda_backward(hp);
  ASSERT_TRUE(st.ok()) << st.message();
  hp = p.params();
  lowp.attach(&hp);
  const Status st_lowp = ref::kda_backward_chunked(hp, 64, cc.dtype);
  ASSERT_TRUE(st_lowp.ok()) << st_lowp.message();
  run_gpu(p, &got);

  const auto w = want.named(), l = lowp.named(), g = got.named();
  ASSERT_EQ(w.size(), g.size());
  std::printf("  %s\n", c.name.c_str());
  for (size_t i = 0; i < w.size(); ++i) {
    const char* name = w[i].first;
    const bool padded = p.pad > 0 && (i < 3);  // dq, dk, dv
    const int64_t used = i == 2 ? cc.V : cc.K;
    const HostTensor w_u = padded ? unpadded(*w[i].second, used, p.pad) : HostTensor();
    const HostTensor l_u = padded ? unpadded(*l[i].second, used, p.pad) : HostTensor();
    const HostTensor g_u = padded ? unpadded(*g[i].second, used, p.pad) : HostTensor();
    const HostTensor& wt = padded ? w_u : *w[i].second;
    const HostTensor& lt = padded ? l_u : *l[i].second;
    const HostTensor& gt = padded ? g_u : *g[i].second;
    double scale = 0;
    for (int64_t e = 0; e < wt.numel(); ++e) scale = std::max(scale, std::abs(wt.get(e)));
    const ErrorReport r = compare(gt, wt, &lt);
    std::printf("    %-16s |max| %.3g  %s\n", name, scale, r.describe(name).c_str());
    EXPECT_TRUE(within_tolerance(r, name, kErrFactor, abs_slack(name, cc.dtype) * std::max(scale, 1.0)));
  }
}

TEST(KdaBackward, LengthsAroundTheChunk) {
  FLARE_REQUIRE_GPU();
  for (int64_t T : {1, 63, 65, 300})
    for (bool h0 : {false, true}) {
      Case c;
      c.name = "T" + std::to_string(T) + (h0 ? " h0 dht" : "");
      c.T = T;
      c.initial_state = c.d_final_state = h0;
      run_case(c, 10 + T);
    }
  Case c;
  c.name = "T130 dht only";
  c.T = 130, c.initial_state = false;
  run_case(c, 9);
}

TEST(KdaBackward, HeadDims) {
  FLARE_REQUIRE_GPU();
  for (int64_t K : {64, 128})
    for (int64_t V : {64, 128}) {
      Case c;
      c.name = "K" + std::to_string(K) + " V" + std::to_string(V);
      c.K = K, c.V = V, c.T = 130;
      run_case(c, 20 + K + V);
    }
}

// Every value-slice width of the record and reverse state passes (16 to 64; 128 columns were
// measured no faster there), forced through FLARE_KDA_STATE_BV: the small cases above see only the
// narrow ones.
TEST(KdaBackward, StateSliceWidths) {
  FLARE_REQUIRE_GPU();
  with_each_state_slice_width({16, 32, 64}, [](int bv) {
    Case c;
    c.name = "BV " + std::to_string(bv);
    c.T = 200, c.H = 2, c.HV = 4, c.initial_state = true;
    run_case(c, 40 + bv);
  });
}

TEST(KdaBackward, GroupedValueHeads) {
  FLARE_REQUIRE_GPU();
  Case c;
  c.name = "GVA 2";
  c.H = 2, c.HV = 4, c.T = 100;
  run_case(c, 3);
  c.name = "GVA 2 l2norm K64";
  c.K = c.V = 64, c.options.qk_l2norm = true;
  run_case(c, 4);
}

TEST(KdaBackward, Varlen) {
  FLARE_REQUIRE_GPU();
  Case c;
  c.name = "varlen int32";
  c.seqlens = {1, 0, 130, 64, 7, 65};
  run_case(c, 4);
  c.name = "varlen int64 no h0";
  c.cu_dtype = DType::kInt64;
  c.initial_state = false;
  c.seqlens = {0, 300, 1};
  run_case(c, 5);
  c.name = "varlen GVA 2 gate";
  c.H = 1, c.HV = 2, c.initial_state = true, c.options.gate_in_kernel = true;
  c.seqlens = {70, 0, 1, 129};
  run_case(c, 6);
}

// The backward from the forward's kept workspace (its prep skipped) gives the same bits as the
// one that recomputes it.
TEST(KdaBackward, FromTheForwardsWorkspace) {
  FLARE_REQUIRE_GPU();
  std::vector<Case> cases(3);
  cases[0].name = "kept T 300";
  cases[0].T = 300;
  cases[1].name = "kept varlen GVA 2 layer options";
  cases[1].H = 1, cases[1].HV = 2, cases[1].options.gate_in_kernel = true, cases[1].options.qk_l2norm = true;
  cases[1].options.beta_sigmoid = true, cases[1].seqlens = {70, 0, 1, 129};
  cases[2] = with_option_case(cases[0], kda_option_cases().back());
  cases[2].name = "kept " + cases[2].name;
  for (size_t i = 0; i < cases.size(); ++i) {
    SCOPED_TRACE(cases[i].name);
    Problem p;
    make_problem(cases[i], 40 + i, &p);
    const Case& c = p.c;
    Grads recomputed(p, c.dtype, c.dg_dtype, c.dbeta_dtype, DType::kFloat32);
    Grads kept(p, c.dtype, c.dg_dtype, c.dbeta_dtype, DType::kFloat32);
    ASSERT_NO_FATAL_FAILURE(run_gpu(p, &recomputed));
    ASSERT_NO_FATAL_FAILURE(run_gpu(p, &kept, /*from_forward=*/true));
    const auto a = recomputed.named(), b = kept.named();
    for (size_t t = 0; t < a.size(); ++t)
      EXPECT_EQ(std::memcmp(a[t].second->data(), b[t].second->data(), a[t].second->nbytes()), 0) << a[t].first;
  }
}

TEST(KdaBackward, InKernelOptions) {
  FLARE_REQUIRE_GPU();
  Case base;
  base.T = 100;
  const std::vector<KdaOptionCase> cases = kda_option_cases();
  for (size_t i = 0; i < cases.size(); ++i) run_case(with_option_case(base, cases[i]), 6 + i);
}

TEST(KdaBackward, GatedDeltaRule) {
  FLARE_REQUIRE_GPU();
  Case c;
  c.name = "GDN";
  c.gdn = true, c.T = 200;
  run_case(c, 15);
  c.name = "GDN gate in kernel varlen";
  c.options.gate_in_kernel = true;
  c.seqlens = {70, 0, 1, 129};
  run_case(c, 16);
  c.name = "GDN lower bound GVA 2";
  c.seqlens.clear();
  c.T = 100, c.H = 1, c.HV = 2, c.options.lower_bound = -4.f;
  run_case(c, 17);
}

TEST(KdaBackward, Dtypes) {
  FLARE_REQUIRE_GPU();
  Case c;
  c.name = "fp16";
  c.dtype = DType::kFloat16, c.T = 130;
  run_case(c, 17);
  // fp16 operands hold 2^x only up to x = 16: the gate summed over 8 tokens must stay above -11.
  c.name = "fp16 K64 V64 bounded gate";
  c.K = c.V = 64, c.options.gate_in_kernel = true, c.options.lower_bound = -1.f;
  run_case(c, 18);
  c = Case{};
  c.name = "bf16 g, beta and their gradients";
  c.g_dtype = c.beta_dtype = c.dg_dtype = c.dbeta_dtype = DType::kBFloat16;
  c.T = 130;
  run_case(c, 19);
  c.name = "bf16 strided rows";
  c.g_dtype = c.beta_dtype = c.dg_dtype = c.dbeta_dtype = DType::kFloat32;
  c.strided = true;
  run_case(c, 20);
}

// Shapes and arguments the GPU backward rejects, each naming the argument.
TEST(KdaBackward, Arguments) {
  FLARE_REQUIRE_GPU();
  Case base;
  base.T = 10;
  Problem p;
  make_problem(base, 21, &p);
  Grads g(p, base.dtype, DType::kFloat32, DType::kFloat32, DType::kFloat32);
  KdaBackwardParams hp = p.params();
  g.attach(&hp);
  DeviceParams dp(hp, all_tensors(p, g));
  const KdaBackwardParams good = dp.params();
  size_t bytes = 0;
  ASSERT_TRUE(kda_backward_workspace_size(good, &bytes).ok());
  EXPECT_GT(bytes, 0u);
  EXPECT_TRUE(rejects(kda_backward_workspace_size(good, nullptr), "bytes"));
  EXPECT_TRUE(rejects(kda_backward(good), "workspace", "kda_backward_workspace_size"));  // none given
  void* ws = nullptr;
  FLARE_CUDA_OK(cudaMalloc(&ws, bytes + 256));
  KdaBackwardParams bad = good;
  bad.workspace = ws, bad.workspace_bytes = bytes - 1;
  EXPECT_TRUE(rejects(kda_backward(bad), "workspace"));
  bad.workspace = static_cast<char*>(ws) + 16, bad.workspace_bytes = bytes + 16;
  EXPECT_TRUE(rejects(kda_backward(bad), "workspace", "aligned"));

  KdaBackwardParams ok = good;
  ok.workspace = ws, ok.workspace_bytes = bytes;
  bad = ok;
  bad.dq.data = nullptr;
  EXPECT_TRUE(rejects(kda_backward(bad), "dq"));
  bad = ok;
  bad.dv.dtype = DType::kFloat16;
  EXPECT_TRUE(rejects(kda_backward(bad), "dv", "dtype"));
  bad = ok;
  bad.dk.shape[2] = 3;
  EXPECT_TRUE(rejects(kda_backward(bad), "dk", "shape"));
  bad = ok;
  bad.dg.shape[3] = 64;
  EXPECT_TRUE(rejects(kda_backward(bad), "dg"));
  bad = ok;
  bad.dbeta.dtype = DType::kFloat16;
  EXPECT_TRUE(rejects(kda_backward(bad), "dbeta", "dtype"));
  bad = ok;
  bad.dout = TensorView{};
  EXPECT_TRUE(rejects(kda_backward(bad), "dout"));
  bad = ok;
  bad.d_initial_state = TensorView{};
  EXPECT_TRUE(rejects(kda_backward(bad), "d_initial_state"));
  bad = ok;
  bad.d_final_state.dtype = DType::kBFloat16;
  EXPECT_TRUE(rejects(kda_backward(bad), "d_final_state", "dtype"));
  bad = ok;
  bad.q = p.params().q;  // a host view
  EXPECT_TRUE(rejects(kda_backward(bad), "q", "CUDA"));
  FLARE_CUDA_OK(cudaFree(ws));

  // K = 96 is valid for the oracle but has no GPU kernel.
  Case k96;
  k96.T = 10, k96.K = 96;
  Problem p96;
  make_problem(k96, 22, &p96);
  Grads g96(p96, k96.dtype, DType::kFloat32, DType::kFloat32, DType::kFloat32);
  KdaBackwardParams hp96 = p96.params();
  g96.attach(&hp96);
  DeviceParams dp96(hp96, all_tensors(p96, g96));
  const Status st = kda_backward_workspace_size(dp96.params(), &bytes);
  EXPECT_EQ(st.code(), StatusCode::kNotSupported) << st.message();
}

}  // namespace
}  // namespace flare::test
