// The GPU backward's kernels (src/kda/kda_bwd_*.cuh and the forward's chunk prep), run on the CPU
// under the CUDA emulation of tests/cpu/cuda_emu (one OS thread per CUDA thread, the m16n8k16
// fragment layouts of ldmatrix / mma.sync computed exactly): the kernels' index and layout logic
// is checked on every CI run, without a GPU. Each case goes through the API's own argument
// building (detail::kda_backward_args, over host memory labelled as device memory), the kernels
// in launch_backward's order (the varlen chunk table, which uses cub, is built on the host), with
// outputs, workspace and shared memory poisoned (NaN) first, and every gradient is judged as in
// tests/gpu/test_kda_backward.cu: |emulated - oracle| <= 4 |lowp - oracle| + 1e-4 max|oracle|
// (one unit of the dtype instead of 1e-4 for dA_log and ddt_bias).
// Small shapes only (the emulation is slow); the GPU test covers the rest.
#include "tests/cpu/cuda_emu/cuda_emu.h"  // first: the emulated runtime for the kernel headers

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "flare/kda.h"
#include "reference/host_tensor.h"
#include "reference/kda_ref.h"
#include "src/kda/kda_bwd_chunk_grad.cuh"
#include "src/kda/kda_bwd_finish.cuh"
#include "src/kda/kda_bwd_params.h"
#include "src/kda/kda_bwd_state_pass.cuh"
#include "src/kda/kda_bwd_state_record.cuh"
#include "src/kda/kda_chunk_prep.cuh"
#include "src/kda/kda_state_pass.cuh"

CUDA_EMU_SHARED_MEMORY(flare::kda, smem_raw)

namespace {

using flare::DType;
using flare::KdaBackwardParams;
using flare::KdaOptions;
using flare::Status;
using flare::TensorView;
using flare::detail::KdaBwdArgs;
using flare::detail::KdaChunk;
using flare::detail::KdaFwdArgs;
using flare::ref::HostTensor;
namespace kda = flare::kda;

// The varlen chunk table of kda_chunk_table.cu, on the host (the args point at host memory).
void build_chunk_table(const KdaFwdArgs& a) {
  auto cu = [&a](int n) -> int64_t {
    return a.cu_int64 ? static_cast<const int64_t*>(a.cu_seqlens)[n] : static_cast<const int32_t*>(a.cu_seqlens)[n];
  };
  int c = 0;
  for (int n = 0; n < a.num_seqs; ++n) {
    a.seq_chunk_begin[n] = c;
    for (int64_t t0 = cu(n); t0 < cu(n + 1); t0 += flare::detail::kKdaChunk)
      a.chunks[c++] = KdaChunk{0, static_cast<int>(t0),
                               static_cast<int>(std::min<int64_t>(flare::detail::kKdaChunk, cu(n + 1) - t0)), n};
  }
  a.seq_chunk_begin[a.num_seqs] = c;
  for (; c < a.max_chunks; ++c) a.chunks[c] = KdaChunk{0, 0, 0, 0};
  // The state passes' row order: longest first, as the GPU's table kernel writes it.
  std::vector<int> order(a.num_seqs);
  for (int n = 0; n < a.num_seqs; ++n) order[n] = n;
  auto chunks_of = [&a](int n) { return a.seq_chunk_begin[n + 1] - a.seq_chunk_begin[n]; };
  std::stable_sort(order.begin(), order.end(), [&](int x, int y) { return chunks_of(x) > chunks_of(y); });
  std::copy(order.begin(), order.end(), a.seq_order);
}

// launch_backward (kda_bwd_launch.cuh), kernel by kernel, with value slices of BV columns.
template <typename T, int K, int V, int BV>
void run_kernels(const KdaBwdArgs& b) {
  const KdaFwdArgs& a = b.fwd;
  unsigned char* smem = kda::smem_raw;
  if (a.varlen) build_chunk_table(a);
  if (a.max_chunks > 0)
    cuda_emu::launch(dim3(a.max_chunks * a.heads_v), kda::PrepConfig<K, V>::kThreads, smem,
                     [&] { kda::kda_chunk_prep_kernel<T, K, V>(a); });
  const dim3 passes(V / BV, a.heads_v, a.num_seqs);
  cuda_emu::launch(passes, kda::RecordConfig<K, BV>::kThreads, smem,
                   [&] { kda::kda_state_record_kernel<T, K, V, BV>(b); });
  cuda_emu::launch(passes, kda::BwdStateConfig<K, BV>::kThreads, smem,
                   [&] { kda::kda_bwd_state_pass_kernel<T, K, V, BV>(b); });
  if (a.max_chunks > 0)
    cuda_emu::launch(dim3(a.max_chunks, a.heads_v), kda::GradConfig<K, V>::kThreads, smem,
                     [&] { kda::kda_chunk_grad_kernel<T, K, V>(b); });
  if (b.dq_heads != nullptr) {
    const int64_t total = int64_t{a.batch} * a.seqlen * a.heads * a.key_dim;
    const int blocks = static_cast<int>((total + kda::kFinishThreads - 1) / kda::kFinishThreads);
    if (blocks > 0)
      cuda_emu::launch(dim3(blocks), kda::kFinishThreads, smem, [&] { kda::kda_sum_value_heads_kernel<T>(b); });
  }
  if (b.dA_log != nullptr || b.ddt_bias != nullptr) {
    const int outputs = a.heads_v * ((a.scalar_gate ? 1 : a.key_dim) + 1);
    cuda_emu::launch(dim3((outputs + kda::kFinishThreads - 1) / kda::kFinishThreads), kda::kFinishThreads, smem,
                     [&] { kda::kda_gate_params_kernel(b); });
  }
}

struct Case {
  std::string name;
  int64_t B = 1, T = 65, H = 1, HV = 2, K = 64, V = 64;
  int bv = 32;  // value columns per state-pass block
  std::vector<int64_t> seqlens;
  DType dtype = DType::kBFloat16, g_dtype = DType::kFloat32, grad_dtype = DType::kFloat32;
  bool gdn = false, initial_state = true, d_final_state = true;
  KdaOptions options{};
  bool A_log = true, dt_bias = true;  // given when options.gate_in_kernel
};

struct Problem {
  Case c;
  int64_t N = 0;
  HostTensor q, k, v, g, beta, A_log, dt_bias, h0, cu, dout, dht;
};

void make_problem(Case c, uint64_t seed, Problem* p) {
  std::mt19937_64 rng(seed);
  if (!c.seqlens.empty()) {
    c.B = 1, c.T = 0;
    for (int64_t len : c.seqlens) c.T += len;
  }
  p->N = c.seqlens.empty() ? c.B : static_cast<int64_t>(c.seqlens.size());
  const KdaOptions& o = c.options;
  p->q.reset(c.dtype, {c.B, c.T, c.H, c.K});
  p->k.reset(c.dtype, {c.B, c.T, c.H, c.K});
  p->v.reset(c.dtype, {c.B, c.T, c.HV, c.V});
  p->dout.reset(c.dtype, {c.B, c.T, c.HV, c.V});
  p->beta.reset(c.g_dtype, {c.B, c.T, c.HV});
  if (c.gdn) p->g.reset(c.g_dtype, {c.B, c.T, c.HV});
  else p->g.reset(c.g_dtype, {c.B, c.T, c.HV, c.K});
  p->q.fill_uniform(rng);
  p->k.fill_normal(rng);
  if (!o.qk_l2norm) {
    for (int64_t r = 0; r < p->k.numel(); r += c.K) {
      double sum = 0;
      for (int64_t e = 0; e < c.K; ++e) sum += p->k.get(r + e) * p->k.get(r + e);
      for (int64_t e = 0; e < c.K; ++e) p->k.set(r + e, p->k.get(r + e) / std::sqrt(sum));
    }
  }
  p->v.fill_uniform(rng);
  p->dout.fill_uniform(rng);
  if (o.gate_in_kernel) p->g.fill_normal(rng);
  else p->g.fill_uniform(rng, -0.5, -0.01);
  if (o.beta_sigmoid) p->beta.fill_normal(rng);
  else p->beta.fill_uniform(rng, 0.1, 0.9);
  if (o.gate_in_kernel && c.A_log) {
    p->A_log.reset(DType::kFloat32, {c.HV});
    p->A_log.fill_uniform(rng, -1.0, 0.5);
  }
  if (o.gate_in_kernel && c.dt_bias) {
    p->dt_bias.reset(DType::kFloat32, {c.gdn ? c.HV : c.HV * c.K});
    p->dt_bias.fill_uniform(rng, -0.5, 0.5);
  }
  if (c.initial_state) {
    p->h0.reset(DType::kFloat32, {p->N, c.HV, c.K, c.V});
    p->h0.fill_uniform(rng);
  }
  if (c.d_final_state) {
    p->dht.reset(DType::kFloat32, {p->N, c.HV, c.K, c.V});
    p->dht.fill_uniform(rng);
  }
  if (!c.seqlens.empty()) {
    p->cu.reset(DType::kInt64, {static_cast<int64_t>(c.seqlens.size()) + 1});
    int64_t end = 0;
    p->cu.set(0, 0);
    for (size_t n = 0; n < c.seqlens.size(); ++n) p->cu.set(static_cast<int64_t>(n) + 1, end += c.seqlens[n]);
  }
  p->c = std::move(c);
}

struct Grads {
  HostTensor dq, dk, dv, dg, dbeta, dh0, dA_log, ddt_bias;

  Grads(const Problem& p, DType qkv, DType small) {
    const Case& c = p.c;
    dq.reset(qkv, {c.B, c.T, c.H, c.K});
    dk.reset(qkv, {c.B, c.T, c.H, c.K});
    dv.reset(qkv, {c.B, c.T, c.HV, c.V});
    if (c.gdn) dg.reset(small, {c.B, c.T, c.HV});
    else dg.reset(small, {c.B, c.T, c.HV, c.K});
    dbeta.reset(small, {c.B, c.T, c.HV});
    const DType fp = small == DType::kFloat64 ? small : DType::kFloat32;
    if (c.initial_state) dh0.reset(fp, {p.N, c.HV, c.K, c.V});
    if (c.options.gate_in_kernel && c.A_log) dA_log.reset(fp, {c.HV});
    if (c.options.gate_in_kernel && c.dt_bias) ddt_bias.reset(fp, {c.gdn ? c.HV : c.HV * c.K});
    for (HostTensor* t : {&dq, &dk, &dv, &dg, &dbeta, &dh0, &dA_log, &ddt_bias})
      if (t->view().defined()) t->fill(std::nan(""));
  }
  std::vector<std::pair<const char*, HostTensor*>> named() {
    std::vector<std::pair<const char*, HostTensor*>> all = {
        {"dq", &dq}, {"dk", &dk}, {"dv", &dv}, {"dg", &dg}, {"dbeta", &dbeta}};
    if (dh0.view().defined()) all.push_back({"d_initial_state", &dh0});
    if (dA_log.view().defined()) all.push_back({"dA_log", &dA_log});
    if (ddt_bias.view().defined()) all.push_back({"ddt_bias", &ddt_bias});
    return all;
  }
};

KdaBackwardParams params_of(const Problem& p, const Grads& d) {
  KdaBackwardParams b;
  b.q = p.q, b.k = p.k, b.v = p.v, b.g = p.g, b.beta = p.beta, b.A_log = p.A_log, b.dt_bias = p.dt_bias;
  b.initial_state = p.h0, b.cu_seqlens = p.cu, b.dout = p.dout, b.d_final_state = p.dht;
  b.options = p.c.options;
  b.dq = d.dq, b.dk = d.dk, b.dv = d.dv, b.dg = d.dg, b.dbeta = d.dbeta;
  b.d_initial_state = d.dh0, b.dA_log = d.dA_log, b.ddt_bias = d.ddt_bias;
  return b;
}

// The same views labelled as device memory (the emulated kernels read host memory).
KdaBackwardParams on_device(KdaBackwardParams b) {
  for (TensorView* t : {&b.q, &b.k, &b.v, &b.g, &b.beta, &b.A_log, &b.dt_bias, &b.initial_state, &b.cu_seqlens,
                        &b.dout, &b.d_final_state, &b.dq, &b.dk, &b.dv, &b.dg, &b.dbeta, &b.d_initial_state,
                        &b.dA_log, &b.ddt_bias})
    if (t->defined()) t->device = flare::Device{flare::DeviceKind::kCUDA, 0};
  return b;
}

template <typename T, int K, int V>
void run_kernels_bv(const KdaBwdArgs& b, int bv) {
  if (bv == 16) run_kernels<T, K, V, 16>(b);
  else if (bv == 32) run_kernels<T, K, V, 32>(b);
  else run_kernels<T, K, V, 64>(b);
}

template <typename T>
void run_kernels_shape(const KdaBwdArgs& b, int bv) {
  const int K = b.fwd.key_dim, V = b.fwd.value_dim;
  if (K == 64 && V == 64) run_kernels_bv<T, 64, 64>(b, bv);
  else if (K == 64) run_kernels_bv<T, 64, 128>(b, bv);
  else if (V == 64) run_kernels_bv<T, 128, 64>(b, bv);
  else run_kernels_bv<T, 128, 128>(b, bv);
}

constexpr double kErrFactor = 4.0;

// The absolute slack, relative to the gradient's largest magnitude: 1e-4, and for dA_log and
// ddt_bias, sums over every token whose baseline error can cancel by luck, one unit of the dtype.
double reduction_slack(const std::string& name, DType dtype) {
  if (name != "dA_log" && name != "ddt_bias") return 1e-4;
  return dtype == DType::kBFloat16 ? 0x1p-8 : 0x1p-11;
}

void run_case(const Case& c, uint64_t seed) {
  SCOPED_TRACE(c.name);
  Problem p;
  make_problem(c, seed, &p);
  const Case& cc = p.c;
  Grads want(p, DType::kFloat64, DType::kFloat64), lowp(p, cc.dtype, cc.grad_dtype), got(p, cc.dtype, cc.grad_dtype);
  ASSERT_TRUE(flare::ref::kda_backward(params_of(p, want)).ok());
  ASSERT_TRUE(flare::ref::kda_backward_chunked(params_of(p, lowp), 64, cc.dtype).ok());

  KdaBackwardParams dp = on_device(params_of(p, got));
  size_t bytes = 0;
  Status st = flare::kda_backward_workspace_size(dp, &bytes);
  ASSERT_TRUE(st.ok()) << st.message();
  std::vector<unsigned char> workspace(bytes + 256, 0xFF);  // poisoned
  dp.workspace = workspace.data() + (256 - reinterpret_cast<uintptr_t>(workspace.data()) % 256) % 256;
  dp.workspace_bytes = bytes;
  KdaBwdArgs args;
  const Status sa = flare::detail::kda_backward_args(dp, &args);
  ASSERT_TRUE(sa.ok()) << sa.message();
  if (cc.dtype == DType::kBFloat16) run_kernels_shape<__nv_bfloat16>(args, cc.bv);
  else run_kernels_shape<__half>(args, cc.bv);

  auto w = want.named(), l = lowp.named(), g = got.named();
  std::printf("  %s\n", cc.name.c_str());
  for (size_t i = 0; i < w.size(); ++i) {
    double scale = 0, err = 0, lowp_err = 0;
    int64_t nan = 0;
    for (int64_t e = 0; e < w[i].second->numel(); ++e) {
      const double ref = w[i].second->get(e), x = g[i].second->get(e);
      scale = std::max(scale, std::abs(ref));
      if (std::isnan(x)) ++nan;
      else err = std::max(err, std::abs(x - ref));
      lowp_err = std::max(lowp_err, std::abs(l[i].second->get(e) - ref));
    }
    std::printf("    %-16s |max| %.3g  err %.3g  (baseline %.3g)  nan %lld\n", w[i].first, scale, err, lowp_err,
                static_cast<long long>(nan));
    EXPECT_EQ(nan, 0) << w[i].first;
    EXPECT_LE(err, kErrFactor * lowp_err + reduction_slack(w[i].first, cc.dtype) * std::max(scale, 1.0)) << w[i].first;
  }
}

// The emulation itself, against kernels proved on the H100: the forward (chunk prep and state
// pass) must reproduce the oracle's output as tests/gpu/test_kda.cu requires of the GPU.
// The forward's kernels (prep, then the state pass: whole, or cut into `segments` segments of
// segment_chunks chunks, segment 0 first_chunks when given: transition, combine, output) on a K64
// V128 case of T tokens, against the oracle.
void run_forward_case(int64_t T, int segments, int segment_chunks, uint64_t seed, int first_chunks = 0,
                      int prep_order = flare::detail::kChunkMajor) {
  Problem p;
  make_problem({.name = "forward", .T = T, .V = 128}, seed, &p);
  const Case& c = p.c;
  HostTensor want(DType::kFloat64, {c.B, c.T, c.HV, c.V}), lowp(c.dtype, {c.B, c.T, c.HV, c.V});
  HostTensor got(c.dtype, {c.B, c.T, c.HV, c.V}), final_got(DType::kFloat32, {1, c.HV, c.K, c.V});
  HostTensor final_want(DType::kFloat32, {1, c.HV, c.K, c.V});
  got.fill(std::nan(""));
  final_got.fill(std::nan(""));
  flare::KdaForwardParams f;
  f.q = p.q, f.k = p.k, f.v = p.v, f.g = p.g, f.beta = p.beta, f.initial_state = p.h0, f.options = c.options;
  f.out = want, f.final_state = final_want;
  ASSERT_TRUE(flare::ref::kda_forward(f).ok());
  f.out = lowp, f.final_state = {};
  ASSERT_TRUE(flare::ref::kda_forward_chunked(f, 64, c.dtype).ok());
  // The args as kda_forward builds them (its workspace layout, the segment arrays after it),
  // without the launch.
  const int chunks = static_cast<int>((c.T + 63) / 64);
  const auto l = flare::detail::kda_workspace_layout(chunks, c.HV, c.K, c.V, 1, 2);
  size_t transition_bytes = 0;
  const size_t seg_bytes = segments > 1 ? flare::detail::kda_segment_bytes(1, c.HV, c.K, c.V, segments,
                                                                           &transition_bytes)
                                        : 0;
  std::vector<unsigned char> workspace(l.total + seg_bytes + 256, 0xFF);
  unsigned char* ws = workspace.data() + (256 - reinterpret_cast<uintptr_t>(workspace.data()) % 256) % 256;
  KdaFwdArgs a{};
  a.q = p.q.data(), a.k = p.k.data(), a.v = p.v.data(), a.g = p.g.data(), a.beta = p.beta.data();
  a.initial_state = static_cast<const float*>(p.h0.data());
  auto strides = [](const HostTensor& t) {
    const TensorView& v = t.view();
    return flare::detail::RowStrides{v.stride[0], v.stride[1], v.stride[2]};
  };
  a.q_st = strides(p.q), a.k_st = strides(p.k), a.v_st = strides(p.v), a.g_st = strides(p.g);
  a.beta_st = strides(p.beta), a.out_st = strides(got);
  a.g_fp32 = a.beta_fp32 = true;
  a.out = got.data();
  a.final_state = static_cast<float*>(final_got.data());
  a.batch = 1, a.seqlen = static_cast<int>(c.T), a.heads = 1, a.heads_v = static_cast<int>(c.HV), a.num_seqs = 1;
  a.key_dim = static_cast<int>(c.K), a.value_dim = static_cast<int>(c.V);
  a.chunks_per_row = a.max_chunks = chunks;
  a.scale = 1.f / std::sqrt(static_cast<float>(c.K));
  a.beta_factor = 1.f;
  a.w = ws + l.w, a.u = ws + l.u, a.kg = ws + l.kg, a.qg = ws + l.qg, a.P = ws + l.P;
  a.decay = reinterpret_cast<float*>(ws + l.decay);
  a.prep_order = prep_order;
  cuda_emu::launch(dim3(chunks * a.heads_v), kda::PrepConfig<64, 128>::kThreads, kda::smem_raw,
                   [&] { kda::kda_chunk_prep_kernel<__nv_bfloat16, 64, 128>(a); });
  // The launch order of kda_fwd_launch.cuh (unsegmented: the output pass alone).
  a.state_segments = segments, a.segment_chunks = segments > 1 ? segment_chunks : 0;
  a.first_segment_chunks = segments > 1 ? (first_chunks > 0 ? first_chunks : segment_chunks) : 0;
  a.seg_transition = reinterpret_cast<float*>(ws + l.total);
  a.seg_start = reinterpret_cast<float*>(ws + l.total + transition_bytes);
  if (segments > 2)
    cuda_emu::launch(dim3(1, a.heads_v, segments - 2), kda::TransitionConfig<64, 128>::kThreads, kda::smem_raw,
                     [&] { kda::kda_state_transition_kernel<__nv_bfloat16, 64, 128>(a); });
  cuda_emu::launch(dim3(128 / 32, a.heads_v, 1), kda::StateConfig<64, 32>::kThreads, kda::smem_raw,
                   [&] { kda::kda_state_pass_kernel<__nv_bfloat16, 64, 128, 32>(a, 0); });
  if (segments > 2)
    cuda_emu::launch(dim3(128 / kda::kSegmentCombineCols, a.heads_v, 1), 64, kda::smem_raw,
                     [&] { kda::kda_state_segment_combine_kernel<64, 128>(a); });
  if (segments > 1)
    cuda_emu::launch(dim3(128 / 32, a.heads_v, segments - 1), kda::StateConfig<64, 32>::kThreads, kda::smem_raw,
                     [&] { kda::kda_state_pass_kernel<__nv_bfloat16, 64, 128, 32>(a, 1); });
  double err = 0, lowp_err = 0, final_err = 0, final_max = 0;
  for (int64_t e = 0; e < want.numel(); ++e) {
    err = std::max(err, std::isnan(got.get(e)) ? INFINITY : std::abs(got.get(e) - want.get(e)));
    lowp_err = std::max(lowp_err, std::abs(lowp.get(e) - want.get(e)));
  }
  for (int64_t e = 0; e < final_want.numel(); ++e) {
    final_err = std::max(final_err, std::isnan(final_got.get(e)) ? INFINITY
                                                                  : std::abs(final_got.get(e) - final_want.get(e)));
    final_max = std::max(final_max, std::abs(final_want.get(e)));
  }
  std::printf("  forward T %lld, %d segment(s): out err %.3g (baseline %.3g), final state err %.3g (max %.3g)\n",
              static_cast<long long>(T), segments, err, lowp_err, final_err, final_max);
  EXPECT_LE(err, 3 * lowp_err + 1e-4);  // test_kda.cu's rule
  EXPECT_GT(err, 0.0);  // 16-bit operands: never exact
  EXPECT_LE(final_err, 2e-2 * final_max);
}

// T 100: two chunks; T 600: ten, so the output pass's three stages and two u slots each wrap
// around several times (its prep in the reversed head-major order, kda_prep_order.h).
TEST(KdaBackwardEmulated, ForwardKernelsAsOnTheGpu) {
  run_forward_case(100, 1, 0, 11);
  run_forward_case(600, 1, 0, 21, 0, flare::detail::kHeadMajorReversed);
}

// The segmented state pass (kda_state_segments.h): 4 segments of 1 chunk (two transitions),
// 3 of 2 (one transition, the last segment short), 2 of 3 (none: segment 0, then segment 1).
TEST(KdaBackwardEmulated, SegmentedForwardStatePass) {
  run_forward_case(200, 4, 1, 13);
  run_forward_case(300, 3, 2, 15);
  run_forward_case(200, 2, 3, 14);
  // Segment 0 longer than the others (kda_segments_weighted): 3 chunks, then 1, 1 (a transition).
  run_forward_case(300, 3, 1, 16, 3, flare::detail::kHeadMajor);
}

TEST(KdaBackwardEmulated, Kda) {
  run_case({.name = "KDA K64 V64 T65 GVA 2 bf16", .bv = 16}, 1);
  run_case({.name = "KDA K128 V128 T70 fp16", .T = 70, .HV = 1, .K = 128, .V = 128, .bv = 64,
            .dtype = DType::kFloat16}, 2);
}

TEST(KdaBackwardEmulated, MixedHeadDims) {
  run_case({.name = "KDA K128 V64 T1 no state", .T = 1, .HV = 1, .K = 128, .V = 64, .initial_state = false,
            .d_final_state = false}, 3);
  run_case({.name = "KDA K64 V128 B2 T17 dht only", .B = 2, .T = 17, .H = 1, .HV = 1, .V = 128, .bv = 32,
            .initial_state = false}, 4);
}

// No tokens at all: d_initial_state is the seed, dA_log and ddt_bias are zeros.
TEST(KdaBackwardEmulated, OnlyEmptySequences) {
  run_case({.name = "varlen {0, 0} gate", .seqlens = {0, 0}, .options = {.gate_in_kernel = true}}, 12);
}

TEST(KdaBackwardEmulated, VarlenLayerMode) {
  KdaOptions o{.qk_l2norm = true, .beta_sigmoid = true, .allow_neg_eigval = true, .gate_in_kernel = true};
  run_case({.name = "KDA varlen {1, 0, 70} layer mode, bf16 g and grads", .seqlens = {1, 0, 70},
            .g_dtype = DType::kBFloat16, .grad_dtype = DType::kBFloat16, .options = o}, 5);
}

TEST(KdaBackwardEmulated, Options) {
  run_case({.name = "KDA GVA 2 l2norm, gate without dt_bias", .H = 2, .HV = 4, .bv = 64,
            .options = {.qk_l2norm = true, .gate_in_kernel = true}, .dt_bias = false}, 8);
  run_case({.name = "KDA T130 V128 bounded gate without A_log, beta sigmoid, scale", .T = 130, .V = 128, .bv = 16,
            .options = {.scale = 0.3f, .beta_sigmoid = true, .gate_in_kernel = true, .lower_bound = -3.f},
            .A_log = false}, 9);
}

TEST(KdaBackwardEmulated, GatedDeltaRule) {
  KdaOptions o{.gate_in_kernel = true, .lower_bound = -4.f};
  run_case({.name = "GDN varlen {66, 0, 3} bounded gate", .seqlens = {66, 0, 3}, .gdn = true, .options = o}, 6);
  // fp16 operands hold 2^x only up to x = 16: the gate summed over 8 tokens must stay above -11.
  run_case({.name = "GDN fp16 default gate K128", .T = 70, .HV = 1, .K = 128, .bv = 64, .dtype = DType::kFloat16,
            .gdn = true, .options = {.gate_in_kernel = true}}, 7);
}

}  // namespace
