// The KDA / GDN recurrent step (flare::kda_recurrent_step) against the fp64 oracle
// (reference/kda_ref: ref::kda_forward run on every sequence's tokens, its initial state the
// sequence's pool slot): Tq in {1, 3, 8, 11} tokens per sequence (11: two staged groups); varlen
// batches with empty sequences; a pool with permuted slots, a negative index (no state: starts at
// zero, slot untouched) and an index beyond the pool (NaN outputs, nothing written); no state;
// a separate final_state (pool only read); KDA and GDN; each in-kernel option; K and V in
// {64, 128}; every value-slice width of the launch; GVA; bf16 and fp16 (fp32 and 16-bit g, beta);
// CUDA-graph capture and replay; and a chain of steps against the chunked forward (kda_forward):
// the same T tokens fed one step (of 1 or 5 tokens) at a time give kda_forward's outputs and
// final state. Argument errors name the argument.
//
// Outputs (and final_state) are poisoned (NaN) first, so anything left unwritten fails. Pool slots
// no sequence may write are compared bit for bit. Error rule (tests/gpu/gpu_harness.h):
// |gpu - oracle| <= k x |lowp - oracle| + atol, where lowp is the oracle's result stored in the
// kernel's output dtype (the step computes in fp32 from 16-bit inputs, so rounding its outputs is
// the same computation in the input dtype); states are fp32, judged with an absolute term that
// covers fp32 accumulation over a few hundred tokens.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "flare/kda.h"
#include "reference/host_tensor.h"
#include "reference/kda_ref.h"
#include "src/kda/kda_recurrent_params.h"
#include "tests/common/status_checks.h"
#include "tests/gpu/gpu_harness.h"
#include "tests/gpu/kda_option_cases.h"

namespace flare::test {
namespace {

using ref::HostTensor;

constexpr double kErrFactor = 3.0;
constexpr double kOutAtol = 1e-4;
constexpr double kStateAtol = 1e-4;  // fp32 state: |S| <= ~2, a few ulp per token, contractive

struct Case {
  std::string name;
  int64_t N = 3, Tq = 1, H = 2, HV = 4, K = 128, V = 128;
  std::vector<int64_t> seqlens;  // varlen when not empty (B = 1, T = sum)
  DType dtype = DType::kBFloat16;
  DType g_dtype = DType::kFloat32, beta_dtype = DType::kFloat32, cu_dtype = DType::kInt32;
  bool gdn = false, A_log = true, dt_bias = true;
  bool state = true;           // a pool (else every sequence starts from zero)
  std::vector<int> indices;    // state_indices (empty: slot n, P = N)
  int64_t P = 0;               // pool slots with indices
  bool final_state = false;    // a separate final_state (the pool is then only read)
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
  int64_t B = 0, T = 0, P = 0;  // token tensors [B, T, ...]; pool slots
  HostTensor q, k, v, g, beta, A_log, dt_bias, pool, indices, cu;

  int slot_of(int64_t n) const { return c.indices.empty() ? static_cast<int>(n) : c.indices[n]; }
  bool valid_slot(int64_t n) const { return c.state && slot_of(n) >= 0 && slot_of(n) < P; }

  // The inputs as the oracle and the GPU step both take them (views of this problem's tensors).
  KdaRecurrentParams params() const {
    KdaRecurrentParams p;
    p.q = q, p.k = k, p.v = v, p.g = g, p.beta = beta;
    if (c.options.gate_in_kernel && c.A_log) p.A_log = A_log;
    if (c.options.gate_in_kernel && c.dt_bias) p.dt_bias = dt_bias;
    if (!c.seqlens.empty()) p.cu_seqlens = cu;
    if (c.state) p.state = pool;
    if (!c.indices.empty()) p.state_indices = indices;
    p.options = c.options;
    return p;
  }
};

Problem make_problem(Case c, uint64_t seed) {
  std::mt19937_64 rng(seed);
  Problem p;
  if (c.seqlens.empty()) {
    p.B = c.N, p.T = c.Tq;
  } else {
    p.B = 1, p.T = 0;
    for (int64_t len : c.seqlens) p.T += len;
    c.N = static_cast<int64_t>(c.seqlens.size());
  }
  p.P = c.indices.empty() ? c.N : c.P;
  const KdaOptions& o = c.options;
  p.q.reset(c.dtype, {p.B, p.T, c.H, c.K});
  p.k.reset(c.dtype, {p.B, p.T, c.H, c.K});
  p.v.reset(c.dtype, {p.B, p.T, c.HV, c.V});
  p.beta.reset(c.beta_dtype, {p.B, p.T, c.HV});
  if (c.gdn) p.g.reset(c.g_dtype, {p.B, p.T, c.HV});
  else p.g.reset(c.g_dtype, {p.B, p.T, c.HV, c.K});
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
  p.pool.reset(DType::kFloat32, {std::max<int64_t>(p.P, 1), c.HV, c.K, c.V});
  p.pool.fill_uniform(rng);
  p.indices.reset(DType::kInt32, {c.N});
  for (int64_t n = 0; n < static_cast<int64_t>(c.indices.size()); ++n) p.indices.set(n, c.indices[n]);
  if (!c.seqlens.empty()) {
    p.cu.reset(c.cu_dtype, {c.N + 1});
    int64_t end = 0;
    p.cu.set(0, 0);
    for (int64_t n = 0; n < c.N; ++n) p.cu.set(n + 1, end += c.seqlens[n]);
  }
  p.c = std::move(c);
  return p;
}

// What the step must produce: the oracle's outputs (fp64, and stored in the kernel's dtype) and
// the updated state of every sequence (fp64, and stored in fp32).
struct Expected {
  HostTensor out64, out_lowp, state64, state_lowp;
};

Expected run_oracle(const Problem& p) {
  const Case& c = p.c;
  // Each sequence's initial state: its pool slot, or zero.
  HostTensor h0(DType::kFloat32, {c.N, c.HV, c.K, c.V});
  const int64_t slot_elems = c.HV * c.K * c.V;
  for (int64_t n = 0; n < c.N; ++n)
    for (int64_t i = 0; i < slot_elems; ++i)
      h0.set(n * slot_elems + i, p.valid_slot(n) ? p.pool.get(p.slot_of(n) * slot_elems + i) : 0.0);
  const KdaRecurrentParams rp = p.params();
  KdaForwardParams fp;
  fp.q = rp.q, fp.k = rp.k, fp.v = rp.v, fp.g = rp.g, fp.beta = rp.beta;
  fp.A_log = rp.A_log, fp.dt_bias = rp.dt_bias, fp.cu_seqlens = rp.cu_seqlens, fp.options = rp.options;
  fp.initial_state = h0;
  Expected e;
  e.out64.reset(DType::kFloat64, {p.B, p.T, c.HV, c.V});
  e.out_lowp.reset(c.dtype, {p.B, p.T, c.HV, c.V});
  e.state64.reset(DType::kFloat64, {c.N, c.HV, c.K, c.V});
  e.state_lowp.reset(DType::kFloat32, {c.N, c.HV, c.K, c.V});
  fp.out = e.out64, fp.final_state = e.state64;
  const Status exact = ref::kda_forward(fp);
  EXPECT_TRUE(exact.ok()) << exact.message();
  fp.out = e.out_lowp, fp.final_state = e.state_lowp;
  const Status rounded = ref::kda_forward(fp);
  EXPECT_TRUE(rounded.ok()) << rounded.message();
  return e;
}

// A device copy of every input (the pool is the state updated in place).
class DeviceProblem {
 public:
  explicit DeviceProblem(const Problem& p) : p_(p) {
    for (auto [d, h] : {std::pair{&q, &p.q}, {&k, &p.k}, {&v, &p.v}, {&g, &p.g}, {&beta, &p.beta},
                        {&A_log, &p.A_log}, {&dt_bias, &p.dt_bias}, {&pool, &p.pool}, {&indices, &p.indices}}) {
      d->allocate(*h);
      d->upload(*h);
    }
    if (!p.c.seqlens.empty()) {
      cu.allocate(p.cu);
      cu.upload(p.cu);
    }
  }
  KdaRecurrentParams params() const {
    KdaRecurrentParams hp = p_.params();
    auto swap = [](TensorView& t, const DeviceTensor& d) {
      if (t.defined()) t = d.view();
    };
    swap(hp.q, q), swap(hp.k, k), swap(hp.v, v), swap(hp.g, g), swap(hp.beta, beta);
    swap(hp.A_log, A_log), swap(hp.dt_bias, dt_bias), swap(hp.cu_seqlens, cu);
    swap(hp.state, pool), swap(hp.state_indices, indices);
    return hp;
  }

  const Problem& p_;
  DeviceTensor q, k, v, g, beta, A_log, dt_bias, pool, indices, cu;
};

// Byte-for-byte equality of pool slot `s` in two pools.
bool same_slot(const HostTensor& a, const HostTensor& b, int64_t s, int64_t slot_elems) {
  const auto* x = static_cast<const float*>(a.data()) + s * slot_elems;
  const auto* y = static_cast<const float*>(b.data()) + s * slot_elems;
  return std::memcmp(x, y, slot_elems * sizeof(float)) == 0;
}

// Which sequence's tokens [begin, end) are in the token tensors (flattened over B and T).
std::pair<int64_t, int64_t> token_range(const Problem& p, int64_t n) {
  if (p.c.seqlens.empty()) return {n * p.T, (n + 1) * p.T};
  int64_t begin = 0;
  for (int64_t m = 0; m < n; ++m) begin += p.c.seqlens[m];
  return {begin, begin + p.c.seqlens[n]};
}

void run_case(const Case& c, uint64_t seed = 1) {
  SCOPED_TRACE(c.name);
  const Problem p = make_problem(c, seed);
  const Case& cc = p.c;
  const Expected e = run_oracle(p);

  DeviceProblem dp(p);
  HostTensor out(cc.dtype, {p.B, p.T, cc.HV, cc.V}), fin(DType::kFloat32, {cc.N, cc.HV, cc.K, cc.V});
  DeviceTensor d_out(out), d_fin(fin);
  d_out.poison();
  d_fin.poison();
  KdaRecurrentParams params = dp.params();
  params.out = d_out.view();
  if (cc.final_state) params.final_state = d_fin.view();
  const Status s = kda_recurrent_step(params);
  ASSERT_TRUE(s.ok()) << s.message();
  FLARE_CUDA_OK(cudaDeviceSynchronize());
  d_out.download(out);
  HostTensor pool_after(DType::kFloat32, {p.pool.view().shape[0], cc.HV, cc.K, cc.V});
  dp.pool.download(pool_after);
  if (cc.final_state) d_fin.download(fin);

  // The states the step produced, per sequence: final_state[n], or its pool slot. Sequences that
  // write nowhere (no state, or a negative index without final_state) compare as exact.
  const int64_t slot_elems = cc.HV * cc.K * cc.V, tok_elems = cc.HV * cc.V;
  HostTensor got_state(DType::kFloat32, {cc.N, cc.HV, cc.K, cc.V});
  HostTensor want64(DType::kFloat64, {cc.N, cc.HV, cc.K, cc.V}), want_lowp(DType::kFloat32, {cc.N, cc.HV, cc.K, cc.V});
  for (int64_t i = 0; i < want64.numel(); ++i) want64.set(i, e.state64.get(i)), want_lowp.set(i, e.state_lowp.get(i));
  for (int64_t n = 0; n < cc.N; ++n) {
    const bool beyond = cc.state && p.slot_of(n) >= p.P;
    for (int64_t i = 0; i < slot_elems; ++i) {
      const int64_t at = n * slot_elems + i;
      if (cc.final_state && !beyond) got_state.set(at, fin.get(at));
      else if (p.valid_slot(n)) got_state.set(at, pool_after.get(p.slot_of(n) * slot_elems + i));
      else got_state.set(at, e.state_lowp.get(at)), want64.set(at, e.state_lowp.get(at));
    }
    if (beyond) {  // an index beyond the pool: NaN outputs (and final state), nothing else written
      const auto [t0, t1] = token_range(p, n);
      int64_t nan = 0;
      for (int64_t i = t0 * tok_elems; i < t1 * tok_elems; ++i) nan += std::isnan(out.get(i));
      for (int64_t i = 0; cc.final_state && i < slot_elems; ++i) nan += std::isnan(fin.get(n * slot_elems + i));
      EXPECT_EQ(nan, (t1 - t0) * tok_elems + (cc.final_state ? slot_elems : 0)) << "sequence " << n;
      for (int64_t i = t0 * tok_elems; i < t1 * tok_elems; ++i) out.set(i, e.out_lowp.get(i));
    }
  }
  // Pool slots no sequence may write keep their bits.
  for (int64_t slot = 0; cc.state && slot < p.P; ++slot) {
    bool written = false;
    for (int64_t n = 0; n < cc.N; ++n) written |= !cc.final_state && p.valid_slot(n) && p.slot_of(n) == slot;
    if (!written) EXPECT_TRUE(same_slot(pool_after, p.pool, slot, slot_elems)) << "pool slot " << slot << " changed";
  }

  const ErrorReport ro = compare(out, e.out64, &e.out_lowp), rs = compare(got_state, want64, &want_lowp);
  std::printf("  %-36s %s | %s\n", c.name.c_str(), ro.describe("out").c_str(), rs.describe("state").c_str());
  EXPECT_TRUE(within_tolerance(ro, "out", kErrFactor, kOutAtol));
  EXPECT_TRUE(within_tolerance(rs, "state", kErrFactor, kStateAtol));
}

Case named(std::string name) {
  Case c;
  c.name = std::move(name);
  return c;
}

TEST(KdaRecurrent, TokensPerStep) {
  FLARE_REQUIRE_GPU();
  for (int64_t Tq : {1, 3, 8, 11}) {
    Case c = named("Tq " + std::to_string(Tq));
    c.Tq = Tq;
    run_case(c, 100 + Tq);
  }
}

TEST(KdaRecurrent, HeadDims) {
  FLARE_REQUIRE_GPU();
  for (int64_t K : {64, 128})
    for (int64_t V : {64, 128}) {
      Case c = named("K" + std::to_string(K) + " V" + std::to_string(V));
      c.K = K, c.V = V, c.Tq = 3;
      run_case(c, 200 + K + V);
    }
}

// Enough (sequence, value head) pairs for each slice width the launch picks on this GPU.
TEST(KdaRecurrent, SliceWidths) {
  FLARE_REQUIRE_GPU();
  int sms = 0;
  FLARE_CUDA_OK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  for (int64_t V : {64, 128}) {
    std::vector<int> seen;
    // heads = N * HV with HV = 4: 1/2, 1 and 2 SMs' worth of (sequence, value head) pairs.
    for (int64_t heads : {int64_t{8}, int64_t{sms} / 2 + 4, int64_t{sms} + 4, 2 * int64_t{sms} + 4}) {
      Case c = named("V" + std::to_string(V) + " heads " + std::to_string(heads / 4 * 4));
      c.N = heads / 4, c.V = V, c.Tq = 2;
      const int bv = detail::recurrent_slice_width(c.N * c.HV, static_cast<int>(V), sms);
      c.name += " BV " + std::to_string(bv);
      seen.push_back(bv);
      run_case(c, 300 + heads + V);
    }
    std::sort(seen.begin(), seen.end());
    seen.erase(std::unique(seen.begin(), seen.end()), seen.end());
    if (!std::getenv("FLARE_KDA_RECURRENT_BV")) EXPECT_EQ(seen.size(), 3u) << "not every slice width was run";
  }
}

TEST(KdaRecurrent, PoolIndices) {
  FLARE_REQUIRE_GPU();
  Case c = named("permuted slots, one negative");
  c.N = 4, c.Tq = 2, c.P = 7, c.indices = {5, 0, -1, 3};
  run_case(c, 400);
  c.name = "index beyond the pool";
  c.indices = {6, 7, 2, -3};
  run_case(c, 401);
  c.name = "separate final_state, pool read only";
  c.indices = {5, 0, -1, 3};
  c.final_state = true;
  run_case(c, 402);
  c.name = "final_state, index beyond the pool";
  c.indices = {1, 9, 2, -1};
  run_case(c, 403);
}

TEST(KdaRecurrent, NoState) {
  FLARE_REQUIRE_GPU();
  Case c = named("no state");
  c.state = false, c.Tq = 3;
  run_case(c, 500);
  c.name = "no state, final_state";
  c.final_state = true;
  run_case(c, 501);
}

TEST(KdaRecurrent, Varlen) {
  FLARE_REQUIRE_GPU();
  Case c = named("varlen int32, indices");
  c.seqlens = {1, 0, 3, 8, 2, 11};
  c.P = 9, c.indices = {8, 1, -1, 4, 0, 6};
  run_case(c, 600);
  c.name = "varlen int64, slot n";
  c.cu_dtype = DType::kInt64;
  c.indices.clear();
  c.seqlens = {2, 1, 0, 9};
  run_case(c, 601);
  c.name = "varlen, final_state";
  c.final_state = true;
  run_case(c, 602);
}

TEST(KdaRecurrent, InKernelOptions) {
  FLARE_REQUIRE_GPU();
  Case base;
  base.Tq = 4;
  const std::vector<KdaOptionCase> cases = kda_option_cases();
  for (size_t i = 0; i < cases.size(); ++i) run_case(with_option_case(base, cases[i]), 700 + i);
}

TEST(KdaRecurrent, GatedDeltaRule) {
  FLARE_REQUIRE_GPU();
  Case c = named("GDN");
  c.gdn = true, c.Tq = 3;
  run_case(c, 800);
  c.name = "GDN gate in kernel, varlen, indices, K64 V64";
  c.options.gate_in_kernel = true;
  c.K = c.V = 64;
  c.seqlens = {4, 0, 1, 8};
  c.P = 5, c.indices = {2, 4, 0, -1};
  run_case(c, 801);
}

TEST(KdaRecurrent, GroupedValueHeads) {
  FLARE_REQUIRE_GPU();
  Case c = named("GVA 4");
  c.H = 2, c.HV = 8, c.Tq = 2;
  run_case(c, 900);
}

TEST(KdaRecurrent, Dtypes) {
  FLARE_REQUIRE_GPU();
  Case c = named("fp16");
  c.dtype = DType::kFloat16, c.Tq = 3;
  run_case(c, 1000);
  c.name = "fp16 g and beta, K64";
  c.g_dtype = c.beta_dtype = DType::kFloat16, c.K = 64;
  run_case(c, 1001);
  c.name = "bf16 g and beta, GDN";
  c.dtype = c.g_dtype = c.beta_dtype = DType::kBFloat16, c.K = 128, c.gdn = true;
  run_case(c, 1002);
}

// A step captured in a CUDA graph and replayed twice advances the pool exactly as two direct calls.
TEST(KdaRecurrent, GraphCapture) {
  FLARE_REQUIRE_GPU();
  Case c = named("graph");
  c.N = 4, c.Tq = 2, c.P = 6, c.indices = {3, -1, 0, 5};
  c.options.gate_in_kernel = c.options.qk_l2norm = true;
  const Problem p = make_problem(c, 1100);
  DeviceProblem direct(p), graphed(p);
  HostTensor out(p.c.dtype, {p.B, p.T, p.c.HV, p.c.V});
  DeviceTensor out_direct(out), out_graph(out);
  cudaStream_t stream;
  FLARE_CUDA_OK(cudaStreamCreate(&stream));
  KdaRecurrentParams pd = direct.params(), pg = graphed.params();
  pd.out = out_direct.view(), pg.out = out_graph.view();
  pd.stream = pg.stream = stream;
  ASSERT_TRUE(kda_recurrent_step(pd).ok());
  ASSERT_TRUE(kda_recurrent_step(pd).ok());
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  FLARE_CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  const Status s = kda_recurrent_step(pg);
  FLARE_CUDA_OK(cudaStreamEndCapture(stream, &graph));
  ASSERT_TRUE(s.ok()) << s.message();
  FLARE_CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  FLARE_CUDA_OK(cudaGraphLaunch(exec, stream));
  FLARE_CUDA_OK(cudaGraphLaunch(exec, stream));
  FLARE_CUDA_OK(cudaStreamSynchronize(stream));
  HostTensor a(DType::kFloat32, {p.P, p.c.HV, p.c.K, p.c.V}), b(DType::kFloat32, {p.P, p.c.HV, p.c.K, p.c.V});
  HostTensor oa(p.c.dtype, {p.B, p.T, p.c.HV, p.c.V}), ob(p.c.dtype, {p.B, p.T, p.c.HV, p.c.V});
  direct.pool.download(a), graphed.pool.download(b);
  out_direct.download(oa), out_graph.download(ob);
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.nbytes()), 0) << "pool after two graph replays";
  EXPECT_EQ(std::memcmp(oa.data(), ob.data(), oa.nbytes()), 0) << "outputs of the second replay";
  EXPECT_FALSE(same_slot(a, p.pool, 3, p.c.HV * p.c.K * p.c.V)) << "the steps wrote nothing";
  FLARE_CUDA_OK(cudaGraphExecDestroy(exec));
  FLARE_CUDA_OK(cudaGraphDestroy(graph));
  FLARE_CUDA_OK(cudaStreamDestroy(stream));
}

// ---- a chain of recurrent steps against the chunked forward ------------------------------------

// Tokens [t0, t0 + len) of a [B, T, ...] view.
TensorView token_slice(TensorView t, int64_t t0, int64_t len) {
  t.data = static_cast<char*>(t.data) + t0 * t.stride[1] * static_cast<int64_t>(dtype_size(t.dtype));
  t.shape[1] = len;
  return t;
}

void run_chain(Case c, int64_t T, int64_t step, uint64_t seed) {
  SCOPED_TRACE(c.name);
  c.Tq = T;
  const Problem p = make_problem(c, seed);  // pool = slot n: the initial states
  const Case& cc = p.c;
  const Expected e = run_oracle(p);

  // kda_forward and its low-precision baseline (the chunked form with 16-bit intermediates).
  DeviceProblem dp(p);
  HostTensor out_chunk(cc.dtype, {p.B, T, cc.HV, cc.V}), state_chunk(DType::kFloat32, {cc.N, cc.HV, cc.K, cc.V});
  DeviceTensor d_out_chunk(out_chunk), d_state_chunk(state_chunk);
  d_out_chunk.poison();
  d_state_chunk.poison();
  const KdaRecurrentParams rp = dp.params();
  KdaForwardParams fp;
  fp.q = rp.q, fp.k = rp.k, fp.v = rp.v, fp.g = rp.g, fp.beta = rp.beta, fp.A_log = rp.A_log, fp.dt_bias = rp.dt_bias;
  fp.options = rp.options;
  fp.initial_state = rp.state;
  fp.out = d_out_chunk.view(), fp.final_state = d_state_chunk.view();
  size_t bytes = 0;
  ASSERT_TRUE(kda_forward_workspace_size(fp, &bytes).ok());
  void* workspace = nullptr;
  FLARE_CUDA_OK(cudaMalloc(&workspace, std::max<size_t>(bytes, 256)));
  fp.workspace = workspace, fp.workspace_bytes = bytes;
  const Status sf = kda_forward(fp);
  ASSERT_TRUE(sf.ok()) << sf.message();

  // The chain: `step` tokens per call, the pool updated in place.
  HostTensor out_chain(cc.dtype, {p.B, T, cc.HV, cc.V}), state_chain(DType::kFloat32, {cc.N, cc.HV, cc.K, cc.V});
  DeviceTensor d_out_chain(out_chain);
  d_out_chain.poison();
  for (int64_t t0 = 0; t0 < T; t0 += step) {
    const int64_t len = std::min(step, T - t0);
    KdaRecurrentParams sp = rp;
    for (TensorView* t : {&sp.q, &sp.k, &sp.v, &sp.g, &sp.beta}) *t = token_slice(*t, t0, len);
    sp.out = token_slice(d_out_chain.view(), t0, len);
    const Status s = kda_recurrent_step(sp);
    ASSERT_TRUE(s.ok()) << "step at token " << t0 << ": " << s.message();
  }
  FLARE_CUDA_OK(cudaDeviceSynchronize());
  FLARE_CUDA_OK(cudaFree(workspace));
  d_out_chunk.download(out_chunk), d_state_chunk.download(state_chunk);
  d_out_chain.download(out_chain), dp.pool.download(state_chain);

  HostTensor out_chunk_lowp(cc.dtype, {p.B, T, cc.HV, cc.V}), state_chunk_lowp(DType::kFloat64, {cc.N, cc.HV, cc.K, cc.V});
  {
    KdaForwardParams hp;
    const KdaRecurrentParams host = p.params();
    hp.q = host.q, hp.k = host.k, hp.v = host.v, hp.g = host.g, hp.beta = host.beta;
    hp.A_log = host.A_log, hp.dt_bias = host.dt_bias, hp.options = host.options, hp.initial_state = p.pool;
    hp.out = out_chunk_lowp, hp.final_state = state_chunk_lowp;
    ASSERT_TRUE(ref::kda_forward_chunked(hp, 64, cc.dtype).ok());
  }

  // Each against the oracle, then against each other: their difference is bounded by the sum of
  // the two tolerances.
  const ErrorReport chain_out = compare(out_chain, e.out64, &e.out_lowp);
  const ErrorReport chain_state = compare(state_chain, e.state64, &e.state_lowp);
  const ErrorReport chunk_out = compare(out_chunk, e.out64, &out_chunk_lowp);
  const ErrorReport chunk_state = compare(state_chunk, e.state64, &state_chunk_lowp);
  std::printf("  %-36s chain %s | %s\n  %-36s chunk %s | %s\n", c.name.c_str(), chain_out.describe("out").c_str(),
              chain_state.describe("state").c_str(), "", chunk_out.describe("out").c_str(),
              chunk_state.describe("state").c_str());
  EXPECT_TRUE(within_tolerance(chain_out, "chain out", kErrFactor, kOutAtol));
  EXPECT_TRUE(within_tolerance(chain_state, "chain state", kErrFactor, kStateAtol));
  EXPECT_TRUE(within_tolerance(chunk_out, "kda_forward out", kErrFactor, kOutAtol));
  EXPECT_TRUE(within_tolerance(chunk_state, "kda_forward state", kErrFactor, kOutAtol));
  const ErrorReport d_out = compare(out_chain, out_chunk, nullptr), d_state = compare(state_chain, state_chunk, nullptr);
  const double out_bound = kErrFactor * (chain_out.lowp_err + chunk_out.lowp_err) + 2 * kOutAtol;
  const double state_bound = kErrFactor * (chain_state.lowp_err + chunk_state.lowp_err) + kStateAtol + kOutAtol;
  std::printf("  %-36s chain vs kda_forward: out %.3g (bound %.3g), state %.3g (bound %.3g)\n", "", d_out.max_err,
              out_bound, d_state.max_err, state_bound);
  EXPECT_EQ(d_out.nan_count + d_state.nan_count, 0);
  EXPECT_LE(d_out.max_err, out_bound);
  EXPECT_LE(d_state.max_err, state_bound);
}

TEST(KdaRecurrent, ChainOfStepsMatchesChunkedForward) {
  FLARE_REQUIRE_GPU();
  Case c = named("chain of 1-token steps, T 70");
  c.N = 2, c.H = 2, c.HV = 2;
  run_chain(c, 70, 1, 1200);
  c.name = "chain of 5-token steps, layer mode, GVA";
  c.HV = 4;
  c.options.qk_l2norm = c.options.beta_sigmoid = c.options.gate_in_kernel = true;
  run_chain(c, 70, 5, 1201);
  c = named("chain of 8-token steps, GDN, K64 V128");
  c.N = 2, c.gdn = true, c.K = 64;
  run_chain(c, 130, 8, 1202);
}

// ---- arguments --------------------------------------------------------------------------------

TEST(KdaRecurrent, Arguments) {
  FLARE_REQUIRE_GPU();
  Case c = named("arguments");
  c.N = 2, c.Tq = 2, c.P = 3, c.indices = {2, 0};
  const Problem p = make_problem(c, 1300);
  DeviceProblem dp(p);
  HostTensor out(c.dtype, {p.B, p.T, c.HV, c.V});
  DeviceTensor d_out(out);
  KdaRecurrentParams base = dp.params();
  base.out = d_out.view();
  ASSERT_TRUE(kda_recurrent_step(base).ok());
  FLARE_CUDA_OK(cudaDeviceSynchronize());

  KdaRecurrentParams params = base;
  params.state_indices = p.indices.view();  // a host view
  EXPECT_TRUE(rejects(kda_recurrent_step(params), "state_indices", "CUDA device"));
  params = base;
  params.state_indices.dtype = DType::kInt64;
  EXPECT_TRUE(rejects(kda_recurrent_step(params), "state_indices", "dtype"));
  params = base;
  params.state_indices.shape[0] = 3;
  EXPECT_TRUE(rejects(kda_recurrent_step(params), "state_indices", "[2]"));
  params = base;
  params.state.shape[1] = 2;
  EXPECT_TRUE(rejects(kda_recurrent_step(params), "state", "HV = 4"));
  params = base;
  params.state_indices = TensorView{};
  EXPECT_TRUE(rejects(kda_recurrent_step(params), "state", "P = N = 2"));
  params = base;
  params.out.data = nullptr;
  EXPECT_TRUE(rejects(kda_recurrent_step(params), "out", "null"));
  params = base;
  params.final_state = dp.pool.view();  // [P, ...], not [N, ...]
  EXPECT_TRUE(rejects(kda_recurrent_step(params), "final_state", "[2, 4, 128, 128]"));
  params = base;
  params.options.gate_in_kernel = true;
  params.A_log = TensorView{};
  EXPECT_TRUE(rejects(kda_recurrent_step(params), "A_log"));

  // K = 96: valid arguments, no kernel for them.
  Case odd = named("K96");
  odd.N = 1, odd.K = 96;
  const Problem q = make_problem(odd, 1301);
  DeviceProblem dq(q);
  HostTensor out96(odd.dtype, {q.B, q.T, odd.HV, odd.V});
  DeviceTensor d_out96(out96);
  params = dq.params();
  params.out = d_out96.view();
  EXPECT_EQ(kda_recurrent_step(params).code(), StatusCode::kNotSupported);
}

}  // namespace
}  // namespace flare::test
