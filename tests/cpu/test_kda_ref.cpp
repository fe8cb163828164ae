// Proves the KDA / GDN CPU oracles right: the recurrence against the independent chunked WY form,
// varlen against separate calls, every gradient against central finite differences, the option
// semantics against hand-applied activations, hand-computed single-token cases, dtype and stride
// handling, and argument checking.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "flare/kda.h"
#include "reference/host_tensor.h"
#include "reference/kda_ref.h"

namespace {

using flare::DType;
using flare::KdaBackwardParams;
using flare::KdaForwardParams;
using flare::KdaOptions;
using flare::Status;
using flare::StatusCode;
using flare::TensorView;
using flare::ref::HostTensor;

constexpr DType kF64 = DType::kFloat64;

// ------------------------------------------------------------------------------------------------
// Random problems.

struct Config {
  int64_t B = 2, T = 6, H = 2, HV = 2, K = 4, V = 3;
  bool gdn = false;            // g [B, T, HV] instead of [B, T, HV, K]
  bool initial_state = false;
  std::vector<int64_t> seqlens = {};  // varlen when not empty (then B = 1 and T = the sum)
  DType cu_dtype = DType::kInt32;
  bool A_log = true, dt_bias = true;  // given when options.gate_in_kernel
  KdaOptions options = {};

  int64_t num_sequences() const { return seqlens.empty() ? B : static_cast<int64_t>(seqlens.size()); }
};

// The inputs of one problem. Move-only: a copied HostTensor's view would point at the original.
struct Inputs {
  Config cfg;
  HostTensor q, k, v, g, beta, A_log, dt_bias, h0, cu_seqlens;

  Inputs() = default;
  Inputs(const Inputs&) = delete;
  Inputs& operator=(const Inputs&) = delete;
  Inputs(Inputs&&) = default;
  Inputs& operator=(Inputs&&) = default;
};

// Rows of length `len` scaled to unit norm: keeps the delta rule contractive (|1 - beta k.k| <= 1).
void normalize_rows(HostTensor& x, int64_t len) {
  for (int64_t r = 0; r < x.numel(); r += len) {
    double sum = 0;
    for (int64_t c = 0; c < len; ++c) sum += x.get(r + c) * x.get(r + c);
    for (int64_t c = 0; c < len; ++c) x.set(r + c, x.get(r + c) / std::sqrt(sum));
  }
}

Inputs make_inputs(Config cfg, uint64_t seed) {
  std::mt19937_64 rng(seed);
  if (!cfg.seqlens.empty()) {
    cfg.B = 1;
    cfg.T = 0;
    for (int64_t len : cfg.seqlens) cfg.T += len;
  }
  const KdaOptions& o = cfg.options;
  Inputs in;
  in.q.reset(kF64, {cfg.B, cfg.T, cfg.H, cfg.K});
  in.k.reset(kF64, {cfg.B, cfg.T, cfg.H, cfg.K});
  in.v.reset(kF64, {cfg.B, cfg.T, cfg.HV, cfg.V});
  in.beta.reset(kF64, {cfg.B, cfg.T, cfg.HV});
  if (cfg.gdn) {
    in.g.reset(kF64, {cfg.B, cfg.T, cfg.HV});
  } else {
    in.g.reset(kF64, {cfg.B, cfg.T, cfg.HV, cfg.K});
  }
  in.q.fill_uniform(rng);
  in.k.fill_normal(rng);
  if (!o.qk_l2norm) normalize_rows(in.k, cfg.K);
  in.v.fill_uniform(rng);
  if (o.gate_in_kernel) {
    in.g.fill_normal(rng);  // raw gate input: any real
  } else {
    in.g.fill_uniform(rng, -0.5, -0.01);  // log decays
  }
  if (o.beta_sigmoid) {
    in.beta.fill_normal(rng);
  } else {
    in.beta.fill_uniform(rng, 0.1, 0.9);
  }
  if (o.gate_in_kernel && cfg.A_log) {
    in.A_log.reset(kF64, {cfg.HV});
    in.A_log.fill_uniform(rng, -1.0, 0.5);
  }
  if (o.gate_in_kernel && cfg.dt_bias) {
    in.dt_bias.reset(kF64, {cfg.gdn ? cfg.HV : cfg.HV * cfg.K});
    in.dt_bias.fill_uniform(rng, -0.5, 0.5);
  }
  if (cfg.initial_state) {
    in.h0.reset(kF64, {cfg.num_sequences(), cfg.HV, cfg.K, cfg.V});
    in.h0.fill_uniform(rng);
  }
  if (!cfg.seqlens.empty()) {
    in.cu_seqlens.reset(cfg.cu_dtype, {static_cast<int64_t>(cfg.seqlens.size()) + 1});
    int64_t end = 0;
    in.cu_seqlens.set(0, 0);
    for (size_t n = 0; n < cfg.seqlens.size(); ++n) in.cu_seqlens.set(n + 1, end += cfg.seqlens[n]);
  }
  in.cfg = std::move(cfg);
  return in;
}

KdaForwardParams forward_params(const Inputs& in) {
  KdaForwardParams p;
  p.q = in.q;
  p.k = in.k;
  p.v = in.v;
  p.g = in.g;
  p.beta = in.beta;
  p.A_log = in.A_log;
  p.dt_bias = in.dt_bias;
  p.initial_state = in.h0;
  p.cu_seqlens = in.cu_seqlens;
  p.options = in.cfg.options;
  return p;
}

struct Outputs {
  HostTensor out, final_state;
};

Outputs make_outputs(const Config& c) {
  Outputs r;
  r.out.reset(kF64, {c.B, c.T, c.HV, c.V});
  r.final_state.reset(kF64, {c.num_sequences(), c.HV, c.K, c.V});
  r.out.fill(std::nan(""));  // poisoned: every element must be written
  r.final_state.fill(std::nan(""));
  return r;
}

// chunk_size 0: the recurrence; otherwise the chunked form.
Outputs run_forward(const Inputs& in, int chunk_size = 0) {
  Outputs r = make_outputs(in.cfg);
  KdaForwardParams p = forward_params(in);
  p.out = r.out;
  p.final_state = r.final_state;
  const Status s = chunk_size ? flare::ref::kda_forward_chunked(p, chunk_size) : flare::ref::kda_forward(p);
  EXPECT_TRUE(s.ok()) << s.message();
  return r;
}

// max |a - b| / max |b|, over tensors of equal size. NaN anywhere gives infinity.
double rel_diff(const HostTensor& a, const HostTensor& b) {
  EXPECT_EQ(a.numel(), b.numel());
  double err = 0, ref = 0;
  for (int64_t i = 0; i < b.numel(); ++i) {
    const double d = std::abs(a.get(i) - b.get(i));
    if (std::isnan(d)) return INFINITY;
    err = std::max(err, d);
    ref = std::max(ref, std::abs(b.get(i)));
  }
  return ref > 0 ? err / ref : err;
}

HostTensor clone(const HostTensor& x) {
  const TensorView& v = x.view();
  HostTensor y(v.dtype, std::vector<int64_t>(v.shape, v.shape + v.rank));
  for (int64_t i = 0; i < x.numel(); ++i) y.set(i, x.get(i));
  return y;
}

std::vector<int64_t> shape_of(const HostTensor& x) {
  const TensorView& v = x.view();
  return std::vector<int64_t>(v.shape, v.shape + v.rank);
}

// ------------------------------------------------------------------------------------------------
// 1. The recurrence against the independent chunked WY form.

void expect_chunked_matches_recurrence(const Config& cfg, uint64_t seed) {
  const Inputs in = make_inputs(cfg, seed);
  const Outputs ref = run_forward(in);
  for (int chunk : {16, 64}) {
    SCOPED_TRACE("chunk " + std::to_string(chunk) + ", T " + std::to_string(in.cfg.T));
    const Outputs got = run_forward(in, chunk);
    EXPECT_LE(rel_diff(got.out, ref.out), 1e-12);
    EXPECT_LE(rel_diff(got.final_state, ref.final_state), 1e-12);
  }
}

TEST(KdaRefChunked, KdaMatchesRecurrence) {
  for (int64_t T : {1, 37, 70}) {
    for (bool init : {false, true}) {
      Config c{.B = 2, .T = T, .H = 2, .HV = 2, .K = 8, .V = 6, .initial_state = init};
      expect_chunked_matches_recurrence(c, 100 + T);
    }
  }
}

TEST(KdaRefChunked, GdnMatchesRecurrence) {
  for (int64_t T : {1, 37, 70}) {
    for (bool init : {false, true}) {
      Config c{.B = 2, .T = T, .H = 2, .HV = 2, .K = 8, .V = 6, .gdn = true, .initial_state = init};
      expect_chunked_matches_recurrence(c, 200 + T);
    }
  }
}

TEST(KdaRefChunked, GvaMatchesRecurrence) {
  for (bool gdn : {false, true}) {
    for (bool init : {false, true}) {
      Config c{.B = 1, .T = 70, .H = 2, .HV = 4, .K = 8, .V = 5, .gdn = gdn, .initial_state = init};
      expect_chunked_matches_recurrence(c, 300 + gdn);
    }
  }
}

TEST(KdaRefChunked, VarlenMatchesRecurrence) {
  for (bool gdn : {false, true}) {
    for (bool init : {false, true}) {
      Config c{.H = 1, .HV = 2, .K = 8, .V = 4, .gdn = gdn, .initial_state = init,
               .seqlens = {0, 1, 37, 0, 70, 5}, .cu_dtype = DType::kInt64};
      expect_chunked_matches_recurrence(c, 400 + gdn);
    }
  }
}

TEST(KdaRefChunked, InKernelOptionsMatchRecurrence) {
  KdaOptions o{.scale = 0.3f, .qk_l2norm = true, .beta_sigmoid = true, .allow_neg_eigval = true,
               .gate_in_kernel = true};
  Config c{.B = 1, .T = 70, .H = 2, .HV = 4, .K = 8, .V = 4, .initial_state = true, .options = o};
  expect_chunked_matches_recurrence(c, 500);
  c.options.lower_bound = -5.f;
  c.gdn = true;
  expect_chunked_matches_recurrence(c, 501);
}

// ------------------------------------------------------------------------------------------------
// 2. Varlen equals the sequences run one by one.

// Tokens [begin, begin + length) of a [1, T, ...] tensor.
HostTensor slice_tokens(const HostTensor& x, int64_t begin, int64_t length) {
  std::vector<int64_t> shape = shape_of(x);
  const int64_t inner = x.numel() / shape[1];
  shape[1] = length;
  HostTensor y(x.view().dtype, shape);
  for (int64_t i = 0; i < y.numel(); ++i) y.set(i, x.get(begin * inner + i));
  return y;
}

// Entry n of the leading dimension, kept as a leading dimension of 1.
HostTensor slice_first(const HostTensor& x, int64_t n) {
  std::vector<int64_t> shape = shape_of(x);
  const int64_t inner = x.numel() / shape[0];
  shape[0] = 1;
  HostTensor y(x.view().dtype, shape);
  for (int64_t i = 0; i < inner; ++i) y.set(i, x.get(n * inner + i));
  return y;
}

Inputs single_sequence(const Inputs& packed, int64_t n, int64_t begin) {
  Inputs one;
  one.cfg = packed.cfg;
  one.cfg.seqlens.clear();
  one.cfg.B = 1;
  one.cfg.T = packed.cfg.seqlens[n];
  const int64_t len = one.cfg.T;
  one.q = slice_tokens(packed.q, begin, len);
  one.k = slice_tokens(packed.k, begin, len);
  one.v = slice_tokens(packed.v, begin, len);
  one.g = slice_tokens(packed.g, begin, len);
  one.beta = slice_tokens(packed.beta, begin, len);
  if (packed.A_log.view().defined()) one.A_log = clone(packed.A_log);
  if (packed.dt_bias.view().defined()) one.dt_bias = clone(packed.dt_bias);
  if (packed.h0.view().defined()) one.h0 = slice_first(packed.h0, n);
  return one;
}

void expect_varlen_equals_separate_calls(const Config& cfg, uint64_t seed) {
  const Inputs packed = make_inputs(cfg, seed);
  const Outputs all = run_forward(packed);
  int64_t begin = 0;
  for (size_t n = 0; n < cfg.seqlens.size(); ++n) {
    SCOPED_TRACE("sequence " + std::to_string(n));
    const Inputs one = single_sequence(packed, n, begin);
    const Outputs got = run_forward(one);
    EXPECT_EQ(rel_diff(got.out, slice_tokens(all.out, begin, one.cfg.T)), 0.0);
    EXPECT_EQ(rel_diff(got.final_state, slice_first(all.final_state, n)), 0.0);
    begin += one.cfg.T;
  }
}

TEST(KdaRefVarlen, EqualsSeparateCalls) {
  for (bool gdn : {false, true}) {
    for (bool init : {false, true}) {
      Config c{.H = 2, .HV = 4, .K = 5, .V = 3, .gdn = gdn, .initial_state = init,
               .seqlens = {3, 0, 1, 9, 4}};
      expect_varlen_equals_separate_calls(c, 600 + 2 * gdn + init);
    }
  }
  KdaOptions o{.qk_l2norm = true, .beta_sigmoid = true, .gate_in_kernel = true, .lower_bound = -3.f};
  expect_varlen_equals_separate_calls(
      Config{.K = 5, .initial_state = true, .seqlens = {2, 7, 0}, .cu_dtype = DType::kInt64, .options = o},
      610);
}

// ------------------------------------------------------------------------------------------------
// 3. Every gradient against central finite differences of L = sum(o W) + sum(final_state W2).

constexpr double kFdStep = 1e-6;
constexpr double kFdTolerance = 1e-7;

struct Loss {
  HostTensor W, W2;
  double operator()(const Inputs& in) const {
    const Outputs r = run_forward(in);
    double sum = 0;
    for (int64_t i = 0; i < W.numel(); ++i) sum += r.out.get(i) * W.get(i);
    if (!W2.view().defined()) return sum;
    for (int64_t i = 0; i < W2.numel(); ++i) sum += r.final_state.get(i) * W2.get(i);
    return sum;
  }
};

struct Gradients {
  HostTensor dq, dk, dv, dg, dbeta, dh0, dA_log, ddt_bias;
};

Gradients run_backward(const Inputs& in, const Loss& loss) {
  Gradients d;
  d.dq.reset(kF64, shape_of(in.q));
  d.dk.reset(kF64, shape_of(in.k));
  d.dv.reset(kF64, shape_of(in.v));
  d.dg.reset(kF64, shape_of(in.g));
  d.dbeta.reset(kF64, shape_of(in.beta));
  if (in.h0.view().defined()) d.dh0.reset(kF64, shape_of(in.h0));
  if (in.A_log.view().defined()) d.dA_log.reset(kF64, shape_of(in.A_log));
  if (in.dt_bias.view().defined()) d.ddt_bias.reset(kF64, shape_of(in.dt_bias));
  for (HostTensor* t : {&d.dq, &d.dk, &d.dv, &d.dg, &d.dbeta, &d.dh0, &d.dA_log, &d.ddt_bias})
    if (t->view().defined()) t->fill(std::nan(""));  // poisoned: every element must be written
  KdaBackwardParams p;
  const KdaForwardParams f = forward_params(in);
  p.q = f.q, p.k = f.k, p.v = f.v, p.g = f.g, p.beta = f.beta, p.A_log = f.A_log, p.dt_bias = f.dt_bias;
  p.initial_state = f.initial_state, p.cu_seqlens = f.cu_seqlens, p.options = f.options;
  p.dout = loss.W;
  p.d_final_state = loss.W2;
  p.dq = d.dq, p.dk = d.dk, p.dv = d.dv, p.dg = d.dg, p.dbeta = d.dbeta;
  p.d_initial_state = d.dh0, p.dA_log = d.dA_log, p.ddt_bias = d.ddt_bias;
  const Status s = flare::ref::kda_backward(p);
  EXPECT_TRUE(s.ok()) << s.message();
  return d;
}

// Central differences of `loss` w.r.t. every element of `x` (one of in's tensors) vs `analytic`.
void expect_gradient(Inputs& in, HostTensor& x, const HostTensor& analytic, const Loss& loss,
                     const std::string& name) {
  SCOPED_TRACE(name);
  ASSERT_EQ(x.numel(), analytic.numel());
  double max_err = 0, max_ref = 0;
  for (int64_t i = 0; i < x.numel(); ++i) {
    const double x0 = x.get(i);
    x.set(i, x0 + kFdStep);
    const double up = loss(in);
    x.set(i, x0 - kFdStep);
    const double down = loss(in);
    x.set(i, x0);
    const double fd = (up - down) / (2 * kFdStep);
    max_err = std::max(max_err, std::abs(fd - analytic.get(i)));
    max_ref = std::max(max_ref, std::abs(fd));
  }
  EXPECT_GT(max_ref, 1e-3) << "gradient is trivially small";
  EXPECT_LE(max_err / max_ref, kFdTolerance) << "max error " << max_err << " of " << max_ref;
}

void expect_gradients_match_finite_differences(const Config& cfg, uint64_t seed) {
  Inputs in = make_inputs(cfg, seed);
  std::mt19937_64 rng(seed ^ 0x5eed);
  Loss loss;
  loss.W.reset(kF64, {in.cfg.B, in.cfg.T, in.cfg.HV, in.cfg.V});
  loss.W2.reset(kF64, {in.cfg.num_sequences(), in.cfg.HV, in.cfg.K, in.cfg.V});
  loss.W.fill_uniform(rng);
  loss.W2.fill_uniform(rng);
  const Gradients d = run_backward(in, loss);
  expect_gradient(in, in.q, d.dq, loss, "dq");
  expect_gradient(in, in.k, d.dk, loss, "dk");
  expect_gradient(in, in.v, d.dv, loss, "dv");
  expect_gradient(in, in.g, d.dg, loss, "dg");
  expect_gradient(in, in.beta, d.dbeta, loss, "dbeta");
  if (in.h0.view().defined()) expect_gradient(in, in.h0, d.dh0, loss, "d_initial_state");
  if (in.A_log.view().defined()) expect_gradient(in, in.A_log, d.dA_log, loss, "dA_log");
  if (in.dt_bias.view().defined()) expect_gradient(in, in.dt_bias, d.ddt_bias, loss, "ddt_bias");
}

TEST(KdaRefGradients, Kda) { expect_gradients_match_finite_differences({.initial_state = true}, 700); }

TEST(KdaRefGradients, Gdn) {
  expect_gradients_match_finite_differences({.gdn = true, .initial_state = true}, 701);
}

TEST(KdaRefGradients, QkL2norm) {
  expect_gradients_match_finite_differences({.initial_state = true, .options = {.qk_l2norm = true}}, 702);
}

TEST(KdaRefGradients, BetaSigmoid) {
  expect_gradients_match_finite_differences({.initial_state = true, .options = {.beta_sigmoid = true}}, 703);
}

TEST(KdaRefGradients, AllowNegEigval) {
  KdaOptions o{.beta_sigmoid = true, .allow_neg_eigval = true};
  expect_gradients_match_finite_differences({.initial_state = true, .options = o}, 704);
}

TEST(KdaRefGradients, GateInKernel) {
  KdaOptions o{.gate_in_kernel = true};
  expect_gradients_match_finite_differences({.initial_state = true, .options = o}, 705);
  expect_gradients_match_finite_differences({.gdn = true, .options = o}, 706);
  expect_gradients_match_finite_differences({.dt_bias = false, .options = o}, 707);
}

TEST(KdaRefGradients, GateInKernelLowerBound) {
  KdaOptions o{.gate_in_kernel = true, .lower_bound = -5.f};
  expect_gradients_match_finite_differences({.initial_state = true, .options = o}, 708);
  expect_gradients_match_finite_differences({.A_log = false, .options = o}, 709);
  expect_gradients_match_finite_differences({.gdn = true, .options = o}, 710);
}

TEST(KdaRefGradients, Gva) {
  expect_gradients_match_finite_differences({.H = 1, .HV = 2, .initial_state = true}, 711);
  expect_gradients_match_finite_differences({.H = 2, .HV = 4, .gdn = true}, 712);
}

TEST(KdaRefGradients, Varlen) {
  expect_gradients_match_finite_differences({.initial_state = true, .seqlens = {3, 0, 1, 5}}, 713);
}

TEST(KdaRefGradients, AllOptionsScaleAndVarlen) {
  KdaOptions o{.scale = 0.8f, .qk_l2norm = true, .beta_sigmoid = true, .allow_neg_eigval = true,
               .gate_in_kernel = true};
  expect_gradients_match_finite_differences(
      {.H = 1, .HV = 2, .initial_state = true, .seqlens = {4, 1, 3}, .options = o}, 714);
}

// A zero initial state and none give the same gradients (and no d_final_state seed is needed).
TEST(KdaRefGradients, ZeroInitialStateEqualsNone) {
  Config c{.initial_state = true};
  Inputs with = make_inputs(c, 715);
  Inputs without = make_inputs(c, 715);
  with.h0.fill(0.0);
  without.h0 = HostTensor();
  std::mt19937_64 rng(715);
  Loss loss;
  loss.W.reset(kF64, {c.B, c.T, c.HV, c.V});
  loss.W.fill_uniform(rng);
  const Gradients a = run_backward(with, loss);
  const Gradients b = run_backward(without, loss);
  EXPECT_EQ(rel_diff(b.dq, a.dq), 0.0);
  EXPECT_EQ(rel_diff(b.dg, a.dg), 0.0);
  EXPECT_FALSE(b.dh0.view().defined());
}

// ------------------------------------------------------------------------------------------------
// 4. Semantics: hand-computed cases, hand-applied options, GDN as broadcast KDA.

constexpr double kExact = 1e-14;

// T = 1 from a zero state: S_1 = beta k v^T, o = scale beta (k . q) v, whatever g is.
TEST(KdaRefSemantics, SingleTokenFromZeroState) {
  Config c{.B = 1, .T = 1, .H = 1, .HV = 2, .K = 4, .V = 3, .options = {.scale = 0.7f}};
  const Inputs in = make_inputs(c, 800);
  const Outputs r = run_forward(in);
  for (int64_t hv = 0; hv < c.HV; ++hv) {  // both value heads read q/k head 0
    double kq = 0;
    for (int64_t i = 0; i < c.K; ++i) kq += in.k.get(i) * in.q.get(i);
    const double beta = in.beta.get(hv);
    for (int64_t j = 0; j < c.V; ++j) {
      const double v = in.v.get(hv * c.V + j);
      EXPECT_NEAR(r.out.get(hv * c.V + j), 0.7f * beta * kq * v, kExact);
      for (int64_t i = 0; i < c.K; ++i)
        EXPECT_NEAR(r.final_state.get((hv * c.K + i) * c.V + j), beta * in.k.get(i) * v, kExact);
    }
  }
}

// T = 1 from a given state: S_1 = (I - beta k k^T) Diag(exp(g)) S_0 + beta k v^T, o = scale S_1^T q.
TEST(KdaRefSemantics, SingleTokenFromInitialState) {
  Config c{.B = 1, .T = 1, .H = 1, .HV = 1, .K = 3, .V = 2, .initial_state = true};
  const Inputs in = make_inputs(c, 801);
  const Outputs r = run_forward(in);
  const double scale = 1.0 / std::sqrt(3.0), beta = in.beta.get(0);
  double decayed[3][2], S1[3][2];
  for (int i = 0; i < 3; ++i)
    for (int j = 0; j < 2; ++j) decayed[i][j] = std::exp(in.g.get(i)) * in.h0.get(i * 2 + j);
  for (int i = 0; i < 3; ++i) {
    for (int j = 0; j < 2; ++j) {
      double projected = 0;  // (k k^T decayed)_ij
      for (int m = 0; m < 3; ++m) projected += in.k.get(i) * in.k.get(m) * decayed[m][j];
      S1[i][j] = decayed[i][j] - beta * projected + beta * in.k.get(i) * in.v.get(j);
      EXPECT_NEAR(r.final_state.get(i * 2 + j), S1[i][j], kExact);
    }
  }
  for (int j = 0; j < 2; ++j) {
    const double o = scale * (S1[0][j] * in.q.get(0) + S1[1][j] * in.q.get(1) + S1[2][j] * in.q.get(2));
    EXPECT_NEAR(r.out.get(j), o, kExact);
  }
}

double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }
double softplus(double x) { return std::log1p(std::exp(x)); }

// Applies the in-kernel options of `in` by hand, giving inputs for the same problem with them off.
Inputs apply_options_by_hand(const Inputs& in) {
  const Config& c = in.cfg;
  const KdaOptions& o = c.options;
  Inputs out;
  out.cfg = c;
  out.cfg.options = KdaOptions{.scale = o.scale};
  out.q = clone(in.q), out.k = clone(in.k), out.v = clone(in.v), out.g = clone(in.g);
  out.beta = clone(in.beta);
  if (in.h0.view().defined()) out.h0 = clone(in.h0);
  if (in.cu_seqlens.view().defined()) out.cu_seqlens = clone(in.cu_seqlens);
  if (o.qk_l2norm) {
    for (HostTensor* x : {&out.q, &out.k}) {
      for (int64_t r = 0; r < x->numel(); r += c.K) {
        double sum = 1e-6;
        for (int64_t i = 0; i < c.K; ++i) sum += x->get(r + i) * x->get(r + i);
        for (int64_t i = 0; i < c.K; ++i) x->set(r + i, x->get(r + i) / std::sqrt(sum));
      }
    }
  }
  if (o.beta_sigmoid) {
    for (int64_t i = 0; i < out.beta.numel(); ++i)
      out.beta.set(i, (o.allow_neg_eigval ? 2.0 : 1.0) * sigmoid(out.beta.get(i)));
  }
  if (o.gate_in_kernel) {
    const int64_t per_head = c.gdn ? 1 : c.K;  // gate elements per (token, value head)
    for (int64_t i = 0; i < out.g.numel(); ++i) {
      const int64_t hv = (i / per_head) % c.HV;
      const double bias = in.dt_bias.view().defined() ? in.dt_bias.get(i % (per_head * c.HV)) : 0.0;
      const double z = in.g.get(i) + bias;
      const double a = in.A_log.view().defined() ? std::exp(in.A_log.get(hv)) : 1.0;
      out.g.set(i, o.lower_bound < 0 ? o.lower_bound * sigmoid(a * z) : -a * softplus(z));
    }
  }
  return out;
}

void expect_options_match_hand_applied(const Config& c, uint64_t seed) {
  const Inputs in = make_inputs(c, seed);
  const Outputs fused = run_forward(in);
  const Outputs plain = run_forward(apply_options_by_hand(in));
  EXPECT_LE(rel_diff(fused.out, plain.out), kExact);
  EXPECT_LE(rel_diff(fused.final_state, plain.final_state), kExact);
}

TEST(KdaRefSemantics, OptionsMatchHandApplied) {
  const Config base{.B = 1, .T = 9, .H = 1, .HV = 2, .K = 4, .V = 3, .initial_state = true};
  const KdaOptions cases[] = {
      {.qk_l2norm = true},
      {.beta_sigmoid = true},
      {.beta_sigmoid = true, .allow_neg_eigval = true},
      {.gate_in_kernel = true},
      {.gate_in_kernel = true, .lower_bound = -5.f},
  };
  uint64_t seed = 810;
  for (const KdaOptions& o : cases) {
    for (bool gdn : {false, true}) {
      Config c = base;
      c.options = o;
      c.gdn = gdn;
      expect_options_match_hand_applied(c, seed++);
    }
  }
  Config no_A_log = base;
  no_A_log.options = {.gate_in_kernel = true, .lower_bound = -2.f};
  no_A_log.A_log = false;
  expect_options_match_hand_applied(no_A_log, seed++);
}

// allow_neg_eigval doubles the sigmoid only; a precomputed beta is used as given (as in fla).
TEST(KdaRefSemantics, AllowNegEigvalWithoutSigmoidIsNoOp) {
  Config c{.initial_state = true};
  const Inputs plain = make_inputs(c, 830);
  c.options.allow_neg_eigval = true;
  const Inputs flagged = make_inputs(c, 830);
  EXPECT_EQ(rel_diff(run_forward(flagged).out, run_forward(plain).out), 0.0);
}

TEST(KdaRefSemantics, GdnIsKdaWithBroadcastGate) {
  Config c{.H = 1, .HV = 2, .gdn = true, .initial_state = true};
  const Inputs gdn = make_inputs(c, 840);
  Inputs kda = make_inputs(c, 840);
  kda.g.reset(kF64, {c.B, c.T, c.HV, c.K});
  for (int64_t i = 0; i < kda.g.numel(); ++i) kda.g.set(i, gdn.g.get(i / c.K));
  kda.cfg.gdn = false;
  const Outputs a = run_forward(gdn), b = run_forward(kda);
  EXPECT_EQ(rel_diff(a.out, b.out), 0.0);
  EXPECT_EQ(rel_diff(a.final_state, b.final_state), 0.0);
}

// GVA: value head hv reads q/k head hv / (HV / H), so it equals HV == H with q, k repeated that way;
// dq, dk of a shared head are the sums over its value heads.
TEST(KdaRefSemantics, GvaIsRepeatedQk) {
  Config c{.B = 2, .T = 5, .H = 2, .HV = 6, .K = 4, .V = 3, .initial_state = true};
  const Inputs gva = make_inputs(c, 850);
  Inputs rep = make_inputs(c, 850);
  const int64_t group = c.HV / c.H, rows = c.B * c.T;
  rep.cfg.H = c.HV;
  rep.q.reset(kF64, {c.B, c.T, c.HV, c.K});
  rep.k.reset(kF64, {c.B, c.T, c.HV, c.K});
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t hv = 0; hv < c.HV; ++hv)
      for (int64_t i = 0; i < c.K; ++i) {
        const int64_t src = (r * c.H + hv / group) * c.K + i, dst = (r * c.HV + hv) * c.K + i;
        rep.q.set(dst, gva.q.get(src));
        rep.k.set(dst, gva.k.get(src));
      }
  const Outputs a = run_forward(gva), b = run_forward(rep);
  EXPECT_EQ(rel_diff(a.out, b.out), 0.0);
  EXPECT_EQ(rel_diff(a.final_state, b.final_state), 0.0);

  std::mt19937_64 rng(851);
  Loss loss;
  loss.W.reset(kF64, {c.B, c.T, c.HV, c.V});
  loss.W.fill_uniform(rng);
  const Gradients da = run_backward(gva, loss), db = run_backward(rep, loss);
  HostTensor dq_summed(kF64, shape_of(gva.q));
  dq_summed.fill(0.0);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t hv = 0; hv < c.HV; ++hv)
      for (int64_t i = 0; i < c.K; ++i) {
        const int64_t dst = (r * c.H + hv / group) * c.K + i;
        dq_summed.set(dst, dq_summed.get(dst) + db.dq.get((r * c.HV + hv) * c.K + i));
      }
  EXPECT_LE(rel_diff(da.dq, dq_summed), kExact);
  EXPECT_EQ(rel_diff(da.dv, db.dv), 0.0);
}

// ------------------------------------------------------------------------------------------------
// 5. Dtypes and strides: low-precision, non-contiguous inputs are read exactly; outputs are
//    rounded to their own dtype.

// x's values in `dtype`, stored with dims 1 and 2 swapped in memory but viewed in x's shape.
struct TransposedCopy {
  HostTensor storage;
  TensorView view;
};
TransposedCopy transposed_copy(const HostTensor& x, DType dtype) {
  const std::vector<int64_t> s = shape_of(x);  // [B, T, X, D]
  TransposedCopy t{HostTensor(dtype, {s[0], s[2], s[1], s[3]}), {}};
  t.view = t.storage.view();
  for (int d = 0; d < 4; ++d) t.view.shape[d] = s[d];
  t.view.stride[0] = s[1] * s[2] * s[3];
  t.view.stride[1] = s[3];
  t.view.stride[2] = s[1] * s[3];
  t.view.stride[3] = 1;
  for (int64_t b = 0; b < s[0]; ++b)
    for (int64_t i = 0; i < s[1]; ++i)
      for (int64_t h = 0; h < s[2]; ++h)
        for (int64_t d = 0; d < s[3]; ++d) {
          const int64_t src = ((b * s[1] + i) * s[2] + h) * s[3] + d;
          flare::ref::store(t.view, b * t.view.stride[0] + i * t.view.stride[1] + h * t.view.stride[2] + d,
                            x.get(src));
        }
  return t;
}

// Rounds every value of x to `dtype`, keeping fp64 storage.
void round_values(HostTensor& x, DType dtype) {
  for (int64_t i = 0; i < x.numel(); ++i) x.set(i, flare::ref::round_to(dtype, x.get(i)));
}

TEST(KdaRefDtypes, StridedLowPrecisionInputs) {
  Config c{.B = 2, .T = 7, .H = 2, .HV = 4, .K = 4, .V = 3, .initial_state = true};
  Inputs in = make_inputs(c, 900);
  round_values(in.q, DType::kBFloat16);
  round_values(in.k, DType::kFloat16);
  round_values(in.v, DType::kBFloat16);
  round_values(in.g, DType::kFloat32);
  round_values(in.beta, DType::kBFloat16);
  round_values(in.h0, DType::kFloat32);
  const Outputs ref = run_forward(in);

  const TransposedCopy q = transposed_copy(in.q, DType::kBFloat16);
  const TransposedCopy k = transposed_copy(in.k, DType::kFloat16);
  const TransposedCopy v = transposed_copy(in.v, DType::kBFloat16);
  const TransposedCopy g = transposed_copy(in.g, DType::kFloat32);
  HostTensor beta(DType::kBFloat16, shape_of(in.beta)), h0(DType::kFloat32, shape_of(in.h0));
  for (int64_t i = 0; i < beta.numel(); ++i) beta.set(i, in.beta.get(i));
  for (int64_t i = 0; i < h0.numel(); ++i) h0.set(i, in.h0.get(i));
  HostTensor out(DType::kBFloat16, {c.B, c.T, c.HV, c.V});
  HostTensor final_state(DType::kFloat32, {c.B, c.HV, c.K, c.V});
  KdaForwardParams p;
  p.q = q.view, p.k = k.view, p.v = v.view, p.g = g.view, p.beta = beta, p.initial_state = h0;
  p.out = out;
  p.final_state = final_state;
  const Status s = flare::ref::kda_forward(p);
  ASSERT_TRUE(s.ok()) << s.message();
  for (int64_t i = 0; i < out.numel(); ++i)
    EXPECT_EQ(out.get(i), flare::ref::round_to(DType::kBFloat16, ref.out.get(i)));
  for (int64_t i = 0; i < final_state.numel(); ++i)
    EXPECT_EQ(final_state.get(i), flare::ref::round_to(DType::kFloat32, ref.final_state.get(i)));
}

// ------------------------------------------------------------------------------------------------
// 6. Bad arguments: a non-ok Status whose message names the argument.

void expect_invalid(const Status& s, const std::string& arg) {
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.message();
  EXPECT_NE(s.message().find("'" + arg + "'"), std::string::npos) << s.message();
}

// A valid forward problem whose views a test may break.
struct ForwardCase {
  Inputs in;
  Outputs outputs;
  KdaForwardParams params;

  explicit ForwardCase(const Config& c) : in(make_inputs(c, 950)), outputs(make_outputs(in.cfg)) {
    params = forward_params(in);
    params.out = outputs.out;
    params.final_state = outputs.final_state;
    EXPECT_TRUE(flare::ref::kda_forward(params).ok());
  }
};

TEST(KdaRefArguments, ForwardShapes) {
  const Config c{.B = 2, .T = 5, .H = 2, .HV = 4, .K = 4, .V = 3, .initial_state = true};
  {
    ForwardCase f(c);
    HostTensor v(kF64, {2, 5, 3, 3});  // HV = 3 is not a multiple of H = 2
    v.fill(0.5);
    f.params.v = v;
    expect_invalid(flare::ref::kda_forward(f.params), "v");
  }
  {
    ForwardCase f(c);
    HostTensor g(kF64, {2, 5, 4, 5});
    g.fill(-0.1);
    f.params.g = g;
    expect_invalid(flare::ref::kda_forward(f.params), "g");
    HostTensor g2(kF64, {2, 5});
    g2.fill(-0.1);
    f.params.g = g2;
    expect_invalid(flare::ref::kda_forward(f.params), "g");
  }
  {
    ForwardCase f(c);
    HostTensor k(kF64, {2, 5, 2, 3});
    k.fill(0.5);
    f.params.k = k;
    expect_invalid(flare::ref::kda_forward(f.params), "k");
  }
  {
    ForwardCase f(c);
    HostTensor beta(kF64, {2, 5, 2});
    beta.fill(0.5);
    f.params.beta = beta;
    expect_invalid(flare::ref::kda_forward(f.params), "beta");
  }
  {
    ForwardCase f(c);
    HostTensor h0(kF64, {1, 4, 4, 3});
    h0.fill(0.5);
    f.params.initial_state = h0;
    expect_invalid(flare::ref::kda_forward(f.params), "initial_state");
  }
  {
    ForwardCase f(c);
    f.params.out = TensorView{};
    expect_invalid(flare::ref::kda_forward(f.params), "out");
    f.params.out = f.outputs.final_state;
    expect_invalid(flare::ref::kda_forward(f.params), "out");
  }
  {
    ForwardCase f(c);
    f.params.q.device.kind = flare::DeviceKind::kCUDA;
    expect_invalid(flare::ref::kda_forward(f.params), "q");
  }
  {
    ForwardCase f(c);
    HostTensor q(DType::kInt32, {2, 5, 2, 4});
    f.params.q = q;
    expect_invalid(flare::ref::kda_forward(f.params), "q");
  }
  {
    ForwardCase f(c);
    expect_invalid(flare::ref::kda_forward_chunked(f.params, 0), "chunk_size");
  }
}

TEST(KdaRefArguments, Varlen) {
  {
    ForwardCase f(Config{.B = 2, .T = 5});
    HostTensor cu(DType::kInt32, {2});
    cu.set(0, 0);
    cu.set(1, 5);
    f.params.cu_seqlens = cu;  // B = 2 with cu_seqlens
    expect_invalid(flare::ref::kda_forward(f.params), "cu_seqlens");
  }
  ForwardCase f(Config{.seqlens = {2, 3}});  // T = 5
  HostTensor cu(DType::kInt64, {3});
  cu.set(0, 0), cu.set(1, 2), cu.set(2, 4);  // does not end at T
  f.params.cu_seqlens = cu;
  expect_invalid(flare::ref::kda_forward(f.params), "cu_seqlens");
  cu.set(1, 6), cu.set(2, 5);  // decreasing
  expect_invalid(flare::ref::kda_forward(f.params), "cu_seqlens");
  HostTensor cu_float(kF64, {3});
  f.params.cu_seqlens = cu_float;
  expect_invalid(flare::ref::kda_forward(f.params), "cu_seqlens");
  HostTensor cu_short(DType::kInt32, {2});  // one sequence: final_state has the wrong N
  cu_short.set(0, 0), cu_short.set(1, 5);
  f.params.cu_seqlens = cu_short;
  expect_invalid(flare::ref::kda_forward(f.params), "final_state");
}

TEST(KdaRefArguments, Gate) {
  {
    ForwardCase f(Config{.options = {.gate_in_kernel = true}});
    f.params.A_log = TensorView{};  // required by the default gate
    expect_invalid(flare::ref::kda_forward(f.params), "A_log");
  }
  {
    ForwardCase f(Config{.options = {.gate_in_kernel = true, .lower_bound = -5.f}});
    f.params.options.lower_bound = 1.f;
    expect_invalid(flare::ref::kda_forward(f.params), "options.lower_bound");
  }
  {
    ForwardCase f(Config{.gdn = true, .options = {.gate_in_kernel = true}});
    HostTensor dt_bias(kF64, {f.in.cfg.HV * f.in.cfg.K});  // GDN takes one bias per head
    dt_bias.fill(0.1);
    f.params.dt_bias = dt_bias;
    expect_invalid(flare::ref::kda_forward(f.params), "dt_bias");
  }
}

TEST(KdaRefArguments, Backward) {
  Config c{.initial_state = true, .options = {.gate_in_kernel = true}};
  Inputs in = make_inputs(c, 960);
  Loss loss;
  loss.W.reset(kF64, {c.B, c.T, c.HV, c.V});
  loss.W.fill(0.5);
  Gradients d = run_backward(in, loss);
  KdaBackwardParams p;
  const KdaForwardParams f = forward_params(in);
  p.q = f.q, p.k = f.k, p.v = f.v, p.g = f.g, p.beta = f.beta, p.A_log = f.A_log, p.dt_bias = f.dt_bias;
  p.initial_state = f.initial_state, p.options = f.options;
  p.dout = loss.W;
  p.dq = d.dq, p.dk = d.dk, p.dv = d.dv, p.dg = d.dg, p.dbeta = d.dbeta;
  p.d_initial_state = d.dh0, p.dA_log = d.dA_log, p.ddt_bias = d.ddt_bias;
  ASSERT_TRUE(flare::ref::kda_backward(p).ok());

  KdaBackwardParams bad = p;
  bad.d_initial_state = TensorView{};
  expect_invalid(flare::ref::kda_backward(bad), "d_initial_state");
  bad = p;
  bad.dA_log = TensorView{};
  expect_invalid(flare::ref::kda_backward(bad), "dA_log");
  bad = p;
  bad.ddt_bias = TensorView{};
  expect_invalid(flare::ref::kda_backward(bad), "ddt_bias");
  bad = p;
  bad.dg = d.dbeta;
  expect_invalid(flare::ref::kda_backward(bad), "dg");
  bad = p;
  bad.dout = TensorView{};
  expect_invalid(flare::ref::kda_backward(bad), "dout");
  bad = p;
  bad.d_final_state = d.dq;
  expect_invalid(flare::ref::kda_backward(bad), "d_final_state");
}

}  // namespace
