// CPU oracle for softmax attention. Plain loops over (sequence, head, query row) in fp64.
#include "reference/attention_ref.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "reference/numeric.h"
#include "reference/parallel.h"

namespace flare::ref {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// The rows of one (sequence, head) slice, gathered into a dense [len, dim] fp64 matrix.
struct Slice {
  int64_t len = 0, dim = 0;
  std::vector<double> data;
  const double* row(int64_t r) const { return data.data() + r * dim; }
};

// Layout facts of q/k/v-like tensors: batched [b, s, h, d] or varlen [total, h, d].
struct Layout {
  bool varlen = false;
  int64_t batch = 0, heads = 0, dim = 0;
  std::vector<int64_t> starts, lens;  // per sequence: first row (varlen) and length
};

Layout layout_of(const TensorView& t, const TensorView& cu_seqlens) {
  Layout l;
  l.varlen = cu_seqlens.defined();
  l.heads = t.size(-2);
  l.dim = t.size(-1);
  if (l.varlen) {
    l.batch = cu_seqlens.size(0) - 1;
    for (int64_t b = 0; b < l.batch; ++b) {
      int64_t s = load_index(cu_seqlens, b), e = load_index(cu_seqlens, b + 1);
      l.starts.push_back(s);
      l.lens.push_back(e - s);
    }
  } else {
    l.batch = t.size(0);
    l.starts.assign(static_cast<size_t>(l.batch), 0);
    l.lens.assign(static_cast<size_t>(l.batch), t.size(1));
  }
  return l;
}

// Element offset of (sequence b, row r, head h, column c).
int64_t offset(const TensorView& t, const Layout& l, int64_t b, int64_t r, int64_t h, int64_t c) {
  if (l.varlen) return (l.starts[b] + r) * t.stride[0] + h * t.stride[1] + c * t.stride[2];
  return b * t.stride[0] + r * t.stride[1] + h * t.stride[2] + c * t.stride[3];
}

Slice gather(const TensorView& t, const Layout& l, int64_t b, int64_t h) {
  Slice s;
  s.len = l.lens[b];
  s.dim = l.dim;
  s.data.resize(static_cast<size_t>(s.len * s.dim));
  for (int64_t r = 0; r < s.len; ++r)
    for (int64_t c = 0; c < s.dim; ++c) s.data[r * s.dim + c] = load(t, offset(t, l, b, r, h, c));
  return s;
}

void scatter(const TensorView& t, const Layout& l, int64_t b, int64_t h, const Slice& s) {
  for (int64_t r = 0; r < s.len; ++r)
    for (int64_t c = 0; c < s.dim; ++c) store(t, offset(t, l, b, r, h, c), s.data[r * s.dim + c]);
}

// LSE element offset: batched [b, h, sq]; varlen [h, total_q].
int64_t lse_offset(const TensorView& lse, const Layout& l, int64_t b, int64_t h, int64_t r) {
  if (l.varlen) return h * lse.stride[0] + (l.starts[b] + r) * lse.stride[1];
  return b * lse.stride[0] + h * lse.stride[1] + r * lse.stride[2];
}

double dot(const double* a, const double* b, int64_t n) {
  double s = 0;
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// Everything that decides one score: scale, cap, mask, the dtype to emulate.
struct ScoreRule {
  double scale = 1, softcap = 0;
  bool emulate = false;
  DType dtype = DType::kFloat64;
  double r(double x) const { return emulate ? round_to(dtype, x) : x; }
};

// Scores of query row i against all keys (-inf where masked), and the derivative of the cap.
template <typename Visible>
void row_scores(const ScoreRule& rule, const double* q, const Slice& k, Visible visible,
                std::vector<double>& s, std::vector<double>& cap_grad) {
  s.assign(static_cast<size_t>(k.len), -kInf);
  cap_grad.assign(static_cast<size_t>(k.len), 1.0);
  for (int64_t j = 0; j < k.len; ++j) {
    if (!visible(j)) continue;
    double x = rule.r(rule.scale * dot(q, k.row(j), k.dim));
    if (rule.softcap > 0) {
      double t = std::tanh(x / rule.softcap);
      x = rule.softcap * t;
      cap_grad[j] = 1 - t * t;
    }
    s[j] = x;
  }
}

// Softmax statistics of a row with an optional sink logit: returns the LSE (+inf when nothing
// is visible and there is no sink) and fills p.
double row_softmax(const std::vector<double>& s, double sink, std::vector<double>& p) {
  double m = sink;
  for (double x : s) m = std::max(m, x);
  p.assign(s.size(), 0.0);
  if (m == -kInf) return kInf;
  double sum = std::exp(sink - m);
  for (double x : s) sum += std::exp(x - m);
  double lse = m + std::log(sum);
  for (size_t j = 0; j < s.size(); ++j) p[j] = std::exp(s[j] - lse);
  return lse;
}

struct Problem {
  Layout lq, lk;
  int64_t heads = 0, heads_kv = 0, dim = 0, dim_v = 0;
  ScoreRule rule;
};

Status make_problem(const TensorView& q, const TensorView& k, const TensorView& v,
                    const TensorView& cu_q, const TensorView& cu_k, float scale, float softcap,
                    bool emulate, Problem* pr) {
  if (!q.defined() || !k.defined() || !v.defined()) return Status::InvalidArgument("q", "q, k and v are required");
  if (cu_q.defined() != cu_k.defined())
    return Status::InvalidArgument("cu_seqlens_k", "give both cu_seqlens_q and cu_seqlens_k or neither");
  int want = cu_q.defined() ? 3 : 4;
  if (q.rank != want || k.rank != want || v.rank != want)
    return Status::InvalidArgument("q", "expected rank " + std::to_string(want));
  pr->lq = layout_of(q, cu_q);
  pr->lk = layout_of(k, cu_k);
  pr->heads = pr->lq.heads;
  pr->heads_kv = pr->lk.heads;
  pr->dim = pr->lq.dim;
  pr->dim_v = v.size(-1);
  if (pr->heads_kv == 0 || pr->heads % pr->heads_kv != 0)
    return Status::InvalidArgument("k", "heads_kv must divide heads");
  if (pr->lq.batch != pr->lk.batch) return Status::InvalidArgument("k", "batch differs from q");
  pr->rule.scale = scale > 0 ? scale : 1.0 / std::sqrt(static_cast<double>(pr->dim));
  pr->rule.softcap = softcap;
  pr->rule.emulate = emulate;
  pr->rule.dtype = q.dtype;
  return Status::Ok();
}

// The visibility of (row i, column j) for sequence b, head h.
struct Visibility {
  const MaskParams* mask;
  const BlockMask* block;
  int64_t sq, sk, b, h;
  bool operator()(int64_t i, int64_t j) const {
    if (!dense_visible(*mask, i, j, sq, sk)) return false;
    return block == nullptr || block_sparse_visible(*block, b, h, i, j, sk);
  }
};

double sink_of(const TensorView& sinks, int64_t h) {
  return sinks.defined() ? load(sinks, h * sinks.stride[0]) : -kInf;
}

bool contains(const TensorView& counts, const TensorView& indices, int64_t b, int64_t h,
              int64_t row, int64_t block) {
  if (!counts.defined()) return false;
  int64_t bb = counts.size(0) == 1 ? 0 : b, hh = counts.size(1) == 1 ? 0 : h;
  int64_t n = load_index(counts, bb * counts.stride[0] + hh * counts.stride[1] + row * counts.stride[2]);
  for (int64_t t = 0; t < n; ++t) {
    int64_t off = bb * indices.stride[0] + hh * indices.stride[1] + row * indices.stride[2] +
                  t * indices.stride[3];
    if (load_index(indices, off) == block) return true;
  }
  return false;
}

}  // namespace

bool dense_visible(const MaskParams& m, int64_t i, int64_t j, int64_t seqlen_q, int64_t seqlen_k) {
  int64_t diag = i + seqlen_k - seqlen_q;  // the key column aligned with row i
  int64_t right = m.causal ? 0 : m.window_right;
  if (right >= 0 && j > diag + right) return false;
  if (m.window_left >= 0 && j < diag - m.window_left) return false;
  return true;
}

bool element_visible(const ElementMask& m, int64_t b, int64_t h, int64_t i, int64_t j,
                     int64_t seqlen_k) {
  if (m.causal && j > i) return false;
  if (m.window_left >= 0 && i - j > m.window_left) return false;
  if (m.window_right >= 0 && j - i > m.window_right) return false;
  if (m.prefix_length >= 0 && !(j < m.prefix_length || j <= i)) return false;
  if (m.doc_ids_q.defined()) {
    int64_t dq = load_index(m.doc_ids_q, b * m.doc_ids_q.stride[0] + i * m.doc_ids_q.stride[1]);
    int64_t dk = load_index(m.doc_ids_k, b * m.doc_ids_k.stride[0] + j * m.doc_ids_k.stride[1]);
    if (dq != dk) return false;
  }
  if (m.bits.defined()) {
    const TensorView& t = m.bits;
    int64_t bb = t.size(0) == 1 ? 0 : b, hh = t.size(1) == 1 ? 0 : h;
    (void)seqlen_k;
    uint32_t word = static_cast<const uint32_t*>(t.data)[bb * t.stride[0] + hh * t.stride[1] +
                                                         i * t.stride[2] + (j / 32) * t.stride[3]];
    if (!((word >> (j % 32)) & 1u)) return false;
  }
  return true;
}

bool block_sparse_visible(const BlockMask& m, int64_t b, int64_t h, int64_t i, int64_t j,
                          int64_t seqlen_k) {
  int64_t qb = i / m.q_block_size, kb = j / m.kv_block_size;
  if (contains(m.full_kv_num_blocks, m.full_kv_indices, b, h, qb, kb)) return true;
  if (contains(m.kv_num_blocks, m.kv_indices, b, h, qb, kb))
    return element_visible(m.element, b, h, i, j, seqlen_k);
  return false;
}

Status attention_forward(const AttentionForwardParams& p, const AttentionRefOptions& opt) {
  Problem pr;
  FLARE_RETURN_IF_ERROR(make_problem(p.q, p.k, p.v, p.cu_seqlens_q, p.cu_seqlens_k,
                                     p.softmax_scale, p.softcap, opt.emulate_input_dtype, &pr));
  const int64_t group = pr.heads / pr.heads_kv;
  // One task per (sequence, head): it writes only that head's rows of out and lse.
  parallel_tasks(pr.lq.batch * pr.heads, [&](int64_t task) {
    const int64_t b = task / pr.heads, h = task % pr.heads;
    const int64_t sq = pr.lq.lens[b], sk = pr.lk.lens[b];
    std::vector<double> s, cap_grad, prob;
    {
      Slice q = gather(p.q, pr.lq, b, h);
      Slice k = gather(p.k, pr.lk, b, h / group);
      Slice v = gather(p.v, pr.lk, b, h / group);
      Slice o{sq, pr.dim_v, std::vector<double>(static_cast<size_t>(sq * pr.dim_v), 0.0)};
      Visibility vis{&p.mask, p.block_mask, sq, sk, b, h};
      for (int64_t i = 0; i < sq; ++i) {
        row_scores(pr.rule, q.row(i), k, [&](int64_t j) { return vis(i, j); }, s, cap_grad);
        double lse = row_softmax(s, sink_of(p.sinks, h), prob);
        for (int64_t j = 0; j < sk; ++j) {
          double pj = pr.rule.r(prob[j]);
          if (pj == 0) continue;
          for (int64_t c = 0; c < pr.dim_v; ++c) o.data[i * pr.dim_v + c] += pj * v.row(j)[c];
        }
        if (p.lse.defined()) store(p.lse, lse_offset(p.lse, pr.lq, b, h, i), lse);
      }
      if (pr.rule.emulate)
        for (double& x : o.data) x = pr.rule.r(x);
      scatter(p.out, pr.lq, b, h, o);
    }
  });
  return Status::Ok();
}

Status attention_backward(const AttentionBackwardParams& p, const AttentionRefOptions& opt) {
  Problem pr;
  FLARE_RETURN_IF_ERROR(make_problem(p.q, p.k, p.v, p.cu_seqlens_q, p.cu_seqlens_k,
                                     p.softmax_scale, p.softcap, opt.emulate_input_dtype, &pr));
  const int64_t group = pr.heads / pr.heads_kv;
  const ScoreRule& rule = pr.rule;
  // One task per (sequence, KV head): it writes that KV head's dK, dV and its query heads' dQ, and
  // its own share of dsinks (summed below in task order).
  std::vector<double> dsink_parts(static_cast<size_t>(pr.lq.batch * pr.heads), 0.0);  // [sequence, head]
  parallel_tasks(pr.lq.batch * pr.heads_kv, [&](int64_t task) {
    const int64_t b = task / pr.heads_kv, hk = task % pr.heads_kv;
    const int64_t sq = pr.lq.lens[b], sk = pr.lk.lens[b];
    std::vector<double> s, cap_grad, prob;
    double* dsinks = dsink_parts.data() + b * pr.heads;  // this sequence's, indexed by the head h
    {
      Slice k = gather(p.k, pr.lk, b, hk);
      Slice v = gather(p.v, pr.lk, b, hk);
      Slice dk{sk, pr.dim, std::vector<double>(static_cast<size_t>(sk * pr.dim), 0.0)};
      Slice dv{sk, pr.dim_v, std::vector<double>(static_cast<size_t>(sk * pr.dim_v), 0.0)};
      for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
        Slice q = gather(p.q, pr.lq, b, h);
        Slice dout = gather(p.dout, pr.lq, b, h);
        // Emulating the input dtype, D_i = dO_i . O_i uses the O the caller passes (the forward's
        // stored output, as the kernels do); the fp64 reference recomputes O exactly.
        const bool out_given = rule.emulate && p.out.defined();
        Slice out = out_given ? gather(p.out, pr.lq, b, h) : Slice{};
        Slice dq{sq, pr.dim, std::vector<double>(static_cast<size_t>(sq * pr.dim), 0.0)};
        Visibility vis{&p.mask, p.block_mask, sq, sk, b, h};
        const double sink = sink_of(p.sinks, h);
        for (int64_t i = 0; i < sq; ++i) {
          row_scores(rule, q.row(i), k, [&](int64_t j) { return vis(i, j); }, s, cap_grad);
          double lse = row_softmax(s, sink, prob);
          if (lse == kInf) continue;
          const double* g = dout.row(i);
          // D_i = sum_j P_ij dP_ij = dO_i . O_i (the sink carries no value). Emulating the input
          // dtype, D_i is dO_i . O_i with O rounded to the dtype, as the kernels compute it.
          std::vector<double> dp(static_cast<size_t>(sk), 0.0);
          double d_i = 0;
          for (int64_t j = 0; j < sk; ++j) {
            if (prob[j] == 0) continue;
            dp[j] = rule.r(dot(g, v.row(j), pr.dim_v));
            if (!rule.emulate) d_i += prob[j] * dp[j];
          }
          if (rule.emulate && out_given) {
            d_i = dot(g, out.row(i), pr.dim_v);
          } else if (rule.emulate) {
            for (int64_t c = 0; c < pr.dim_v; ++c) {
              double o_c = 0;
              for (int64_t j = 0; j < sk; ++j)
                if (prob[j] != 0) o_c += rule.r(prob[j]) * v.row(j)[c];
              d_i += g[c] * rule.r(o_c);
            }
          }
          dsinks[h] -= std::exp(sink - lse) * d_i;
          for (int64_t j = 0; j < sk; ++j) {
            if (prob[j] == 0) continue;
            double pj = rule.r(prob[j]);
            double ds = rule.r(pj * (dp[j] - d_i)) * cap_grad[j] * rule.scale;
            for (int64_t c = 0; c < pr.dim; ++c) {
              dq.data[i * pr.dim + c] += ds * k.row(j)[c];
              dk.data[j * pr.dim + c] += ds * q.row(i)[c];
            }
            for (int64_t c = 0; c < pr.dim_v; ++c) dv.data[j * pr.dim_v + c] += pj * g[c];
          }
        }
        if (rule.emulate)
          for (double& x : dq.data) x = rule.r(x);
        scatter(p.dq, pr.lq, b, h, dq);
      }
      if (rule.emulate) {
        for (double& x : dk.data) x = rule.r(x);
        for (double& x : dv.data) x = rule.r(x);
      }
      scatter(p.dk, pr.lk, b, hk, dk);
      scatter(p.dv, pr.lk, b, hk, dv);
    }
  });
  if (p.dsinks.defined())
    for (int64_t h = 0; h < pr.heads; ++h) {
      double sum = 0;
      for (int64_t b = 0; b < pr.lq.batch; ++b) sum += dsink_parts[static_cast<size_t>(b * pr.heads + h)];
      store(p.dsinks, h * p.dsinks.stride[0], sum);
    }
  return Status::Ok();
}

void merge_states(int num_states, int dim, const double* outs, const double* lses, double* out,
                  double* lse) {
  double m = -kInf;
  for (int s = 0; s < num_states; ++s) m = std::max(m, lses[s]);
  for (int c = 0; c < dim; ++c) out[c] = 0;
  if (m == -kInf || m == kInf) {
    *lse = m == kInf ? kInf : -kInf;
    return;
  }
  double sum = 0;
  for (int s = 0; s < num_states; ++s) sum += std::exp(lses[s] - m);
  *lse = m + std::log(sum);
  for (int s = 0; s < num_states; ++s) {
    double w = std::exp(lses[s] - *lse);
    for (int c = 0; c < dim; ++c) out[c] += w * outs[s * dim + c];
  }
}

Status decode_forward(const DecodeParams& p) {
  const TensorView& q = p.q;
  if (q.rank != 4) return Status::InvalidArgument("q", "expected [batch, q_len, heads_q, head_dim]");
  const bool paged = p.page_table.defined();
  const int64_t batch = q.size(0), q_len = q.size(1), heads = q.size(2), dim = q.size(3);
  const int64_t heads_kv = p.k_cache.size(2);
  if (heads_kv == 0 || heads % heads_kv) return Status::InvalidArgument("k_cache", "heads_kv must divide heads_q");
  const int64_t page_size = paged ? p.k_cache.size(1) : 0;
  const double scale = p.softmax_scale > 0 ? p.softmax_scale : 1.0 / std::sqrt(static_cast<double>(dim));
  // Cache element offset of token t of sequence b, kv head hk, channel c.
  auto cache_offset = [&](const TensorView& t, int64_t b, int64_t tok, int64_t hk, int64_t c) {
    if (!paged) return b * t.stride[0] + tok * t.stride[1] + hk * t.stride[2] + c * t.stride[3];
    int64_t page = load_index(p.page_table, b * p.page_table.stride[0] + (tok / page_size) * p.page_table.stride[1]);
    return page * t.stride[0] + (tok % page_size) * t.stride[1] + hk * t.stride[2] + c * t.stride[3];
  };
  // One task per (sequence, query head): it writes only that head's rows of out and lse.
  parallel_tasks(batch * heads, [&](int64_t task) {
    const int64_t b = task / heads, h = task % heads;
    const int64_t len = load_index(p.cache_seqlens, b * p.cache_seqlens.stride[0]);
    std::vector<double> qrow(static_cast<size_t>(dim)), s, prob;
    {
      const int64_t hk = h / (heads / heads_kv);
      for (int64_t t = 0; t < q_len; ++t) {
        for (int64_t c = 0; c < dim; ++c)
          qrow[c] = load(q, b * q.stride[0] + t * q.stride[1] + h * q.stride[2] + c * q.stride[3]);
        const int64_t last = p.causal ? len - q_len + t : len - 1;  // last visible key
        s.assign(static_cast<size_t>(len), -kInf);
        for (int64_t j = 0; j < len; ++j) {
          if (j > last) continue;
          if (p.window_left >= 0 && j < last - p.window_left) continue;
          double acc = 0;
          for (int64_t c = 0; c < dim; ++c) acc += qrow[c] * load(p.k_cache, cache_offset(p.k_cache, b, j, hk, c));
          s[j] = scale * acc;
        }
        double lse = row_softmax(s, -kInf, prob);
        for (int64_t c = 0; c < dim; ++c) {
          double acc = 0;
          for (int64_t j = 0; j < len; ++j)
            if (prob[j] != 0) acc += prob[j] * load(p.v_cache, cache_offset(p.v_cache, b, j, hk, c));
          store(p.out, b * p.out.stride[0] + t * p.out.stride[1] + h * p.out.stride[2] + c * p.out.stride[3], acc);
        }
        if (p.lse.defined())
          store(p.lse, b * p.lse.stride[0] + h * p.lse.stride[1] + t * p.lse.stride[2], lse);
      }
    }
  });
  return Status::Ok();
}

}  // namespace flare::ref
