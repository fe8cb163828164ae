// Proves the chunked backward algorithm that the GPU backward implements (the CPU version of its
// stages, flare::ref::kda_backward_chunked) right: in fp64 every gradient agrees with the reverse
// mode of the exact recurrence (flare::ref::kda_backward) to ~1e-10 relative, for T around the
// chunk size (1, 63, 64, 65, 300), varlen batches with sequences of length 0 and 1, GVA ratio 2,
// with and without an initial state and a d_final_state seed, KDA and GDN, every in-kernel option,
// and chunk sizes 64 and 16. With 16-bit intermediates (the GPU tests' baseline) it stays close
// but measurably off.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
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
using flare::KdaOptions;
using flare::Status;
using flare::ref::HostTensor;

constexpr DType kF64 = DType::kFloat64;
constexpr double kTolerance = 1e-10;

struct Config {
  std::string name;
  int64_t B = 2, T = 65, H = 2, HV = 2, K = 8, V = 6;
  bool gdn = false, initial_state = true, d_final_state = true;
  std::vector<int64_t> seqlens = {};  // varlen when not empty (B = 1, T = the sum)
  KdaOptions options = {};
  int chunk = 64;
};

// Inputs, the output gradient seeds, and the gradient buffers of one problem.
struct Problem {
  Config cfg;
  int64_t N = 0;
  HostTensor q, k, v, g, beta, A_log, dt_bias, h0, cu, dout, dht;

  Problem() = default;
  Problem(const Problem&) = delete;
  Problem& operator=(const Problem&) = delete;
};

// Rows of `len` scaled to unit norm: keeps the delta rule contractive.
void normalize_rows(HostTensor& x, int64_t len) {
  for (int64_t r = 0; r < x.numel(); r += len) {
    double sum = 0;
    for (int64_t c = 0; c < len; ++c) sum += x.get(r + c) * x.get(r + c);
    for (int64_t c = 0; c < len; ++c) x.set(r + c, x.get(r + c) / std::sqrt(sum));
  }
}

void make_problem(Config c, uint64_t seed, Problem* p) {
  std::mt19937_64 rng(seed);
  if (!c.seqlens.empty()) {
    c.B = 1, c.T = 0;
    for (int64_t len : c.seqlens) c.T += len;
  }
  p->N = c.seqlens.empty() ? c.B : static_cast<int64_t>(c.seqlens.size());
  const KdaOptions& o = c.options;
  p->q.reset(kF64, {c.B, c.T, c.H, c.K});
  p->k.reset(kF64, {c.B, c.T, c.H, c.K});
  p->v.reset(kF64, {c.B, c.T, c.HV, c.V});
  p->beta.reset(kF64, {c.B, c.T, c.HV});
  if (c.gdn) p->g.reset(kF64, {c.B, c.T, c.HV});
  else p->g.reset(kF64, {c.B, c.T, c.HV, c.K});
  p->q.fill_uniform(rng);
  p->k.fill_normal(rng);
  if (!o.qk_l2norm) normalize_rows(p->k, c.K);
  p->v.fill_uniform(rng);
  if (o.gate_in_kernel) p->g.fill_normal(rng);
  else p->g.fill_uniform(rng, -0.5, -0.01);
  if (o.beta_sigmoid) p->beta.fill_normal(rng);
  else p->beta.fill_uniform(rng, 0.1, 0.9);
  if (o.gate_in_kernel) {
    p->A_log.reset(kF64, {c.HV});
    p->A_log.fill_uniform(rng, -1.0, 0.5);
    p->dt_bias.reset(kF64, {c.gdn ? c.HV : c.HV * c.K});
    p->dt_bias.fill_uniform(rng, -0.5, 0.5);
  }
  if (c.initial_state) {
    p->h0.reset(kF64, {p->N, c.HV, c.K, c.V});
    p->h0.fill_uniform(rng);
  }
  if (!c.seqlens.empty()) {
    p->cu.reset(DType::kInt64, {static_cast<int64_t>(c.seqlens.size()) + 1});
    int64_t end = 0;
    p->cu.set(0, 0);
    for (size_t n = 0; n < c.seqlens.size(); ++n) p->cu.set(static_cast<int64_t>(n) + 1, end += c.seqlens[n]);
  }
  p->dout.reset(kF64, {c.B, c.T, c.HV, c.V});
  p->dout.fill_uniform(rng);
  if (c.d_final_state) {
    p->dht.reset(kF64, {p->N, c.HV, c.K, c.V});
    p->dht.fill_uniform(rng);
  }
  p->cfg = std::move(c);
}

struct Gradients {
  HostTensor dq, dk, dv, dg, dbeta, dh0, dA_log, ddt_bias;

  std::vector<std::pair<const char*, const HostTensor*>> named() const {
    std::vector<std::pair<const char*, const HostTensor*>> all = {
        {"dq", &dq}, {"dk", &dk}, {"dv", &dv}, {"dg", &dg}, {"dbeta", &dbeta}};
    if (dh0.view().defined()) all.push_back({"d_initial_state", &dh0});
    if (dA_log.view().defined()) all.push_back({"dA_log", &dA_log});
    if (ddt_bias.view().defined()) all.push_back({"ddt_bias", &ddt_bias});
    return all;
  }
};

std::vector<int64_t> shape_of(const HostTensor& x) {
  const flare::TensorView& v = x.view();
  return std::vector<int64_t>(v.shape, v.shape + v.rank);
}

// chunk 0: the exact recurrence's reverse mode; otherwise the chunked backward.
Gradients run_backward(const Problem& p, int chunk, DType intermediates = kF64) {
  Gradients d;
  d.dq.reset(kF64, shape_of(p.q));
  d.dk.reset(kF64, shape_of(p.k));
  d.dv.reset(kF64, shape_of(p.v));
  d.dg.reset(kF64, shape_of(p.g));
  d.dbeta.reset(kF64, shape_of(p.beta));
  if (p.h0.view().defined()) d.dh0.reset(kF64, shape_of(p.h0));
  if (p.A_log.view().defined()) d.dA_log.reset(kF64, shape_of(p.A_log));
  if (p.dt_bias.view().defined()) d.ddt_bias.reset(kF64, shape_of(p.dt_bias));
  for (HostTensor* t : {&d.dq, &d.dk, &d.dv, &d.dg, &d.dbeta, &d.dh0, &d.dA_log, &d.ddt_bias})
    if (t->view().defined()) t->fill(std::nan(""));  // poisoned: every element must be written
  KdaBackwardParams b;
  b.q = p.q, b.k = p.k, b.v = p.v, b.g = p.g, b.beta = p.beta, b.A_log = p.A_log, b.dt_bias = p.dt_bias;
  b.initial_state = p.h0, b.cu_seqlens = p.cu, b.options = p.cfg.options;
  b.dout = p.dout, b.d_final_state = p.dht;
  b.dq = d.dq, b.dk = d.dk, b.dv = d.dv, b.dg = d.dg, b.dbeta = d.dbeta;
  b.d_initial_state = d.dh0, b.dA_log = d.dA_log, b.ddt_bias = d.ddt_bias;
  const Status s = chunk ? flare::ref::kda_backward_chunked(b, chunk, intermediates) : flare::ref::kda_backward(b);
  EXPECT_TRUE(s.ok()) << s.message();
  return d;
}

// max |a - b| / max |b|; NaN anywhere gives infinity.
double rel_diff(const HostTensor& a, const HostTensor& b) {
  double err = 0, ref = 0;
  for (int64_t i = 0; i < b.numel(); ++i) {
    const double d = std::abs(a.get(i) - b.get(i));
    if (std::isnan(d)) return INFINITY;
    err = std::max(err, d);
    ref = std::max(ref, std::abs(b.get(i)));
  }
  return ref > 0 ? err / ref : err;
}

double max_abs(const HostTensor& a) {
  double m = 0;
  for (int64_t i = 0; i < a.numel(); ++i) m = std::max(m, std::abs(a.get(i)));
  return m;
}

// Every gradient of the chunked backward against the recurrence's; returns the worst relative error.
double expect_chunked_matches_recurrence(const Config& cfg, uint64_t seed) {
  SCOPED_TRACE(cfg.name);
  Problem p;
  make_problem(cfg, seed, &p);
  const Gradients want = run_backward(p, 0);
  const Gradients got = run_backward(p, cfg.chunk);
  const auto w = want.named(), g = got.named();
  EXPECT_EQ(w.size(), g.size());
  double worst = 0;
  std::string line;
  for (size_t i = 0; i < w.size(); ++i) {
    const double err = rel_diff(*g[i].second, *w[i].second);
    EXPECT_LE(err, kTolerance) << w[i].first;
    // One token from a zero state never sees its decay: dg is exactly zero there.
    const bool dg_vanishes = p.cfg.T == 1 && !p.cfg.initial_state;
    if (!(dg_vanishes && std::string(w[i].first) == "dg"))
      EXPECT_GT(max_abs(*w[i].second), 1e-3) << w[i].first << " is trivially small";
    worst = std::max(worst, err);
    char buf[64];
    std::snprintf(buf, sizeof buf, " %s %.1e", w[i].first, err);
    line += buf;
  }
  std::printf("  %-34s max rel err %.2e:%s\n", cfg.name.c_str(), worst, line.c_str());
  return worst;
}

TEST(KdaChunkedBackward, LengthsAroundTheChunk) {
  for (int64_t T : {1, 63, 64, 65, 300})
    for (bool h0 : {false, true})
      for (bool dht : {false, true}) {
        Config c{.name = "KDA T" + std::to_string(T) + (h0 ? " h0" : "") + (dht ? " dht" : ""), .T = T,
                 .initial_state = h0, .d_final_state = dht};
        expect_chunked_matches_recurrence(c, 1000 + T * 4 + h0 * 2 + dht);
      }
}

TEST(KdaChunkedBackward, GatedDeltaRule) {
  for (int64_t T : {1, 63, 65, 300})
    for (bool h0 : {false, true}) {
      Config c{.name = "GDN T" + std::to_string(T) + (h0 ? " h0 dht" : ""), .T = T, .gdn = true,
               .initial_state = h0, .d_final_state = h0};
      expect_chunked_matches_recurrence(c, 2000 + T * 2 + h0);
    }
}

TEST(KdaChunkedBackward, GroupedValueHeads) {
  for (bool gdn : {false, true}) {
    Config c{.name = std::string(gdn ? "GDN" : "KDA") + " GVA 2", .B = 1, .T = 130, .H = 2, .HV = 4, .gdn = gdn};
    expect_chunked_matches_recurrence(c, 3000 + gdn);
  }
}

TEST(KdaChunkedBackward, Varlen) {
  for (bool gdn : {false, true})
    for (bool h0 : {false, true}) {
      Config c{.name = std::string(gdn ? "GDN" : "KDA") + " varlen" + (h0 ? " h0 dht" : ""), .H = 1, .HV = 2,
               .gdn = gdn, .initial_state = h0, .d_final_state = h0, .seqlens = {1, 0, 130, 64, 7, 65, 0}};
      expect_chunked_matches_recurrence(c, 4000 + gdn * 2 + h0);
    }
  Config c{.name = "KDA varlen 0 300 1", .initial_state = false, .seqlens = {0, 300, 1}};
  expect_chunked_matches_recurrence(c, 4010);
}

TEST(KdaChunkedBackward, InKernelOptions) {
  const std::vector<std::pair<std::string, KdaOptions>> options = {
      {"l2norm", {.qk_l2norm = true}},
      {"beta sigmoid", {.beta_sigmoid = true}},
      {"neg eigval", {.beta_sigmoid = true, .allow_neg_eigval = true}},
      {"gate", {.gate_in_kernel = true}},
      {"gate lower bound", {.gate_in_kernel = true, .lower_bound = -5.f}},
      {"scale", {.scale = 0.3f}},
      {"layer mode", {.qk_l2norm = true, .beta_sigmoid = true, .gate_in_kernel = true}},
  };
  uint64_t seed = 5000;
  for (const auto& [name, o] : options)
    for (bool gdn : {false, true}) {
      Config c{.name = std::string(gdn ? "GDN " : "KDA ") + name, .B = 1, .T = 100, .H = 1, .HV = 2, .gdn = gdn,
               .options = o};
      expect_chunked_matches_recurrence(c, seed++);
    }
}

// The algorithm does not depend on the chunk size: 16-token chunks agree as well.
TEST(KdaChunkedBackward, ChunkSize16) {
  Config c{.name = "KDA chunk 16 varlen", .H = 1, .HV = 2, .seqlens = {17, 0, 1, 40}, .chunk = 16};
  expect_chunked_matches_recurrence(c, 6000);
}

// 16-bit intermediates (the GPU tests' low-precision baseline) move every gradient, but only by
// what that rounding explains.
TEST(KdaChunkedBackward, RoundedIntermediatesStayClose) {
  Config c{.name = "bf16 intermediates", .T = 200, .K = 16, .V = 16};
  Problem p;
  make_problem(c, 7000, &p);
  const Gradients want = run_backward(p, 0);
  for (DType dt : {DType::kBFloat16, DType::kFloat16}) {
    const Gradients got = run_backward(p, 64, dt);
    const double unit = dt == DType::kBFloat16 ? 0x1p-8 : 0x1p-11;  // the dtype's rounding unit
    const auto w = want.named(), g = got.named();
    for (size_t i = 0; i < w.size(); ++i) {
      SCOPED_TRACE(w[i].first);
      const double err = rel_diff(*g[i].second, *w[i].second);
      std::printf("  %s %-16s rel err %.2e\n", dt == DType::kBFloat16 ? "bf16" : "fp16", w[i].first, err);
      EXPECT_GT(err, 1e-3 * unit);
      EXPECT_LT(err, 50 * unit);
    }
  }
}

}  // namespace
