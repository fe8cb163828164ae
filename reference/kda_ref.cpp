// CPU fp64 oracles for KDA / GDN: the recurrence, its reverse mode, and the chunked WY form.
//
// Every entry point first turns its views into a Problem: checked shapes, the list of sequences,
// dense fp64 copies of the raw inputs and the activated inputs the recurrence consumes (q, k after
// l2norm; beta after sigmoid; the log decay after the gate, expanded to one value per key channel
// so KDA and GDN share one code path). Gradients are computed w.r.t. the activated inputs and then
// chained back through the activations to the raw ones.
#include "reference/kda_ref.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "reference/numeric.h"

namespace flare::ref {
namespace {

constexpr double kL2NormEps = 1e-6;  // q, k <- x / sqrt(sum x^2 + eps), as in fla's l2norm
constexpr int64_t kSubChunk = 16;     // the GPU backward's unit of safe exponent offsets

// ------------------------------------------------------------------------------------------------
// Dense fp64 copies of strided views.

// Element offset of the row-major linear index `i` in a strided view.
int64_t strided_offset(const TensorView& t, int64_t i) {
  int64_t offset = 0;
  for (int d = t.rank - 1; d >= 0; --d) {
    offset += (i % t.shape[d]) * t.stride[d];
    i /= t.shape[d];
  }
  return offset;
}

std::vector<double> read_dense(const TensorView& t) {
  if (!t.defined()) return {};
  std::vector<double> out(static_cast<size_t>(t.numel()));
  for (int64_t i = 0; i < t.numel(); ++i) out[i] = load(t, strided_offset(t, i));
  return out;
}

void write_dense(const TensorView& t, const std::vector<double>& x) {
  for (int64_t i = 0; i < t.numel(); ++i) store(t, strided_offset(t, i), x[i]);
}

// ------------------------------------------------------------------------------------------------
// Argument checks. Messages name the argument and say what was expected.

std::string shape_string(const int64_t* shape, int rank) {
  std::string s = "[";
  for (int d = 0; d < rank; ++d) s += (d ? ", " : "") + std::to_string(shape[d]);
  return s + "]";
}

bool is_float(DType t) {
  return t == DType::kFloat16 || t == DType::kBFloat16 || t == DType::kFloat32 ||
         t == DType::kFloat64;
}

// A given CPU view with readable data.
Status check_storage(const TensorView& t, const std::string& name) {
  if (!t.defined()) return Status::InvalidArgument(name, "is required");
  if (t.device.kind != DeviceKind::kCPU) return Status::InvalidArgument(name, "expected a CPU view");
  if (t.data == nullptr && t.numel() > 0) return Status::InvalidArgument(name, "has no data");
  return Status::Ok();
}

// A given float CPU view of exactly this shape.
Status check_float(const TensorView& t, const std::string& name, std::vector<int64_t> shape) {
  FLARE_RETURN_IF_ERROR(check_storage(t, name));
  if (!is_float(t.dtype)) return Status::InvalidArgument(name, "expected a floating-point dtype");
  const int rank = static_cast<int>(shape.size());
  bool same = t.rank == rank;
  for (int d = 0; same && d < rank; ++d) same = t.shape[d] == shape[d];
  if (!same) {
    return Status::InvalidArgument(name, "expected shape " + shape_string(shape.data(), rank) +
                                             ", got " + shape_string(t.shape, t.rank));
  }
  return Status::Ok();
}

Status check_optional_float(const TensorView& t, const std::string& name, std::vector<int64_t> shape) {
  return t.defined() ? check_float(t, name, std::move(shape)) : Status::Ok();
}

// ------------------------------------------------------------------------------------------------
// The problem: shapes, sequences, raw and activated inputs.

struct KdaShape {
  int64_t B = 0, T = 0, H = 0, HV = 0, K = 0, V = 0;
  int64_t N = 0;                 // number of sequences (B, or cu_seqlens entries - 1)
  bool gate_per_channel = true;  // KDA: g [B,T,HV,K]; GDN: g [B,T,HV]

  int64_t group() const { return HV / H; }  // value heads sharing one q/k head
  // Offsets into dense row-major buffers.
  int64_t qk_row(int64_t b, int64_t t, int64_t hv) const { return ((b * T + t) * H + hv / group()) * K; }
  int64_t v_row(int64_t b, int64_t t, int64_t hv) const { return ((b * T + t) * HV + hv) * V; }
  int64_t key_row(int64_t b, int64_t t, int64_t hv) const { return ((b * T + t) * HV + hv) * K; }
  int64_t head(int64_t b, int64_t t, int64_t hv) const { return (b * T + t) * HV + hv; }
  int64_t state(int64_t n, int64_t hv) const { return (n * HV + hv) * K * V; }
  int64_t state_size() const { return K * V; }
};

// One sequence: tokens [begin, begin + length) of batch row `batch`; its state index is its position.
struct Sequence {
  int64_t batch = 0, begin = 0, length = 0;
};

// The views both directions read.
struct KdaInputs {
  TensorView q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens;
  KdaOptions options;
};

KdaInputs inputs_of(const KdaForwardParams& p) {
  return {p.q, p.k, p.v, p.g, p.beta, p.A_log, p.dt_bias, p.initial_state, p.cu_seqlens, p.options};
}
KdaInputs inputs_of(const KdaBackwardParams& p) {
  return {p.q, p.k, p.v, p.g, p.beta, p.A_log, p.dt_bias, p.initial_state, p.cu_seqlens, p.options};
}

struct Problem {
  KdaShape shape;
  std::vector<Sequence> sequences;
  KdaOptions options;
  double scale = 0;
  // Raw inputs, dense row-major in their own shapes (A_log, dt_bias, h0 empty when absent).
  std::vector<double> q_raw, k_raw, v, g_raw, beta_raw, A_log, dt_bias, h0;
  // Activated inputs: q, k [B,T,H,K]; g [B,T,HV,K] (per channel even for GDN); beta [B,T,HV].
  std::vector<double> q, k, g, beta;
};

Status check_shapes(const KdaInputs& in, KdaShape* s) {
  FLARE_RETURN_IF_ERROR(check_storage(in.q, "q"));
  if (in.q.rank != 4) {
    return Status::InvalidArgument("q", "expected shape [B, T, H, K], got " +
                                            shape_string(in.q.shape, in.q.rank));
  }
  s->B = in.q.shape[0], s->T = in.q.shape[1], s->H = in.q.shape[2], s->K = in.q.shape[3];
  FLARE_RETURN_IF_ERROR(check_float(in.q, "q", {s->B, s->T, s->H, s->K}));
  if (s->H < 1 || s->K < 1) return Status::InvalidArgument("q", "H and K must be positive");
  FLARE_RETURN_IF_ERROR(check_float(in.k, "k", {s->B, s->T, s->H, s->K}));

  FLARE_RETURN_IF_ERROR(check_storage(in.v, "v"));
  if (in.v.rank != 4 || in.v.shape[2] < 1 || in.v.shape[3] < 1 || in.v.shape[2] % s->H != 0) {
    return Status::InvalidArgument("v", "expected shape [B, T, HV, V] with HV a multiple of H=" +
                                            std::to_string(s->H) + ", got " +
                                            shape_string(in.v.shape, in.v.rank));
  }
  s->HV = in.v.shape[2], s->V = in.v.shape[3];
  FLARE_RETURN_IF_ERROR(check_float(in.v, "v", {s->B, s->T, s->HV, s->V}));

  FLARE_RETURN_IF_ERROR(check_storage(in.g, "g"));
  s->gate_per_channel = in.g.rank == 4;
  if (s->gate_per_channel) {
    FLARE_RETURN_IF_ERROR(check_float(in.g, "g", {s->B, s->T, s->HV, s->K}));
  } else if (in.g.rank == 3) {
    FLARE_RETURN_IF_ERROR(check_float(in.g, "g", {s->B, s->T, s->HV}));
  } else {
    return Status::InvalidArgument("g", "expected shape [B, T, HV, K] (KDA) or [B, T, HV] (GDN), got " +
                                            shape_string(in.g.shape, in.g.rank));
  }
  FLARE_RETURN_IF_ERROR(check_float(in.beta, "beta", {s->B, s->T, s->HV}));
  FLARE_RETURN_IF_ERROR(check_optional_float(in.A_log, "A_log", {s->HV}));
  FLARE_RETURN_IF_ERROR(
      check_optional_float(in.dt_bias, "dt_bias", {s->gate_per_channel ? s->HV * s->K : s->HV}));
  return Status::Ok();
}

Status check_options(const KdaInputs& in) {
  const KdaOptions& o = in.options;
  if (!std::isfinite(o.scale)) return Status::InvalidArgument("options.scale", "must be finite");
  if (!o.gate_in_kernel) return Status::Ok();
  if (!(o.lower_bound <= 0.f)) {
    return Status::InvalidArgument("options.lower_bound",
                                   "must be negative (bounded gate) or 0 (default gate)");
  }
  if (o.lower_bound == 0.f && !in.A_log.defined()) {
    return Status::InvalidArgument("A_log", "is required by gate_in_kernel without lower_bound");
  }
  return Status::Ok();
}

// Sequences from cu_seqlens (packed, B == 1) or one per batch row.
Status read_sequences(const KdaInputs& in, KdaShape* s, std::vector<Sequence>* seqs) {
  seqs->clear();
  if (!in.cu_seqlens.defined()) {
    for (int64_t b = 0; b < s->B; ++b) seqs->push_back({b, 0, s->T});
    s->N = s->B;
    return Status::Ok();
  }
  const TensorView& cu = in.cu_seqlens;
  FLARE_RETURN_IF_ERROR(check_storage(cu, "cu_seqlens"));
  if (cu.dtype != DType::kInt32 && cu.dtype != DType::kInt64) {
    return Status::InvalidArgument("cu_seqlens", "expected dtype int32 or int64");
  }
  if (cu.rank != 1 || cu.shape[0] < 1) {
    return Status::InvalidArgument("cu_seqlens",
                                   "expected shape [N + 1], got " + shape_string(cu.shape, cu.rank));
  }
  if (s->B != 1) {
    return Status::InvalidArgument("cu_seqlens", "requires B == 1, got B=" + std::to_string(s->B));
  }
  const int64_t n_seq = cu.shape[0] - 1;
  int64_t prev = load_index(cu, 0);
  if (prev != 0) return Status::InvalidArgument("cu_seqlens", "must start at 0");
  for (int64_t n = 0; n < n_seq; ++n) {
    const int64_t end = load_index(cu, (n + 1) * cu.stride[0]);
    if (end < prev) return Status::InvalidArgument("cu_seqlens", "must be non-decreasing");
    seqs->push_back({0, prev, end - prev});
    prev = end;
  }
  if (prev != s->T) {
    return Status::InvalidArgument("cu_seqlens", "must end at T=" + std::to_string(s->T) + ", got " +
                                                     std::to_string(prev));
  }
  s->N = n_seq;
  return Status::Ok();
}

// ------------------------------------------------------------------------------------------------
// Activations (the in-kernel options) and their derivatives.

double sigmoid(double x) {
  if (x >= 0) return 1.0 / (1.0 + std::exp(-x));
  const double e = std::exp(x);
  return e / (1.0 + e);
}
double softplus(double x) { return x > 0 ? x + std::log1p(std::exp(-x)) : std::log1p(std::exp(x)); }

// Rows of length K: x <- x / sqrt(sum x^2 + eps).
std::vector<double> l2norm_rows(const std::vector<double>& x, int64_t K) {
  std::vector<double> y(x.size());
  for (size_t r = 0; r < x.size(); r += K) {
    double sum = kL2NormEps;
    for (int64_t c = 0; c < K; ++c) sum += x[r + c] * x[r + c];
    const double inv_norm = 1.0 / std::sqrt(sum);
    for (int64_t c = 0; c < K; ++c) y[r + c] = x[r + c] * inv_norm;
  }
  return y;
}

// dx = (dy - y (y . dy)) / norm, with y = x / norm.
std::vector<double> l2norm_rows_backward(const std::vector<double>& x, const std::vector<double>& dy,
                                         int64_t K) {
  std::vector<double> dx(x.size());
  for (size_t r = 0; r < x.size(); r += K) {
    double sum = kL2NormEps;
    for (int64_t c = 0; c < K; ++c) sum += x[r + c] * x[r + c];
    const double inv_norm = 1.0 / std::sqrt(sum);
    double y_dot_dy = 0;
    for (int64_t c = 0; c < K; ++c) y_dot_dy += x[r + c] * inv_norm * dy[r + c];
    for (int64_t c = 0; c < K; ++c) dx[r + c] = (dy[r + c] - x[r + c] * inv_norm * y_dot_dy) * inv_norm;
  }
  return dx;
}

// beta <- c * sigmoid(beta), c = 2 with allow_neg_eigval. As in fla, allow_neg_eigval only acts
// together with the in-kernel sigmoid.
double beta_factor(const KdaOptions& o) { return o.allow_neg_eigval ? 2.0 : 1.0; }
double activate_beta(const KdaOptions& o, double b) {
  return o.beta_sigmoid ? beta_factor(o) * sigmoid(b) : b;
}
double beta_derivative(const KdaOptions& o, double b) {
  if (!o.beta_sigmoid) return 1.0;
  const double s = sigmoid(b);
  return beta_factor(o) * s * (1.0 - s);
}

// Raw gate element i (an index into g as given): its value head and its dt_bias entry.
struct GateSlot {
  int64_t hv = 0, dt_index = 0;
};
GateSlot gate_slot(const KdaShape& s, int64_t i) {
  if (s.gate_per_channel) return {(i / s.K) % s.HV, i % (s.HV * s.K)};
  return {i % s.HV, i % s.HV};
}

// The activated log decay of one raw gate element and its partial derivatives w.r.t. the raw
// element (d_g, = d/d dt_bias too) and w.r.t. A_log.
struct GateValue {
  double value = 0, d_g = 1, d_A_log = 0;
};
GateValue activate_gate(const Problem& p, int64_t i) {
  const KdaOptions& o = p.options;
  if (!o.gate_in_kernel) return {p.g_raw[i], 1.0, 0.0};
  const GateSlot slot = gate_slot(p.shape, i);
  const double z = p.g_raw[i] + (p.dt_bias.empty() ? 0.0 : p.dt_bias[slot.dt_index]);
  const bool has_A = !p.A_log.empty();
  const double a = has_A ? std::exp(p.A_log[slot.hv]) : 1.0;
  if (o.lower_bound < 0.f) {  // lower_bound * sigmoid(a z), in [lower_bound, 0)
    const double u = a * z, s = sigmoid(u);
    const double d_u = o.lower_bound * s * (1.0 - s);
    return {o.lower_bound * s, d_u * a, has_A ? d_u * u : 0.0};
  }
  const double value = -a * softplus(z);  // -exp(A_log) * softplus(z)
  return {value, -a * sigmoid(z), value};
}

void activate(Problem* p) {
  const KdaShape& s = p->shape;
  const KdaOptions& o = p->options;
  p->q = o.qk_l2norm ? l2norm_rows(p->q_raw, s.K) : p->q_raw;
  p->k = o.qk_l2norm ? l2norm_rows(p->k_raw, s.K) : p->k_raw;
  p->beta.resize(p->beta_raw.size());
  for (size_t i = 0; i < p->beta.size(); ++i) p->beta[i] = activate_beta(o, p->beta_raw[i]);
  // The activated gate is stored per key channel; a GDN head value is repeated over K.
  const int64_t repeat = s.gate_per_channel ? 1 : s.K;
  p->g.resize(p->g_raw.size() * repeat);
  for (size_t i = 0; i < p->g_raw.size(); ++i) {
    const double value = activate_gate(*p, static_cast<int64_t>(i)).value;
    for (int64_t c = 0; c < repeat; ++c) p->g[i * repeat + c] = value;
  }
}

Status prepare(const KdaInputs& in, Problem* p) {
  FLARE_RETURN_IF_ERROR(check_shapes(in, &p->shape));
  FLARE_RETURN_IF_ERROR(check_options(in));
  FLARE_RETURN_IF_ERROR(read_sequences(in, &p->shape, &p->sequences));
  const KdaShape& s = p->shape;
  FLARE_RETURN_IF_ERROR(check_optional_float(in.initial_state, "initial_state", {s.N, s.HV, s.K, s.V}));
  p->options = in.options;
  p->scale = in.options.scale != 0.f ? in.options.scale : 1.0 / std::sqrt(static_cast<double>(s.K));
  p->q_raw = read_dense(in.q);
  p->k_raw = read_dense(in.k);
  p->v = read_dense(in.v);
  p->g_raw = read_dense(in.g);
  p->beta_raw = read_dense(in.beta);
  p->A_log = read_dense(in.A_log);
  p->dt_bias = read_dense(in.dt_bias);
  p->h0 = read_dense(in.initial_state);
  activate(p);
  return Status::Ok();
}

// The state of sequence n, value head hv at the sequence start.
std::vector<double> initial_state_of(const Problem& p, int64_t n, int64_t hv) {
  if (p.h0.empty()) return std::vector<double>(p.shape.state_size(), 0.0);
  const auto first = p.h0.begin() + p.shape.state(n, hv);
  return {first, first + p.shape.state_size()};
}

// ------------------------------------------------------------------------------------------------
// The recurrence, one token at a time. S is [K, V] row-major (row = key channel).

// The activated inputs of one token for one value head.
struct Token {
  const double *q, *k, *v, *g;
  double beta;
};
Token token_at(const Problem& p, int64_t b, int64_t t, int64_t hv) {
  const KdaShape& s = p.shape;
  return {&p.q[s.qk_row(b, t, hv)], &p.k[s.qk_row(b, t, hv)], &p.v[s.v_row(b, t, hv)],
          &p.g[s.key_row(b, t, hv)], p.beta[s.head(b, t, hv)]};
}

// S <- Diag(exp(g)) S, then S <- S + beta k (v - S^T k)^T; o = scale S^T q.
void recurrent_step(const Token& x, int64_t K, int64_t V, double scale, double* S, double* o) {
  for (int64_t c = 0; c < K; ++c) {
    const double decay = std::exp(x.g[c]);
    for (int64_t j = 0; j < V; ++j) S[c * V + j] *= decay;
  }
  for (int64_t j = 0; j < V; ++j) {
    double residual = x.v[j];  // v - S'^T k
    for (int64_t c = 0; c < K; ++c) residual -= S[c * V + j] * x.k[c];
    for (int64_t c = 0; c < K; ++c) S[c * V + j] += x.beta * x.k[c] * residual;
  }
  for (int64_t j = 0; j < V; ++j) {
    double acc = 0;
    for (int64_t c = 0; c < K; ++c) acc += S[c * V + j] * x.q[c];
    o[j] = scale * acc;
  }
}

// Gradient slots of one token for one value head (w.r.t. the activated inputs; accumulated).
struct TokenGrad {
  double *dq, *dk, *dv, *dg, *dbeta;
};

// Reverse of recurrent_step. S_prev: the state before the token; S: after it; dS: on entry the
// gradient w.r.t. S (from later tokens and the final state), on exit w.r.t. S_prev.
void recurrent_step_backward(const Token& x, const double* S_prev, const double* S, const double* d_o,
                             int64_t K, int64_t V, double scale, double* dS, const TokenGrad& grad) {
  // o = scale S^T q
  for (int64_t c = 0; c < K; ++c) {
    double acc = 0;
    for (int64_t j = 0; j < V; ++j) {
      acc += S[c * V + j] * d_o[j];
      dS[c * V + j] += scale * x.q[c] * d_o[j];
    }
    grad.dq[c] += scale * acc;
  }
  std::vector<double> decay(K), decayed(K * V), residual(V), d_residual(V);
  for (int64_t c = 0; c < K; ++c) decay[c] = std::exp(x.g[c]);
  for (int64_t c = 0; c < K; ++c)
    for (int64_t j = 0; j < V; ++j) decayed[c * V + j] = decay[c] * S_prev[c * V + j];
  for (int64_t j = 0; j < V; ++j) {
    residual[j] = x.v[j];
    for (int64_t c = 0; c < K; ++c) residual[j] -= decayed[c * V + j] * x.k[c];
  }
  // S = S' + beta k r^T
  for (int64_t j = 0; j < V; ++j) {
    double dS_k = 0;
    for (int64_t c = 0; c < K; ++c) dS_k += dS[c * V + j] * x.k[c];
    *grad.dbeta += dS_k * residual[j];
    d_residual[j] = x.beta * dS_k;
    grad.dv[j] += d_residual[j];  // r = v - S'^T k
  }
  for (int64_t c = 0; c < K; ++c) {
    double dk = 0, d_decay = 0;
    for (int64_t j = 0; j < V; ++j) {
      dk += x.beta * dS[c * V + j] * residual[j] - decayed[c * V + j] * d_residual[j];
      const double d_decayed = dS[c * V + j] - x.k[c] * d_residual[j];
      d_decay += d_decayed * S_prev[c * V + j];
      dS[c * V + j] = decay[c] * d_decayed;  // S' = Diag(exp(g)) S_prev
    }
    grad.dk[c] += dk;
    grad.dg[c] += decay[c] * d_decay;
  }
}

// ------------------------------------------------------------------------------------------------
// The chunked WY form (KDA.md section (b)).

using Matrix = std::vector<std::vector<double>>;

Matrix zeros(int64_t rows, int64_t cols) { return Matrix(rows, std::vector<double>(cols, 0.0)); }

// (I + L)^-1 for strictly lower triangular L, by forward substitution: row i of the inverse is
// e_i - sum_{m<i} L_im (row m).
Matrix unit_lower_inverse(const Matrix& L) {
  const int64_t n = static_cast<int64_t>(L.size());
  Matrix A = zeros(n, n);
  for (int64_t i = 0; i < n; ++i) {
    A[i][i] = 1.0;
    for (int64_t m = 0; m < i; ++m)
      for (int64_t j = 0; j <= m; ++j) A[i][j] -= L[i][m] * A[m][j];
  }
  return A;
}

// Rounding of the intermediates a chunked kernel keeps in its input dtype (the "same computation
// in the input dtype" that GPU tests measure their error against); identity when off.
struct Rounding {
  bool on = false;
  DType dtype = DType::kFloat64;
  double operator()(double x) const { return on ? round_to(dtype, x) : x; }
};

// One chunk of n tokens of one value head, and the matrices of its WY form.
struct Chunk {
  std::vector<Token> x;
  int64_t n = 0, K = 0, V = 0;
  Matrix gam;   // [n, K] chunk-local cumulative log decay Gam
  Matrix P;     // [n, n] P_ij = sum_c q_ic k_jc exp(Gam_ic - Gam_jc), j <= i
  Matrix vnew;  // [n, V] u - w S: the per-token delta-rule corrections
};

// sum_c a_c k_jc exp(Gam_ic - Gam_jc): a key (or query) of row i against the key of row j.
double decayed_dot(const Chunk& ch, const double* a, int64_t i, int64_t j) {
  double acc = 0;
  for (int64_t c = 0; c < ch.K; ++c) acc += a[c] * ch.x[j].k[c] * std::exp(ch.gam[i][c] - ch.gam[j][c]);
  return acc;
}

// Gam, P and vnew for the chunk's tokens starting from state S:
//   L_ij = beta_i decayed_dot(k_i, i, j) (j < i),  A = (I + L)^-1,
//   w = A (beta k exp(Gam)),  u = A (beta v),  vnew = u - w S.
// With rounding: A, w, u, S (as an operand) and vnew are rounded, as a kernel stores them.
Chunk make_chunk(std::vector<Token> x, int64_t K, int64_t V, const double* S, const Rounding& r) {
  Chunk ch{std::move(x), 0, K, V, {}, {}, {}};
  const int64_t n = ch.n = static_cast<int64_t>(ch.x.size());
  ch.gam = zeros(n, K);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t c = 0; c < K; ++c) ch.gam[i][c] = (i ? ch.gam[i - 1][c] : 0.0) + ch.x[i].g[c];
  Matrix L = zeros(n, n);
  ch.P = zeros(n, n);
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < i; ++j) L[i][j] = ch.x[i].beta * decayed_dot(ch, ch.x[i].k, i, j);
    for (int64_t j = 0; j <= i; ++j) ch.P[i][j] = decayed_dot(ch, ch.x[i].q, i, j);
  }
  Matrix A = unit_lower_inverse(L);
  for (auto& row : A)
    for (double& a : row) a = r(a);
  std::vector<double> w(K), u(V);
  ch.vnew = zeros(n, V);
  for (int64_t i = 0; i < n; ++i) {
    std::fill(w.begin(), w.end(), 0.0);
    std::fill(u.begin(), u.end(), 0.0);
    for (int64_t j = 0; j <= i; ++j) {
      const Token& t = ch.x[j];
      for (int64_t c = 0; c < K; ++c) w[c] += A[i][j] * t.beta * t.k[c] * std::exp(ch.gam[j][c]);
      for (int64_t e = 0; e < V; ++e) u[e] += A[i][j] * t.beta * t.v[e];
    }
    for (int64_t e = 0; e < V; ++e) {
      double acc = r(u[e]);
      for (int64_t c = 0; c < K; ++c) acc -= r(w[c]) * r(S[c * V + e]);
      ch.vnew[i][e] = r(acc);
    }
  }
  return ch;
}

// Row i of O = scale (q exp(Gam)) S + scale P vnew, S the state at the chunk start.
void chunk_output_row(const Chunk& ch, int64_t i, const double* S, double scale, const Rounding& r, double* o) {
  for (int64_t e = 0; e < ch.V; ++e) {
    double acc = 0;
    for (int64_t c = 0; c < ch.K; ++c)
      acc += r(scale * ch.x[i].q[c] * std::exp(ch.gam[i][c])) * r(S[c * ch.V + e]);
    for (int64_t j = 0; j <= i; ++j) acc += r(scale * ch.P[i][j]) * ch.vnew[j][e];
    o[e] = acc;
  }
}

// S <- Diag(exp(Gam_last)) S + (k exp(Gam_last - Gam))^T vnew.
void chunk_advance_state(const Chunk& ch, const Rounding& r, double* S) {
  const std::vector<double>& last = ch.gam[ch.n - 1];
  for (int64_t c = 0; c < ch.K; ++c) {
    for (int64_t e = 0; e < ch.V; ++e) {
      double acc = std::exp(last[c]) * S[c * ch.V + e];
      for (int64_t j = 0; j < ch.n; ++j)
        acc += r(ch.x[j].k[c] * std::exp(last[c] - ch.gam[j][c])) * ch.vnew[j][e];
      S[c * ch.V + e] = acc;
    }
  }
}

// Tokens [t0, t0 + n) of batch row b, value head hv: writes their outputs and advances S.
void chunk_step(const Problem& p, int64_t b, int64_t t0, int64_t n, int64_t hv, const Rounding& r, double* S,
                double* out) {
  const KdaShape& s = p.shape;
  std::vector<Token> x;
  for (int64_t i = 0; i < n; ++i) x.push_back(token_at(p, b, t0 + i, hv));
  const Chunk ch = make_chunk(std::move(x), s.K, s.V, S, r);
  for (int64_t i = 0; i < n; ++i) chunk_output_row(ch, i, S, p.scale, r, out + s.v_row(b, t0 + i, hv));
  chunk_advance_state(ch, r, S);
}

// ------------------------------------------------------------------------------------------------
// Drivers.

Status check_forward_outputs(const KdaForwardParams& p, const KdaShape& s) {
  FLARE_RETURN_IF_ERROR(check_float(p.out, "out", {s.B, s.T, s.HV, s.V}));
  return check_optional_float(p.final_state, "final_state", {s.N, s.HV, s.K, s.V});
}

// Runs `advance(S, sequence, hv)` on every (sequence, value head) from its initial state, then
// writes the outputs. `advance` moves S through the whole sequence, writing into `out`.
template <typename Advance>
Status run_forward(const KdaForwardParams& params, Advance advance) {
  Problem p;
  FLARE_RETURN_IF_ERROR(prepare(inputs_of(params), &p));
  const KdaShape& s = p.shape;
  FLARE_RETURN_IF_ERROR(check_forward_outputs(params, s));
  std::vector<double> out(s.B * s.T * s.HV * s.V, 0.0), final_state(s.N * s.HV * s.state_size());
  for (int64_t n = 0; n < s.N; ++n) {
    for (int64_t hv = 0; hv < s.HV; ++hv) {
      std::vector<double> S = initial_state_of(p, n, hv);
      advance(p, p.sequences[n], hv, S.data(), out.data());
      std::copy(S.begin(), S.end(), final_state.begin() + s.state(n, hv));
    }
  }
  write_dense(params.out, out);
  if (params.final_state.defined()) write_dense(params.final_state, final_state);
  return Status::Ok();
}

Status check_backward_views(const KdaBackwardParams& p, const KdaShape& s) {
  FLARE_RETURN_IF_ERROR(check_float(p.dout, "dout", {s.B, s.T, s.HV, s.V}));
  FLARE_RETURN_IF_ERROR(check_optional_float(p.d_final_state, "d_final_state", {s.N, s.HV, s.K, s.V}));
  FLARE_RETURN_IF_ERROR(check_float(p.dq, "dq", {s.B, s.T, s.H, s.K}));
  FLARE_RETURN_IF_ERROR(check_float(p.dk, "dk", {s.B, s.T, s.H, s.K}));
  FLARE_RETURN_IF_ERROR(check_float(p.dv, "dv", {s.B, s.T, s.HV, s.V}));
  if (s.gate_per_channel) {
    FLARE_RETURN_IF_ERROR(check_float(p.dg, "dg", {s.B, s.T, s.HV, s.K}));
  } else {
    FLARE_RETURN_IF_ERROR(check_float(p.dg, "dg", {s.B, s.T, s.HV}));
  }
  FLARE_RETURN_IF_ERROR(check_float(p.dbeta, "dbeta", {s.B, s.T, s.HV}));
  if (p.initial_state.defined() && !p.d_initial_state.defined()) {
    return Status::InvalidArgument("d_initial_state", "is required when initial_state is given");
  }
  FLARE_RETURN_IF_ERROR(check_optional_float(p.d_initial_state, "d_initial_state", {s.N, s.HV, s.K, s.V}));
  const bool gate = p.options.gate_in_kernel;
  if (gate && p.A_log.defined() && !p.dA_log.defined()) {
    return Status::InvalidArgument("dA_log", "is required when A_log is given with gate_in_kernel");
  }
  if (gate && p.dt_bias.defined() && !p.ddt_bias.defined()) {
    return Status::InvalidArgument("ddt_bias", "is required when dt_bias is given with gate_in_kernel");
  }
  FLARE_RETURN_IF_ERROR(check_optional_float(p.dA_log, "dA_log", {s.HV}));
  return check_optional_float(p.ddt_bias, "ddt_bias", {s.gate_per_channel ? s.HV * s.K : s.HV});
}

// Gradients w.r.t. the activated inputs (q, k, g, beta) or the raw ones (v, h0).
struct Grads {
  std::vector<double> dq, dk, dv, dg, dbeta, dh0;
};

// Forward through one (sequence, value head) keeping every state, then backward through it.
void backward_sequence_head(const Problem& p, int64_t n, int64_t hv, const std::vector<double>& dout,
                            const std::vector<double>& d_final, Grads* grads) {
  const KdaShape& s = p.shape;
  const Sequence& seq = p.sequences[n];
  const int64_t KV = s.state_size();
  std::vector<double> states(KV * (seq.length + 1));  // states[t]: the state after t tokens
  std::vector<double> S = initial_state_of(p, n, hv), o(s.V);
  std::copy(S.begin(), S.end(), states.begin());
  for (int64_t t = 0; t < seq.length; ++t) {
    recurrent_step(token_at(p, seq.batch, seq.begin + t, hv), s.K, s.V, p.scale, S.data(), o.data());
    std::copy(S.begin(), S.end(), states.begin() + KV * (t + 1));
  }
  std::vector<double> dS(KV, 0.0);
  if (!d_final.empty()) std::copy_n(d_final.begin() + s.state(n, hv), KV, dS.begin());
  for (int64_t t = seq.length - 1; t >= 0; --t) {
    const int64_t b = seq.batch, tt = seq.begin + t;
    const TokenGrad grad{&grads->dq[s.qk_row(b, tt, hv)], &grads->dk[s.qk_row(b, tt, hv)],
                         &grads->dv[s.v_row(b, tt, hv)], &grads->dg[s.key_row(b, tt, hv)],
                         &grads->dbeta[s.head(b, tt, hv)]};
    recurrent_step_backward(token_at(p, b, tt, hv), &states[KV * t], &states[KV * (t + 1)],
                            &dout[s.v_row(b, tt, hv)], s.K, s.V, p.scale, dS.data(), grad);
  }
  std::copy(dS.begin(), dS.end(), grads->dh0.begin() + s.state(n, hv));
}

// Chains the gradients of the activated inputs back to the raw inputs and writes every output.
void write_raw_gradients(const KdaBackwardParams& params, const Problem& p, const Grads& g) {
  const KdaShape& s = p.shape;
  const KdaOptions& o = p.options;
  write_dense(params.dq, o.qk_l2norm ? l2norm_rows_backward(p.q_raw, g.dq, s.K) : g.dq);
  write_dense(params.dk, o.qk_l2norm ? l2norm_rows_backward(p.k_raw, g.dk, s.K) : g.dk);
  write_dense(params.dv, g.dv);
  std::vector<double> dbeta(g.dbeta.size());
  for (size_t i = 0; i < dbeta.size(); ++i) dbeta[i] = g.dbeta[i] * beta_derivative(o, p.beta_raw[i]);
  write_dense(params.dbeta, dbeta);

  // Gate: a GDN head's activated value feeds all K channels, so its gradient sums them.
  const int64_t repeat = s.gate_per_channel ? 1 : s.K;
  std::vector<double> dg(p.g_raw.size()), dA_log(s.HV, 0.0);
  std::vector<double> ddt_bias(s.gate_per_channel ? s.HV * s.K : s.HV, 0.0);
  for (size_t i = 0; i < dg.size(); ++i) {
    double d_value = 0;
    for (int64_t c = 0; c < repeat; ++c) d_value += g.dg[i * repeat + c];
    const GateValue gate = activate_gate(p, static_cast<int64_t>(i));
    const GateSlot slot = gate_slot(s, static_cast<int64_t>(i));
    dg[i] = d_value * gate.d_g;
    if (o.gate_in_kernel && !p.dt_bias.empty()) ddt_bias[slot.dt_index] += dg[i];
    if (o.gate_in_kernel && !p.A_log.empty()) dA_log[slot.hv] += d_value * gate.d_A_log;
  }
  write_dense(params.dg, dg);
  if (params.dA_log.defined()) write_dense(params.dA_log, dA_log);
  if (params.ddt_bias.defined()) write_dense(params.ddt_bias, ddt_bias);
  if (params.d_initial_state.defined()) write_dense(params.d_initial_state, g.dh0);
}


// ------------------------------------------------------------------------------------------------
// The chunked backward, stage by stage as the GPU backward runs it (src/kda/kda_bwd_*.cuh):
//   1. prep, per (chunk, value head): the forward's WY form: Gam, A = (I + L)^-1, w, u, kg, qg, P;
//   2. record pass, per (sequence, value head), chunks in order: h_c = S at the chunk start,
//      vnew = u - w h_c, S <- Diag(decay) S + kg^T vnew;
//   3. backward state pass, chunks in reverse, from dS = d_final_state: dh_c = dS (the gradient
//      w.r.t. the state at the chunk's END), dvnew = P^T dO + kg dh_c,
//      dS <- Diag(decay) dS + qg^T dO - w^T dvnew; d_initial_state = dS after the first chunk;
//   4. chunk gradients, per (chunk, value head), from h_c, dh_c, vnew, dvnew (chunk_gradients);
//      dg is the reverse cumulative sum of dGam within the chunk.
// The stages' outputs a kernel stores or uses as an MMA operand in its input dtype are rounded
// to `intermediates` (see Rounding).

// One chunk of one value head through the four stages.
struct ChunkState {
  std::vector<Token> x;
  int64_t n = 0;
  Matrix gam;                 // [n][K] Gam
  Matrix A;                   // [n][n] (I + L)^-1
  Matrix w, kg, qg;           // [n][K]; qg = scale q exp(Gam)
  Matrix u;                   // [n][V]
  Matrix P;                   // [n][n] scale P (j <= i)
  std::vector<double> decay;  // [K] exp(Gam_last)
  Matrix h, dh;               // [K][V] state at the chunk start; gradient w.r.t. the state at its end
  Matrix vnew, dvnew;         // [n][V]
};

// Stage 1.
void chunk_prep(ChunkState* ch, int64_t K, int64_t V, double scale, const Rounding& r) {
  const int64_t n = ch->n = static_cast<int64_t>(ch->x.size());
  const std::vector<Token>& x = ch->x;
  ch->gam = zeros(n, K);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t c = 0; c < K; ++c) ch->gam[i][c] = (i ? ch->gam[i - 1][c] : 0.0) + x[i].g[c];
  const Matrix& gam = ch->gam;
  auto decayed = [&](const double* a, const double* b, int64_t i, int64_t j) {  // sum_c a_c b_c e^(Gam_ic - Gam_jc)
    double acc = 0;
    for (int64_t c = 0; c < K; ++c) acc += a[c] * b[c] * std::exp(gam[i][c] - gam[j][c]);
    return acc;
  };
  Matrix L = zeros(n, n);
  ch->P = zeros(n, n);
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < i; ++j) L[i][j] = x[i].beta * decayed(x[i].k, x[j].k, i, j);
    for (int64_t j = 0; j <= i; ++j) ch->P[i][j] = r(scale * decayed(x[i].q, x[j].k, i, j));
  }
  ch->A = unit_lower_inverse(L);
  for (auto& row : ch->A)
    for (double& a : row) a = r(a);
  ch->w = zeros(n, K), ch->kg = zeros(n, K), ch->qg = zeros(n, K), ch->u = zeros(n, V);
  const std::vector<double>& last = gam[n - 1];
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t c = 0; c < K; ++c) {
      double acc = 0;
      for (int64_t j = 0; j <= i; ++j) acc += ch->A[i][j] * x[j].beta * x[j].k[c] * std::exp(gam[j][c]);
      ch->w[i][c] = r(acc);
      ch->kg[i][c] = r(x[i].k[c] * std::exp(last[c] - gam[i][c]));
      ch->qg[i][c] = r(scale * x[i].q[c] * std::exp(gam[i][c]));
    }
    for (int64_t e = 0; e < V; ++e) {
      double acc = 0;
      for (int64_t j = 0; j <= i; ++j) acc += ch->A[i][j] * x[j].beta * x[j].v[e];
      ch->u[i][e] = r(acc);
    }
  }
  ch->decay.resize(K);
  for (int64_t c = 0; c < K; ++c) ch->decay[c] = std::exp(last[c]);
}

// Stage 2, one chunk: S (the fp64 carry) moves to the chunk's end.
void record_step(ChunkState* ch, int64_t K, int64_t V, const Rounding& r, Matrix* S) {
  ch->h = *S;
  for (auto& row : ch->h)
    for (double& e : row) e = r(e);
  ch->vnew = zeros(ch->n, V);
  for (int64_t i = 0; i < ch->n; ++i)
    for (int64_t e = 0; e < V; ++e) {
      double acc = ch->u[i][e];
      for (int64_t c = 0; c < K; ++c) acc -= ch->w[i][c] * ch->h[c][e];
      ch->vnew[i][e] = r(acc);
    }
  for (int64_t c = 0; c < K; ++c)
    for (int64_t e = 0; e < V; ++e) {
      double acc = ch->decay[c] * (*S)[c][e];
      for (int64_t i = 0; i < ch->n; ++i) acc += ch->kg[i][c] * ch->vnew[i][e];
      (*S)[c][e] = acc;
    }
}

// Stage 3, one chunk: dS (the fp64 carry, w.r.t. the state at the chunk's end) moves to its start.
// dO: the chunk's rows of dout.
void backward_state_step(ChunkState* ch, const Matrix& dO, int64_t K, int64_t V, const Rounding& r, Matrix* dS) {
  const int64_t n = ch->n;
  ch->dh = *dS;
  for (auto& row : ch->dh)
    for (double& e : row) e = r(e);
  ch->dvnew = zeros(n, V);
  for (int64_t j = 0; j < n; ++j)
    for (int64_t e = 0; e < V; ++e) {
      double acc = 0;
      for (int64_t i = j; i < n; ++i) acc += ch->P[i][j] * dO[i][e];
      for (int64_t c = 0; c < K; ++c) acc += ch->kg[j][c] * ch->dh[c][e];
      ch->dvnew[j][e] = r(acc);
    }
  for (int64_t c = 0; c < K; ++c)
    for (int64_t e = 0; e < V; ++e) {
      double acc = ch->decay[c] * (*dS)[c][e];
      for (int64_t i = 0; i < n; ++i) acc += ch->qg[i][c] * dO[i][e] - ch->w[i][c] * ch->dvnew[i][e];
      (*dS)[c][e] = acc;
    }
}

// Gradients of one chunk w.r.t. its activated inputs; dgam w.r.t. Gam (before the reverse cumsum).
struct ChunkGrads {
  Matrix dq, dk, dv, dgam;  // [n][K], [n][K], [n][V], [n][K]
  std::vector<double> dbeta;
};

// The intra-chunk terms of stage 4, through P and L, in the GPU kernel's block form:
//   Qr_i = sum_j dP_ij e_ij k_j,  R_i = sum_j dL_ij e_ij k_j,  C_j = sum_i e_ij (dP_ij q_i + dL_ij beta_i k_i).
// e_ij is split at per-sub-chunk references m_I (Gam at row 16 I + 7, the last row standing in for
// rows past a partial chunk) into factors that never overflow when the gate is <= 0:
//   e_ij = 2^(Gam_i - m_I) 2^(m_I - m_J) 2^(m_J - Gam_j)  for i in sub-chunk I, j in J <= I,
// the middle factor <= 1 and the outer ones bounded by the gate of 8 rows. The kernel keeps
// qa = q e^(Gam - m), kr = k e^(Gam - m), kb = k e^(m - Gam) as MMA operands and scales them by the
// middle factor (and beta) on the way into the MMA: those are the roundings emulated here.
void intra_chunk_terms(const ChunkState& ch, const Matrix& dP, const Matrix& dL, int64_t K, const Rounding& r,
                       ChunkGrads* d) {
  const int64_t n = ch.n;
  const std::vector<Token>& x = ch.x;
  const int64_t sub = kSubChunk, blocks = (n + sub - 1) / sub;
  auto gam = [&](int64_t i, int64_t c) { return ch.gam[std::min(i, n - 1)][c]; };
  Matrix m = zeros(blocks, K), qa = zeros(n, K), kr = zeros(n, K), kb = zeros(n, K);
  for (int64_t I = 0; I < blocks; ++I)
    for (int64_t c = 0; c < K; ++c) m[I][c] = gam(I * sub + sub / 2 - 1, c);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t c = 0; c < K; ++c) {
      const double up = std::exp(gam(i, c) - m[i / sub][c]);
      qa[i][c] = r(x[i].q[c] * up);
      kr[i][c] = r(x[i].k[c] * up);
      kb[i][c] = r(x[i].k[c] / up);
    }
  for (int64_t i = 0; i < n; ++i) {
    const int64_t I = i / sub;
    for (int64_t c = 0; c < K; ++c) {
      double Q = 0, R = 0, C = 0;  // before the outer factors
      for (int64_t j = 0; j < (I + 1) * sub && j < n; ++j) {  // row i against blocks J <= I
        const int64_t J = j / sub;
        const double b = J < I ? r(kb[j][c] * std::exp(m[I][c] - m[J][c])) : kb[j][c];
        Q += dP[i][j] * b;
        R += dL[i][j] * b;
      }
      for (int64_t k = I * sub; k < n; ++k) {  // column i against blocks M >= I
        const int64_t M = k / sub;
        const double cross = M > I ? std::exp(m[M][c] - m[I][c]) : 1.0;
        C += dP[k][i] * (M > I ? r(qa[k][c] * cross) : qa[k][c]) + dL[k][i] * r(kr[k][c] * x[k].beta * cross);
      }
      const double row = std::exp(gam(i, c) - m[I][c]);
      d->dq[i][c] += row * Q;
      d->dk[i][c] += x[i].beta * row * R + C / row;
      d->dbeta[i] += kr[i][c] * R;
      d->dgam[i][c] += qa[i][c] * Q + x[i].beta * kr[i][c] * R - kb[i][c] * C;
    }
  }
}

// Stage 4. With e_ij = exp(Gam_i - Gam_j) per channel and X = beta k exp(Gam):
//   inter:  dq = scale exp(Gam) (dO h^T),  dk = exp(Gam_last - Gam) (vnew dh^T),  dw = -dvnew h^T
//   WY:     dA = dvnew (beta v)^T + dw X^T (strictly lower),  dY = A^T dvnew -> dv = beta dY,
//           dX = A^T dw -> dk += beta exp(Gam) dX,  dL = -A^T dA A^T (strictly lower)
//   intra:  dP = scale dO vnew^T (j <= i);  Qr_i = sum_j dP_ij e_ij k_j,  R_i = sum_j dL_ij e_ij k_j,
//           C_j = sum_i e_ij (dP_ij q_i + dL_ij beta_i k_i):  dq += Qr, dk += beta R + C
//   dbeta:  dY . v + (k exp(Gam)) . dX + k . R
//   dGam:   q . dq - k . dk_inter + X . dX + beta k . R - k . C (every term carrying Gam_i with
//           + and Gam_j with -), and on the last row sum_i k_i . dk_inter_i + decay . rowsum(h . dh)
ChunkGrads chunk_gradients(const ChunkState& ch, const Matrix& dO, int64_t K, int64_t V, double scale,
                           const Rounding& r) {
  const int64_t n = ch.n;
  const std::vector<Token>& x = ch.x;
  const Matrix& gam = ch.gam;
  ChunkGrads d{zeros(n, K), zeros(n, K), zeros(n, V), zeros(n, K), std::vector<double>(n, 0.0)};

  // inter-chunk terms
  Matrix dw = zeros(n, K), X = zeros(n, K);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t c = 0; c < K; ++c) {
      double dq = 0, dk = 0, w = 0;
      for (int64_t e = 0; e < V; ++e) {
        dq += dO[i][e] * ch.h[c][e];
        dk += ch.vnew[i][e] * ch.dh[c][e];
        w -= ch.dvnew[i][e] * ch.h[c][e];
      }
      d.dq[i][c] = scale * std::exp(gam[i][c]) * dq;
      const double dk_inter = std::exp(gam[n - 1][c] - gam[i][c]) * dk;
      d.dk[i][c] = dk_inter;
      d.dgam[i][c] += x[i].q[c] * d.dq[i][c] - x[i].k[c] * dk_inter;
      d.dgam[n - 1][c] += x[i].k[c] * dk_inter;
      dw[i][c] = r(w);
      X[i][c] = r(x[i].beta * x[i].k[c] * std::exp(gam[i][c]));
    }
  for (int64_t c = 0; c < K; ++c) {
    double acc = 0;
    for (int64_t e = 0; e < V; ++e) acc += ch.h[c][e] * ch.dh[c][e];
    d.dgam[n - 1][c] += ch.decay[c] * acc;
  }

  // back through w = A X, u = A (beta v), A = (I + L)^-1
  Matrix dA = zeros(n, n);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < i; ++j) {
      double acc = 0;
      for (int64_t e = 0; e < V; ++e) acc += ch.dvnew[i][e] * r(x[j].beta * x[j].v[e]);
      for (int64_t c = 0; c < K; ++c) acc += dw[i][c] * X[j][c];
      dA[i][j] = r(acc);
    }
  for (int64_t j = 0; j < n; ++j) {
    for (int64_t e = 0; e < V; ++e) {
      double dY = 0;
      for (int64_t i = j; i < n; ++i) dY += ch.A[i][j] * ch.dvnew[i][e];
      d.dv[j][e] = x[j].beta * dY;
      d.dbeta[j] += dY * x[j].v[e];
    }
    for (int64_t c = 0; c < K; ++c) {
      double dX = 0;
      for (int64_t i = j; i < n; ++i) dX += ch.A[i][j] * dw[i][c];
      const double up = std::exp(gam[j][c]);
      d.dk[j][c] += x[j].beta * up * dX;
      d.dbeta[j] += x[j].k[c] * up * dX;
      d.dgam[j][c] += x[j].beta * x[j].k[c] * up * dX;
    }
  }
  Matrix T1 = zeros(n, n), dL = zeros(n, n);  // T1 = A^T dA (lower), dL = -T1 A^T (strictly lower)
  for (int64_t i = 0; i < n; ++i)
    for (int64_t b = 0; b <= i; ++b) {
      double acc = 0;
      for (int64_t a = i; a < n; ++a) acc += ch.A[a][i] * dA[a][b];
      T1[i][b] = r(acc);
    }
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < i; ++j) {
      double acc = 0;
      for (int64_t b = 0; b <= j; ++b) acc += T1[i][b] * ch.A[j][b];
      dL[i][j] = r(-acc);
    }

  // intra-chunk terms through P and L
  Matrix dP = zeros(n, n);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j <= i; ++j) {
      double acc = 0;
      for (int64_t e = 0; e < V; ++e) acc += dO[i][e] * ch.vnew[j][e];
      dP[i][j] = r(scale * acc);
    }
  intra_chunk_terms(ch, dP, dL, K, r, &d);
  return d;
}

// All four stages for one (sequence, value head); accumulates into `grads` (dg already
// reverse-cumulated, w.r.t. the activated gate).
void chunked_backward_sequence_head(const Problem& p, int64_t n_seq, int64_t hv, int chunk_size,
                                    const Rounding& r, const std::vector<double>& dout,
                                    const std::vector<double>& d_final, Grads* grads) {
  const KdaShape& s = p.shape;
  const Sequence& seq = p.sequences[n_seq];
  std::vector<ChunkState> chunks;
  std::vector<Matrix> dO;
  for (int64_t t0 = 0; t0 < seq.length; t0 += chunk_size) {
    ChunkState ch;
    Matrix rows;
    for (int64_t i = 0; i < std::min<int64_t>(chunk_size, seq.length - t0); ++i) {
      const int64_t t = seq.begin + t0 + i;
      ch.x.push_back(token_at(p, seq.batch, t, hv));
      const double* row = &dout[s.v_row(seq.batch, t, hv)];
      rows.emplace_back(row, row + s.V);
    }
    chunk_prep(&ch, s.K, s.V, p.scale, r);
    chunks.push_back(std::move(ch));
    dO.push_back(std::move(rows));
  }
  const std::vector<double> h0 = initial_state_of(p, n_seq, hv);
  Matrix S = zeros(s.K, s.V), dS = zeros(s.K, s.V);
  for (int64_t c = 0; c < s.K; ++c)
    for (int64_t e = 0; e < s.V; ++e) {
      S[c][e] = h0[c * s.V + e];
      dS[c][e] = d_final.empty() ? 0.0 : d_final[s.state(n_seq, hv) + c * s.V + e];
    }
  for (ChunkState& ch : chunks) record_step(&ch, s.K, s.V, r, &S);
  for (size_t c = chunks.size(); c-- > 0;) backward_state_step(&chunks[c], dO[c], s.K, s.V, r, &dS);
  for (int64_t c = 0; c < s.K; ++c)
    for (int64_t e = 0; e < s.V; ++e) grads->dh0[s.state(n_seq, hv) + c * s.V + e] = dS[c][e];

  for (size_t c = 0; c < chunks.size(); ++c) {
    const ChunkGrads d = chunk_gradients(chunks[c], dO[c], s.K, s.V, p.scale, r);
    const int64_t t0 = seq.begin + static_cast<int64_t>(c) * chunk_size;
    std::vector<double> suffix(s.K, 0.0);  // reverse cumulative sum of dGam
    for (int64_t i = chunks[c].n - 1; i >= 0; --i) {
      const int64_t b = seq.batch, t = t0 + i;
      for (int64_t k = 0; k < s.K; ++k) {
        grads->dq[s.qk_row(b, t, hv) + k] += d.dq[i][k];
        grads->dk[s.qk_row(b, t, hv) + k] += d.dk[i][k];
        suffix[k] += d.dgam[i][k];
        grads->dg[s.key_row(b, t, hv) + k] = suffix[k];
      }
      for (int64_t e = 0; e < s.V; ++e) grads->dv[s.v_row(b, t, hv) + e] = d.dv[i][e];
      grads->dbeta[s.head(b, t, hv)] = d.dbeta[i];
    }
  }
}

}  // namespace

Status kda_forward(const KdaForwardParams& params) {
  return run_forward(params, [](const Problem& p, const Sequence& seq, int64_t hv, double* S, double* out) {
    const KdaShape& s = p.shape;
    for (int64_t t = seq.begin; t < seq.begin + seq.length; ++t) {
      recurrent_step(token_at(p, seq.batch, t, hv), s.K, s.V, p.scale, S, out + s.v_row(seq.batch, t, hv));
    }
  });
}

Status kda_forward_chunked(const KdaForwardParams& params, int chunk_size, DType intermediates) {
  if (chunk_size < 1) return Status::InvalidArgument("chunk_size", "must be positive");
  const Rounding r{intermediates != DType::kFloat64, intermediates};
  return run_forward(params, [chunk_size, r](const Problem& p, const Sequence& seq, int64_t hv, double* S,
                                             double* out) {
    for (int64_t t0 = 0; t0 < seq.length; t0 += chunk_size) {
      const int64_t n = std::min<int64_t>(chunk_size, seq.length - t0);
      chunk_step(p, seq.batch, seq.begin + t0, n, hv, r, S, out);
    }
  });
}

Status kda_backward(const KdaBackwardParams& params) {
  Problem p;
  FLARE_RETURN_IF_ERROR(prepare(inputs_of(params), &p));
  const KdaShape& s = p.shape;
  FLARE_RETURN_IF_ERROR(check_backward_views(params, s));
  const std::vector<double> dout = read_dense(params.dout);
  const std::vector<double> d_final = read_dense(params.d_final_state);
  Grads g{std::vector<double>(p.q.size(), 0.0), std::vector<double>(p.k.size(), 0.0),
          std::vector<double>(p.v.size(), 0.0), std::vector<double>(p.g.size(), 0.0),
          std::vector<double>(p.beta.size(), 0.0), std::vector<double>(s.N * s.HV * s.state_size(), 0.0)};
  for (int64_t n = 0; n < s.N; ++n)
    for (int64_t hv = 0; hv < s.HV; ++hv) backward_sequence_head(p, n, hv, dout, d_final, &g);
  write_raw_gradients(params, p, g);
  return Status::Ok();
}

Status kda_backward_chunked(const KdaBackwardParams& params, int chunk_size, DType intermediates) {
  if (chunk_size < 1) return Status::InvalidArgument("chunk_size", "must be positive");
  const Rounding r{intermediates != DType::kFloat64, intermediates};
  Problem p;
  FLARE_RETURN_IF_ERROR(prepare(inputs_of(params), &p));
  const KdaShape& s = p.shape;
  FLARE_RETURN_IF_ERROR(check_backward_views(params, s));
  const std::vector<double> dout = read_dense(params.dout);
  const std::vector<double> d_final = read_dense(params.d_final_state);
  Grads g{std::vector<double>(p.q.size(), 0.0), std::vector<double>(p.k.size(), 0.0),
          std::vector<double>(p.v.size(), 0.0), std::vector<double>(p.g.size(), 0.0),
          std::vector<double>(p.beta.size(), 0.0), std::vector<double>(s.N * s.HV * s.state_size(), 0.0)};
  for (int64_t n = 0; n < s.N; ++n)
    for (int64_t hv = 0; hv < s.HV; ++hv)
      chunked_backward_sequence_head(p, n, hv, chunk_size, r, dout, d_final, &g);
  write_raw_gradients(params, p, g);
  return Status::Ok();
}

}  // namespace flare::ref
