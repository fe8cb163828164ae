// Tests of the attention CPU oracle: gradients against finite differences, masks against
// brute force, varlen against one-by-one, GQA against expanded heads, sinks against an extra key,
// decode against the dense oracle, paged against contiguous, merge against the unsplit row.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "reference/attention_ref.h"
#include "reference/host_tensor.h"
#include "reference/parallel.h"

namespace flare::ref {
namespace {

using D = DType;
constexpr D F64 = D::kFloat64;

struct Inputs {
  HostTensor q, k, v, out, lse;
};

Inputs make_inputs(int64_t b, int64_t sq, int64_t sk, int64_t h, int64_t hk, int64_t d,
                   uint64_t seed) {
  std::mt19937_64 rng(seed);
  Inputs in;
  in.q.reset(F64, {b, sq, h, d});
  in.k.reset(F64, {b, sk, hk, d});
  in.v.reset(F64, {b, sk, hk, d});
  in.out.reset(F64, {b, sq, h, d});
  in.lse.reset(D::kFloat32, {b, h, sq});
  in.q.fill_normal(rng);
  in.k.fill_normal(rng);
  in.v.fill_normal(rng);
  return in;
}

AttentionForwardParams fwd_params(Inputs& in) {
  AttentionForwardParams p;
  p.q = in.q;
  p.k = in.k;
  p.v = in.v;
  p.out = in.out;
  p.lse = in.lse;
  return p;
}

double max_abs_diff(const HostTensor& a, const HostTensor& b) {
  double m = 0;
  for (int64_t i = 0; i < a.numel(); ++i) m = std::max(m, std::abs(a.get(i) - b.get(i)));
  return m;
}

TEST(DenseMask, MatchesDefinitionByEnumeration) {
  // Causal bottom-right: row i of sq sees columns [0, i + sk - sq].
  MaskParams causal{true, -1, -1};
  for (int sq : {1, 3, 7}) {
    for (int sk : {1, 4, 7}) {
      for (int i = 0; i < sq; ++i)
        for (int j = 0; j < sk; ++j)
          EXPECT_EQ(dense_visible(causal, i, j, sq, sk), j <= i + sk - sq) << sq << " " << sk;
    }
  }
  MaskParams window{false, 2, 1};
  for (int i = 0; i < 6; ++i)
    for (int j = 0; j < 9; ++j) {
      int diag = i + 3;
      EXPECT_EQ(dense_visible(window, i, j, 6, 9), j >= diag - 2 && j <= diag + 1);
    }
  MaskParams none{};
  EXPECT_TRUE(dense_visible(none, 0, 100, 1, 101));
}

TEST(AttentionRef, TinyCaseByHand) {
  // One query, two keys: out = softmax(scale * [q.k0, q.k1]) . v
  Inputs in = make_inputs(1, 1, 2, 1, 1, 2, 1);
  double q0 = in.q.get(0), q1 = in.q.get(1);
  double s0 = (q0 * in.k.get(0) + q1 * in.k.get(1)) / std::sqrt(2.0);
  double s1 = (q0 * in.k.get(2) + q1 * in.k.get(3)) / std::sqrt(2.0);
  double p0 = std::exp(s0) / (std::exp(s0) + std::exp(s1)), p1 = 1 - p0;
  AttentionForwardParams p = fwd_params(in);
  ASSERT_TRUE(ref::attention_forward(p).ok());
  EXPECT_NEAR(in.out.get(0), p0 * in.v.get(0) + p1 * in.v.get(2), 1e-12);
  EXPECT_NEAR(in.out.get(1), p0 * in.v.get(1) + p1 * in.v.get(3), 1e-12);
  EXPECT_NEAR(in.lse.get(0), std::log(std::exp(s0) + std::exp(s1)), 1e-6);
}

TEST(AttentionRef, FullyMaskedRowsGiveZeroAndInfLse) {
  Inputs in = make_inputs(1, 5, 3, 1, 1, 4, 2);  // causal with sq > sk: first two rows see nothing
  AttentionForwardParams p = fwd_params(in);
  p.mask.causal = true;
  ASSERT_TRUE(ref::attention_forward(p).ok());
  for (int c = 0; c < 4; ++c) EXPECT_EQ(in.out.get(c), 0.0);
  EXPECT_TRUE(std::isinf(in.lse.get(0)) && in.lse.get(0) > 0);
  EXPECT_TRUE(std::isinf(in.lse.get(1)));
  EXPECT_FALSE(std::isinf(in.lse.get(2)));
}

TEST(AttentionRef, GqaEqualsExpandedHeads) {
  Inputs in = make_inputs(2, 7, 9, 4, 2, 8, 3);
  AttentionForwardParams p = fwd_params(in);
  p.mask.causal = true;
  ASSERT_TRUE(ref::attention_forward(p).ok());
  HostTensor k4(F64, {2, 9, 4, 8}), v4(F64, {2, 9, 4, 8}), out4(F64, {2, 7, 4, 8});
  for (int b = 0; b < 2; ++b)
    for (int t = 0; t < 9; ++t)
      for (int h = 0; h < 4; ++h)
        for (int c = 0; c < 8; ++c) {
          int64_t src = ((b * 9 + t) * 2 + h / 2) * 8 + c, dst = ((b * 9 + t) * 4 + h) * 8 + c;
          k4.set(dst, in.k.get(src));
          v4.set(dst, in.v.get(src));
        }
  AttentionForwardParams p4 = p;
  p4.k = k4;
  p4.v = v4;
  p4.out = out4;
  ASSERT_TRUE(ref::attention_forward(p4).ok());
  EXPECT_LT(max_abs_diff(in.out, out4), 1e-12);
}

TEST(AttentionRef, VarlenEqualsOneByOne) {
  std::mt19937_64 rng(4);
  const std::vector<int> lq = {3, 0, 1, 6}, lk = {5, 2, 1, 6};
  const int h = 2, d = 8;
  int tq = 0, tk = 0;
  for (int x : lq) tq += x;
  for (int x : lk) tk += x;
  HostTensor q(F64, {tq, h, d}), k(F64, {tk, h, d}), v(F64, {tk, h, d}), o(F64, {tq, h, d});
  HostTensor lse(F64, {h, tq}), cq(D::kInt32, {5}), ck(D::kInt32, {5});
  q.fill_normal(rng);
  k.fill_normal(rng);
  v.fill_normal(rng);
  int aq = 0, ak = 0;
  for (int b = 0; b <= 4; ++b) {
    cq.set(b, aq);
    ck.set(b, ak);
    if (b < 4) aq += lq[b], ak += lk[b];
  }
  AttentionForwardParams p;
  p.q = q; p.k = k; p.v = v; p.out = o; p.lse = lse;
  p.cu_seqlens_q = cq;
  p.cu_seqlens_k = ck;
  p.mask.causal = true;
  ASSERT_TRUE(ref::attention_forward(p).ok());
  int oq = 0, ok = 0;
  for (int b = 0; b < 4; ++b) {
    HostTensor q1(F64, {1, lq[b], h, d}), k1(F64, {1, lk[b], h, d}), v1(F64, {1, lk[b], h, d});
    HostTensor o1(F64, {1, lq[b], h, d}), l1(F64, {1, h, lq[b]});
    for (int64_t i = 0; i < q1.numel(); ++i) q1.set(i, q.get(oq * h * d + i));
    for (int64_t i = 0; i < k1.numel(); ++i) k1.set(i, k.get(ok * h * d + i)), v1.set(i, v.get(ok * h * d + i));
    AttentionForwardParams p1;
    p1.q = q1; p1.k = k1; p1.v = v1; p1.out = o1; p1.lse = l1;
    p1.mask.causal = true;
    ASSERT_TRUE(ref::attention_forward(p1).ok());
    for (int64_t i = 0; i < o1.numel(); ++i) EXPECT_NEAR(o1.get(i), o.get(oq * h * d + i), 1e-12);
    for (int hh = 0; hh < h; ++hh)
      for (int i = 0; i < lq[b]; ++i) EXPECT_EQ(l1.get(hh * lq[b] + i), lse.get(hh * tq + oq + i));
    oq += lq[b];
    ok += lk[b];
  }
}

TEST(AttentionRef, SinkEqualsExtraKeyWithZeroValue) {
  Inputs in = make_inputs(1, 4, 6, 2, 2, 4, 5);
  HostTensor sinks(D::kFloat32, {2});
  sinks.set(0, 0.7);
  sinks.set(1, -1.3);
  AttentionForwardParams p = fwd_params(in);
  p.sinks = sinks;
  ASSERT_TRUE(ref::attention_forward(p).ok());
  // An extra key whose score equals the sink: q . k_extra * scale = sink. Use d=4 with
  // k_extra = e0 * sink / (scale * q0) per row is row-dependent, so check the algebra directly.
  const double scale = 0.5;
  for (int h = 0; h < 2; ++h)
    for (int i = 0; i < 4; ++i) {
      std::vector<double> s(7);
      for (int j = 0; j < 6; ++j) {
        double acc = 0;
        for (int c = 0; c < 4; ++c) acc += in.q.get((i * 2 + h) * 4 + c) * in.k.get((j * 2 + h) * 4 + c);
        s[j] = scale * acc;
      }
      s[6] = sinks.get(h);
      double sum = 0;
      for (double x : s) sum += std::exp(x);
      for (int c = 0; c < 4; ++c) {
        double o = 0;
        for (int j = 0; j < 6; ++j) o += std::exp(s[j]) / sum * in.v.get((j * 2 + h) * 4 + c);
        EXPECT_NEAR(in.out.get((i * 2 + h) * 4 + c), o, 1e-12);
      }
      EXPECT_NEAR(in.lse.get(h * 4 + i), std::log(sum), 1e-6);
    }
}

TEST(AttentionRef, SoftcapBoundsScores) {
  // With a tiny cap every score is ~0, so the output is the mean of the visible values.
  Inputs in = make_inputs(1, 3, 5, 1, 1, 4, 6);
  AttentionForwardParams p = fwd_params(in);
  p.softcap = 1e-9f;
  ASSERT_TRUE(ref::attention_forward(p).ok());
  for (int c = 0; c < 4; ++c) {
    double mean = 0;
    for (int j = 0; j < 5; ++j) mean += in.v.get(j * 4 + c) / 5;
    EXPECT_NEAR(in.out.get(c), mean, 1e-8);
  }
}

// Block-sparse lists from a dense predicate on blocks: full when every element visible,
// partial when some are, absent otherwise.
struct BlockLists {
  HostTensor kv_num, kv_idx, full_num, full_idx;
};
template <typename Pred>
BlockLists build_lists(int sq, int sk, int qbs, int kbs, Pred visible) {
  int nq = (sq + qbs - 1) / qbs, nk = (sk + kbs - 1) / kbs;
  BlockLists l{HostTensor(D::kInt32, {1, 1, nq}), HostTensor(D::kInt32, {1, 1, nq, nk}),
               HostTensor(D::kInt32, {1, 1, nq}), HostTensor(D::kInt32, {1, 1, nq, nk})};
  for (int qb = 0; qb < nq; ++qb) {
    int np = 0, nf = 0;
    for (int kb = 0; kb < nk; ++kb) {
      int vis = 0, all = 0;
      for (int i = qb * qbs; i < std::min(sq, (qb + 1) * qbs); ++i)
        for (int j = kb * kbs; j < std::min(sk, (kb + 1) * kbs); ++j) vis += visible(i, j), ++all;
      if (vis == all) l.full_idx.set(qb * nk + nf++, kb);
      else if (vis > 0) l.kv_idx.set(qb * nk + np++, kb);
    }
    l.kv_num.set(qb, np);
    l.full_num.set(qb, nf);
  }
  return l;
}

TEST(AttentionRef, BlockSparseCausalEqualsDenseCausal) {
  Inputs in = make_inputs(1, 37, 37, 2, 2, 8, 7);
  AttentionForwardParams p = fwd_params(in);
  p.mask.causal = true;
  ASSERT_TRUE(ref::attention_forward(p).ok());
  HostTensor dense = in.out;
  BlockLists l = build_lists(37, 37, 8, 16, [](int i, int j) { return j <= i; });
  BlockMask m;
  m.q_block_size = 8;
  m.kv_block_size = 16;
  m.kv_num_blocks = l.kv_num; m.kv_indices = l.kv_idx;
  m.full_kv_num_blocks = l.full_num; m.full_kv_indices = l.full_idx;
  m.element.causal = true;
  AttentionForwardParams ps = fwd_params(in);
  ps.block_mask = &m;
  ASSERT_TRUE(ref::attention_forward(ps).ok());
  EXPECT_LT(max_abs_diff(in.out, dense), 1e-12);
}

TEST(ElementMask, PredicatesCompose) {
  ElementMask m;
  m.prefix_length = 4;
  EXPECT_TRUE(element_visible(m, 0, 0, 1, 3, 10));   // inside the prefix
  EXPECT_FALSE(element_visible(m, 0, 0, 5, 6, 10));  // future, outside the prefix
  EXPECT_TRUE(element_visible(m, 0, 0, 6, 5, 10));
  HostTensor dq(D::kInt32, {1, 8}), dk(D::kInt32, {1, 8});
  for (int i = 0; i < 8; ++i) dq.set(i, i / 4), dk.set(i, i / 4);
  ElementMask docs;
  docs.causal = true;
  docs.doc_ids_q = dq;
  docs.doc_ids_k = dk;
  EXPECT_TRUE(element_visible(docs, 0, 0, 5, 4, 8));
  EXPECT_FALSE(element_visible(docs, 0, 0, 5, 3, 8));  // other document
  EXPECT_FALSE(element_visible(docs, 0, 0, 5, 6, 8));  // future
  HostTensor bits(D::kInt32, {1, 1, 2, 2});           // 2 rows x 64 columns
  bits.set(0, 1 << 5);
  bits.set(3, 1 << 1);  // row 1, column 33
  ElementMask bm;
  bm.bits = bits;
  bm.bits.dtype = D::kInt32;
  EXPECT_TRUE(element_visible(bm, 0, 0, 0, 5, 64));
  EXPECT_FALSE(element_visible(bm, 0, 0, 0, 6, 64));
  EXPECT_TRUE(element_visible(bm, 0, 0, 1, 33, 64));
  EXPECT_FALSE(element_visible(bm, 0, 0, 1, 1, 64));
}

// Central finite differences of L = sum(out * W) + sum(lse_finite * W2) w.r.t. every input.
struct GradCase {
  int b, sq, sk, h, hk, d;
  MaskParams mask;
  float softcap;
  bool sinks;
};

void check_gradients(const GradCase& gc, uint64_t seed) {
  Inputs in = make_inputs(gc.b, gc.sq, gc.sk, gc.h, gc.hk, gc.d, seed);
  std::mt19937_64 rng(seed + 100);
  HostTensor w(F64, {gc.b, gc.sq, gc.h, gc.d});
  w.fill_normal(rng);
  HostTensor sinks(F64, {gc.h});
  sinks.fill_normal(rng);
  auto loss = [&]() {
    AttentionForwardParams p = fwd_params(in);
    p.lse = TensorView{};
    p.mask = gc.mask;
    p.softcap = gc.softcap;
    if (gc.sinks) p.sinks = sinks;
    EXPECT_TRUE(ref::attention_forward(p).ok());
    double l = 0;
    for (int64_t i = 0; i < in.out.numel(); ++i) l += in.out.get(i) * w.get(i);
    return l;
  };
  HostTensor dq(F64, {gc.b, gc.sq, gc.h, gc.d}), dk(F64, {gc.b, gc.sk, gc.hk, gc.d}),
      dv(F64, {gc.b, gc.sk, gc.hk, gc.d}), ds(F64, {gc.h}), lse(F64, {gc.b, gc.h, gc.sq});
  AttentionBackwardParams bp;
  bp.q = in.q; bp.k = in.k; bp.v = in.v; bp.out = in.out; bp.dout = w; bp.lse = lse;
  bp.dq = dq; bp.dk = dk; bp.dv = dv;
  bp.mask = gc.mask;
  bp.softcap = gc.softcap;
  if (gc.sinks) bp.sinks = sinks, bp.dsinks = ds;
  ASSERT_TRUE(ref::attention_backward(bp).ok());
  const double eps = 1e-6;
  auto check = [&](HostTensor& x, const HostTensor& grad, const char* name) {
    double worst = 0, scale = 0;
    for (int64_t i = 0; i < x.numel(); ++i) {
      double x0 = x.get(i);
      x.set(i, x0 + eps);
      double lp = loss();
      x.set(i, x0 - eps);
      double lm = loss();
      x.set(i, x0);
      double fd = (lp - lm) / (2 * eps);
      worst = std::max(worst, std::abs(fd - grad.get(i)));
      scale = std::max(scale, std::abs(fd));
    }
    EXPECT_LT(worst, 1e-6 * std::max(1.0, scale)) << name;
    EXPECT_GT(scale, 0.0) << name << ": gradient identically zero, test cannot fail";
  };
  check(in.q, dq, "dq");
  check(in.k, dk, "dk");
  check(in.v, dv, "dv");
  if (gc.sinks) check(sinks, ds, "dsinks");
}

TEST(AttentionRefGrad, Plain) { check_gradients({1, 5, 6, 2, 2, 4, {}, 0.f, false}, 11); }
TEST(AttentionRefGrad, CausalGqaSqGreater) { check_gradients({2, 6, 4, 4, 2, 4, {true, -1, -1}, 0.f, false}, 12); }
TEST(AttentionRefGrad, WindowSoftcapSinks) { check_gradients({1, 7, 7, 2, 1, 4, {false, 2, 1}, 1.5f, true}, 13); }
// dsinks summed over sequences and over each KV head's group, from per-task parts.
TEST(AttentionRefGrad, BatchesGqaSinks) { check_gradients({3, 5, 6, 4, 2, 4, {true, -1, -1}, 0.f, true}, 14); }

// The oracles' tasks run on threads (reference/parallel.h): every output is the same, bit for
// bit, on one thread and on several.
TEST(AttentionRef, SameOnOneThreadAndOnSeveral) {
  const int64_t b = 3, sq = 9, sk = 11, h = 6, hk = 2, d = 8;
  Inputs in = make_inputs(b, sq, sk, h, hk, d, 21);
  std::mt19937_64 rng(22);
  HostTensor dout(F64, {b, sq, h, d}), sinks(F64, {h});
  dout.fill_normal(rng);
  sinks.fill_normal(rng);
  auto run = [&](int threads) {
    reference_threads_override() = threads;
    std::vector<HostTensor> outs(6);
    outs[0].reset(F64, {b, sq, h, d});
    outs[1].reset(F64, {b, h, sq});
    AttentionForwardParams p = fwd_params(in);
    p.out = outs[0];
    p.lse = outs[1];
    p.mask = MaskParams{true, -1, -1};
    p.sinks = sinks;
    EXPECT_TRUE(ref::attention_forward(p).ok());
    outs[2].reset(F64, {b, sq, h, d});
    outs[3].reset(F64, {b, sk, hk, d});
    outs[4].reset(F64, {b, sk, hk, d});
    outs[5].reset(F64, {h});
    AttentionBackwardParams bp;
    bp.q = in.q; bp.k = in.k; bp.v = in.v; bp.out = outs[0]; bp.dout = dout; bp.lse = outs[1];
    bp.dq = outs[2]; bp.dk = outs[3]; bp.dv = outs[4]; bp.dsinks = outs[5];
    bp.mask = p.mask;
    bp.sinks = sinks;
    EXPECT_TRUE(ref::attention_backward(bp).ok());
    reference_threads_override() = 0;
    return outs;
  };
  const std::vector<HostTensor> one = run(1), several = run(4);
  for (size_t t = 0; t < one.size(); ++t) {
    double nonzero = 0;
    for (int64_t i = 0; i < one[t].numel(); ++i) {
      EXPECT_EQ(one[t].get(i), several[t].get(i)) << "output " << t << " element " << i;
      nonzero += std::abs(one[t].get(i));
    }
    EXPECT_GT(nonzero, 0.0) << "output " << t << " all zero: the test cannot fail";
  }
}

TEST(DecodeRef, ContiguousEqualsDenseBottomRightCausal) {
  std::mt19937_64 rng(21);
  const int B = 3, qlen = 2, H = 4, HK = 2, d = 8, maxlen = 20;
  const int lens[B] = {1 + qlen, 17, 20};
  HostTensor q(F64, {B, qlen, H, d}), k(F64, {B, maxlen, HK, d}), v(F64, {B, maxlen, HK, d});
  HostTensor out(F64, {B, qlen, H, d}), lse(F64, {B, H, qlen}), cl(D::kInt32, {B});
  q.fill_normal(rng); k.fill_normal(rng); v.fill_normal(rng);
  for (int b = 0; b < B; ++b) cl.set(b, lens[b]);
  DecodeParams p;
  p.q = q; p.k_cache = k; p.v_cache = v; p.cache_seqlens = cl; p.out = out; p.lse = lse;
  p.causal = true;
  ASSERT_TRUE(ref::decode_forward(p).ok());
  for (int b = 0; b < B; ++b) {
    HostTensor q1(F64, {1, qlen, H, d}), k1(F64, {1, lens[b], HK, d}), v1(F64, {1, lens[b], HK, d});
    HostTensor o1(F64, {1, qlen, H, d});
    for (int64_t i = 0; i < q1.numel(); ++i) q1.set(i, q.get(b * qlen * H * d + i));
    for (int64_t i = 0; i < k1.numel(); ++i) k1.set(i, k.get(b * maxlen * HK * d + i)), v1.set(i, v.get(b * maxlen * HK * d + i));
    AttentionForwardParams ap;
    ap.q = q1; ap.k = k1; ap.v = v1; ap.out = o1;
    ap.mask.causal = true;
    ASSERT_TRUE(ref::attention_forward(ap).ok());
    for (int64_t i = 0; i < o1.numel(); ++i) EXPECT_NEAR(o1.get(i), out.get(b * qlen * H * d + i), 1e-12);
  }
}

TEST(DecodeRef, SameOnOneThreadAndOnSeveral) {
  std::mt19937_64 rng(23);
  const int B = 3, qlen = 2, H = 4, HK = 2, d = 8, maxlen = 20;
  HostTensor q(F64, {B, qlen, H, d}), k(F64, {B, maxlen, HK, d}), v(F64, {B, maxlen, HK, d}), cl(D::kInt32, {B});
  q.fill_normal(rng); k.fill_normal(rng); v.fill_normal(rng);
  for (int b = 0; b < B; ++b) cl.set(b, 7 + 6 * b);
  auto run = [&](int threads, HostTensor& out, HostTensor& lse) {
    reference_threads_override() = threads;
    out.reset(F64, {B, qlen, H, d});
    lse.reset(F64, {B, H, qlen});
    DecodeParams p;
    p.q = q; p.k_cache = k; p.v_cache = v; p.cache_seqlens = cl; p.out = out; p.lse = lse;
    p.causal = true;
    EXPECT_TRUE(ref::decode_forward(p).ok());
    reference_threads_override() = 0;
  };
  HostTensor o1, l1, o4, l4;
  run(1, o1, l1);
  run(4, o4, l4);
  for (int64_t i = 0; i < o1.numel(); ++i) EXPECT_EQ(o1.get(i), o4.get(i)) << i;
  for (int64_t i = 0; i < l1.numel(); ++i) EXPECT_EQ(l1.get(i), l4.get(i)) << i;
  EXPECT_GT(std::abs(o1.get(0)) + std::abs(o1.get(o1.numel() - 1)), 0.0);
}

TEST(DecodeRef, PagedEqualsContiguous) {
  std::mt19937_64 rng(22);
  const int B = 2, H = 2, HK = 1, d = 8, page = 4, pages_per_seq = 5, maxlen = page * pages_per_seq;
  HostTensor q(F64, {B, 1, H, d}), k(F64, {B, maxlen, HK, d}), v(F64, {B, maxlen, HK, d});
  HostTensor o(F64, {B, 1, H, d}), o2(F64, {B, 1, H, d}), cl(D::kInt32, {B});
  q.fill_normal(rng); k.fill_normal(rng); v.fill_normal(rng);
  cl.set(0, 13);
  cl.set(1, 20);
  // Scatter into pages in a shuffled order.
  const int num_pages = B * pages_per_seq;
  HostTensor kp(F64, {num_pages, page, HK, d}), vp(F64, {num_pages, page, HK, d});
  HostTensor table(D::kInt32, {B, pages_per_seq});
  std::vector<int> perm(num_pages);
  for (int i = 0; i < num_pages; ++i) perm[i] = i;
  std::shuffle(perm.begin(), perm.end(), rng);
  for (int b = 0; b < B; ++b)
    for (int pg = 0; pg < pages_per_seq; ++pg) {
      int phys = perm[b * pages_per_seq + pg];
      table.set(b * pages_per_seq + pg, phys);
      for (int t = 0; t < page; ++t)
        for (int c = 0; c < d; ++c) {
          int64_t src = (b * maxlen + pg * page + t) * d + c, dst = (phys * page + t) * d + c;
          kp.set(dst, k.get(src));
          vp.set(dst, v.get(src));
        }
    }
  DecodeParams p;
  p.q = q; p.k_cache = k; p.v_cache = v; p.cache_seqlens = cl; p.out = o;
  p.window_left = 6;
  ASSERT_TRUE(ref::decode_forward(p).ok());
  DecodeParams pp = p;
  pp.k_cache = kp; pp.v_cache = vp; pp.page_table = table; pp.out = o2;
  ASSERT_TRUE(ref::decode_forward(pp).ok());
  EXPECT_LT(max_abs_diff(o, o2), 1e-12);
}

TEST(MergeStates, SplitRowMergesToWhole) {
  // One row attended over 12 keys equals three 4-key partial states merged by LSE.
  Inputs in = make_inputs(1, 1, 12, 1, 1, 4, 31);
  AttentionForwardParams p = fwd_params(in);
  HostTensor lse(F64, {1, 1, 1});
  p.lse = lse;
  ASSERT_TRUE(ref::attention_forward(p).ok());
  std::vector<double> outs(12), lses(3), merged(4);
  for (int s = 0; s < 3; ++s) {
    HostTensor k1(F64, {1, 4, 1, 4}), v1(F64, {1, 4, 1, 4}), o1(F64, {1, 1, 1, 4}), l1(F64, {1, 1, 1});
    for (int i = 0; i < 16; ++i) k1.set(i, in.k.get(s * 16 + i)), v1.set(i, in.v.get(s * 16 + i));
    AttentionForwardParams ps = p;
    ps.k = k1; ps.v = v1; ps.out = o1; ps.lse = l1;
    ASSERT_TRUE(ref::attention_forward(ps).ok());
    for (int c = 0; c < 4; ++c) outs[s * 4 + c] = o1.get(c);
    lses[s] = l1.get(0);
  }
  double mlse;
  merge_states(3, 4, outs.data(), lses.data(), merged.data(), &mlse);
  for (int c = 0; c < 4; ++c) EXPECT_NEAR(merged[c], in.out.get(c), 1e-12);
  EXPECT_NEAR(mlse, lse.get(0), 1e-12);
}

TEST(AttentionRef, EmulatedDtypeDiffersFromExactButStaysClose) {
  // bf16 emulation must move the result (else the tolerance rule is vacuous) but not by much.
  Inputs in = make_inputs(1, 16, 16, 1, 1, 32, 41);
  AttentionForwardParams p = fwd_params(in);
  ASSERT_TRUE(ref::attention_forward(p).ok());
  HostTensor exact = in.out;
  HostTensor qb(D::kBFloat16, {1, 16, 1, 32}), kb(D::kBFloat16, {1, 16, 1, 32}), vb(D::kBFloat16, {1, 16, 1, 32});
  for (int64_t i = 0; i < qb.numel(); ++i) qb.set(i, in.q.get(i)), kb.set(i, in.k.get(i)), vb.set(i, in.v.get(i));
  HostTensor o1(F64, {1, 16, 1, 32}), o2(F64, {1, 16, 1, 32});
  AttentionForwardParams pb = p;
  pb.q = qb; pb.k = kb; pb.v = vb; pb.out = o1; pb.lse = TensorView{};
  ASSERT_TRUE(ref::attention_forward(pb).ok());
  pb.out = o2;
  ASSERT_TRUE(ref::attention_forward(pb, {true}).ok());
  double e = max_abs_diff(o1, o2);
  EXPECT_GT(e, 1e-5);
  EXPECT_LT(e, 5e-2);
}

}  // namespace
}  // namespace flare::ref
