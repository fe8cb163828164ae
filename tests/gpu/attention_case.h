// One attention test problem: random host inputs, their device copies, the params for the GPU
// op and the CPU oracle (exact and in the input dtype), and the checks of every output.
#pragma once

#include <algorithm>
#include <memory>
#include <random>
#include <sstream>
#include <vector>

#include "flare/attention.h"
#include "reference/attention_ref.h"
#include "tests/gpu/gpu_harness.h"
#include "tests/gpu/unbuilt.h"

namespace flare::test {

struct AttnCase {
  int batch = 1, seqlen_q = 128, seqlen_k = 128, heads = 2, heads_kv = 2, head_dim = 64;
  DType dtype = DType::kBFloat16;
  MaskParams mask{};
  float softcap = 0.f;
  bool sinks = false;
  std::vector<int> varlen_q, varlen_k;  // per-sequence lengths: varlen when non-empty
  uint64_t seed = 1;

  bool varlen() const { return !varlen_q.empty(); }
  std::string name() const {
    std::ostringstream s;
    s << "b" << batch << " sq" << seqlen_q << " sk" << seqlen_k << " h" << heads << "/" << heads_kv << " d"
      << head_dim << (dtype == DType::kBFloat16 ? " bf16" : " fp16") << (mask.causal ? " causal" : "")
      << " win(" << mask.window_left << "," << mask.window_right << ")" << (softcap > 0 ? " softcap" : "")
      << (sinks ? " sinks" : "") << (varlen() ? " varlen" : "") << " seed " << seed;
    return s.str();
  }
};

// A case's host layout: the operands' shapes and, varlen, the packed lengths (cu_seqlens, the
// longest sequences, at least 1). Shared with the emulated CPU test (test_attention_emulated).
struct AttnLayout {
  ref::HostTensor cu_q, cu_k;  // int32 [N + 1], varlen only
  std::vector<int64_t> q_shape, k_shape, lse_shape;
  int max_q = 0, max_k = 0;

  explicit AttnLayout(const AttnCase& c) {
    if (c.varlen()) {
      int64_t tq = 0, tk = 0;
      cu_q.reset(DType::kInt32, {int64_t(c.varlen_q.size()) + 1});
      cu_k.reset(DType::kInt32, {int64_t(c.varlen_k.size()) + 1});
      cu_q.set(0, 0);
      cu_k.set(0, 0);
      for (size_t b = 0; b < c.varlen_q.size(); ++b) {
        cu_q.set(b + 1, tq += c.varlen_q[b]);
        cu_k.set(b + 1, tk += c.varlen_k[b]);
        max_q = std::max(max_q, c.varlen_q[b]);
        max_k = std::max(max_k, c.varlen_k[b]);
      }
      max_q = std::max(max_q, 1);
      max_k = std::max(max_k, 1);
      q_shape = {tq, c.heads, c.head_dim};
      k_shape = {tk, c.heads_kv, c.head_dim};
      lse_shape = {c.heads, tq};
    } else {
      q_shape = {c.batch, c.seqlen_q, c.heads, c.head_dim};
      k_shape = {c.batch, c.seqlen_k, c.heads_kv, c.head_dim};
      lse_shape = {c.batch, c.heads, c.seqlen_q};
    }
  }

  // Q, K and V of a case in `dtype`, drawn from rng in the order every test draws them (dense
  // rows; test_attention_emulated draws into padded ones itself).
  void draw_qkv(DType dtype, std::mt19937_64& rng, ref::HostTensor& q, ref::HostTensor& k, ref::HostTensor& v) const {
    q.reset(dtype, q_shape);
    k.reset(dtype, k_shape);
    v.reset(dtype, k_shape);
    q.fill_normal(rng);
    k.fill_normal(rng);
    v.fill_normal(rng);
  }
};

class AttnProblem {
 public:
  explicit AttnProblem(const AttnCase& c) : c_(c) {
    std::mt19937_64 rng(c.seed);
    AttnLayout layout(c);
    cu_q = std::move(layout.cu_q);
    cu_k = std::move(layout.cu_k);
    q_shape = layout.q_shape, k_shape = layout.k_shape, lse_shape = layout.lse_shape;
    max_q = layout.max_q, max_k = layout.max_k;
    layout.draw_qkv(c.dtype, rng, q, k, v);
    if (c.sinks) {
      sinks.reset(DType::kFloat32, {c.heads});
      sinks.fill_normal(rng);
    }
    dq_ = std::make_unique<DeviceTensor>(q);
    dk_ = std::make_unique<DeviceTensor>(k);
    dv_ = std::make_unique<DeviceTensor>(v);
    dq_->upload(q);
    dk_->upload(k);
    dv_->upload(v);
    if (c.sinks) {
      dsinks_ = std::make_unique<DeviceTensor>(sinks);
      dsinks_->upload(sinks);
    }
    if (c.varlen()) {
      dcu_q_ = std::make_unique<DeviceTensor>(cu_q);
      dcu_k_ = std::make_unique<DeviceTensor>(cu_k);
      dcu_q_->upload(cu_q);
      dcu_k_->upload(cu_k);
    }
    out_host.reset(c.dtype, q_shape);
    lse_host.reset(DType::kFloat32, lse_shape);
    dout_ = std::make_unique<DeviceTensor>(out_host);
    dlse_ = std::make_unique<DeviceTensor>(lse_host);
  }

  // Params of the GPU forward, outputs poisoned.
  AttentionForwardParams forward_params(Backend backend) {
    dout_->poison();
    dlse_->poison();
    AttentionForwardParams p;
    p.q = *dq_;
    p.k = *dk_;
    p.v = *dv_;
    p.out = *dout_;
    p.lse = *dlse_;
    fill_common(p);
    p.backend = backend;
    return p;
  }

  // The oracle's outputs: exact (fp64) and in the input dtype.
  void run_oracle() {
    out_ref.reset(DType::kFloat64, q_shape);
    out_lowp.reset(DType::kFloat64, q_shape);
    lse_ref.reset(DType::kFloat64, lse_shape);
    lse_lowp.reset(DType::kFloat64, lse_shape);
    AttentionForwardParams p;
    p.q = q;
    p.k = k;
    p.v = v;
    fill_common_host(p);
    p.out = out_ref;
    p.lse = lse_ref;
    ASSERT_TRUE(ref::attention_forward(p).ok());
    p.out = out_lowp;
    p.lse = lse_lowp;
    ASSERT_TRUE(ref::attention_forward(p, {true}).ok());
  }

  // Downloads the GPU outputs and checks them against the oracle.
  void check_forward() {
    dout_->download(out_host);
    dlse_->download(lse_host);
    // One ulp of the output dtype allowed per element, as for the gradients (compare's allow_ulp):
    // test_block_sparse's random forward cases met out 0.0205 against 2 x 0.00945 once (session 25,
    // at a reference of 3.661, where a bf16 ulp is 0.0156), the kernel's rounding and the
    // low-precision run's falling on opposite sides of a boundary.
    ErrorReport ro = compare(out_host, out_ref, &out_lowp, true);
    EXPECT_TRUE(within_tolerance(ro, "out")) << c_.name();
    ErrorReport rl = compare(lse_host, lse_ref, &lse_lowp);
    // The LSE is fp32 in every implementation: judge it by a relative fp32-level tolerance.
    rl.lowp_err = std::max(rl.lowp_err, 1e-4);
    EXPECT_TRUE(within_tolerance(rl, "lse")) << c_.name();
  }

  // Backward: random dout, the GPU forward's out and lse as inputs, outputs poisoned.
  AttentionBackwardParams backward_params(Backend backend, bool deterministic) {
    if (!dgrad_out_) {
      std::mt19937_64 rng(c_.seed + 7);
      dout_host.reset(c_.dtype, q_shape);
      dout_host.fill_normal(rng);
      dgrad_out_ = std::make_unique<DeviceTensor>(dout_host);
      dgrad_out_->upload(dout_host);
      dq_host.reset(c_.dtype, q_shape);
      dk_host.reset(c_.dtype, k_shape);
      dv_host.reset(c_.dtype, k_shape);
      ddq_ = std::make_unique<DeviceTensor>(dq_host);
      ddk_ = std::make_unique<DeviceTensor>(dk_host);
      ddv_ = std::make_unique<DeviceTensor>(dv_host);
      if (c_.sinks) {
        dsinks_host.reset(DType::kFloat32, {c_.heads});
        ddsinks_ = std::make_unique<DeviceTensor>(dsinks_host);
      }
    }
    ddq_->poison();
    ddk_->poison();
    ddv_->poison();
    AttentionBackwardParams p;
    p.q = *dq_;
    p.k = *dk_;
    p.v = *dv_;
    p.out = *dout_;
    p.lse = *dlse_;
    p.dout = *dgrad_out_;
    p.dq = *ddq_;
    p.dk = *ddk_;
    p.dv = *ddv_;
    if (ddsinks_) {
      ddsinks_->poison();
      p.dsinks = *ddsinks_;
    }
    fill_common(p);
    p.deterministic = deterministic;
    p.backend = backend;
    return p;
  }

  // Hands the backward `p` (complete: its size depends on the mask, block mask and mode) a workspace
  // of its size filled with 0xFF bytes (NaN floats), so a kernel that reads an accumulator it never
  // zeroed or wrote shows (the call zeroes what it accumulates into).
  void poison_workspace(AttentionBackwardParams& p) {
    std::size_t bytes = 0;
    const Status s = attention_backward_workspace_size(p, &bytes);
    if (!s.ok() || bytes == 0) return;  // the call itself reports it
    if (bytes > workspace_bytes_) {
      void* ws = nullptr;
      ASSERT_EQ(cudaMalloc(&ws, bytes), cudaSuccess) << "backward workspace, " << bytes << " bytes";
      workspace_.reset(ws);
      workspace_bytes_ = bytes;
    }
    ASSERT_EQ(cudaMemset(workspace_.get(), 0xFF, bytes), cudaSuccess);
    p.workspace = workspace_.get();
    p.workspace_bytes = bytes;
  }

  // The GPU forward's stored O (waits for the forward, downloads it into out_host): the input the
  // backward kernels read for D_i = dO_i . O_i, so the run in the input dtype should read it too.
  // The oracle's own O in the input dtype can differ from it by an ulp here and there; with one
  // query row nothing averages that out (session 27's d64 fuzz case: dq and dk 1-7 % past 2x).
  const ref::HostTensor& stored_out() {
    const cudaError_t e = cudaDeviceSynchronize();
    EXPECT_EQ(e, cudaSuccess) << "the forward before the backward's oracle: " << cudaGetErrorString(e);
    dout_->download(out_host);
    return out_host;
  }

  // block_mask: a block-sparse mask's CPU views (the oracle composes it with the dense mask), or
  // null. lowp_out: the O that the run in the input dtype reads for D_i = dO_i . O_i, the forward
  // kernel's stored O (stored_out()), as the backward kernels read it. (Until session 6 it was
  // handed a zero O: D_i = 0 made its dq and dk far from the exact ones, a baseline loose enough to
  // pass a kernel writing dq = 0; until session 28 it recomputed O itself, an ulp off the kernel's.)
  void run_backward_oracle(const BlockMask* block_mask, const ref::HostTensor& lowp_out) {
    auto grads = [&](ref::HostTensor& dq, ref::HostTensor& dk, ref::HostTensor& dv, ref::HostTensor& ds, bool emulate) {
      dq.reset(DType::kFloat64, q_shape);
      dk.reset(DType::kFloat64, k_shape);
      dv.reset(DType::kFloat64, k_shape);
      ref::HostTensor lse(DType::kFloat64, lse_shape);
      AttentionBackwardParams p;
      p.q = q;
      p.k = k;
      p.v = v;
      if (emulate) p.out = lowp_out.view();
      p.lse = lse;
      p.dout = dout_host;
      p.dq = dq;
      p.dk = dk;
      p.dv = dv;
      fill_common_host(p);
      p.block_mask = block_mask;
      if (c_.sinks) {
        ds.reset(DType::kFloat64, {c_.heads});
        p.dsinks = ds;
      }
      ASSERT_TRUE(ref::attention_backward(p, {emulate}).ok());
    };
    grads(dq_ref, dk_ref, dv_ref, dsinks_ref, false);
    grads(dq_lowp, dk_lowp, dv_lowp, dsinks_lowp, true);
  }

  void download_grads() {
    ddq_->download(dq_host);
    ddk_->download(dk_host);
    ddv_->download(dv_host);
    if (ddsinks_) ddsinks_->download(dsinks_host);
  }

  void check_backward(double k = 2.0) {
    download_grads();
    // The low-precision baseline includes bf16 rounding of the outputs; atol covers the fp32
    // accumulation order of long sums; each element may also differ by one ulp of its own rounding
    // (compare's allow_ulp). FlashAttention's own gradient atol is looser: twice the dtype's rounding
    // at max|grad| + 0.3, for every element.
    EXPECT_TRUE(within_tolerance(compare(dq_host, dq_ref, &dq_lowp, true), "dq", k, 1e-3)) << c_.name();
    EXPECT_TRUE(within_tolerance(compare(dk_host, dk_ref, &dk_lowp, true), "dk", k, 1e-3)) << c_.name();
    EXPECT_TRUE(within_tolerance(compare(dv_host, dv_ref, &dv_lowp, true), "dv", k, 1e-3)) << c_.name();
    if (c_.sinks) check_dsinks(k);
  }

  // dsinks_h = -sum over the head's rows of p_sink D_i, D_i = dO_i . O_i: a long sum that
  // inherits the rounding of the stored O (the GPU forward's), which the oracle's input-dtype run
  // does not share (it reads its own O), so the two can differ several fold by luck.
  //  1. The kernel against the same sum in fp64 from the same inputs (the GPU's O and LSE): only
  //     fp32 accumulation apart, so a missing or misindexed row shows.
  //  2. The kernel against the exact gradient, the baseline being the larger of the oracle's
  //     input-dtype error and the error that the same-input sum itself carries.
  void check_dsinks(double k) {
    dout_->download(out_host);  // the backward's inputs: the GPU forward's O and LSE
    dlse_->download(lse_host);
    ref::HostTensor same(DType::kFloat64, {c_.heads});
    double magnitude = 0;  // the largest sum of |terms| over the heads
    const int64_t rows = q_shape.size() == 3 ? q_shape[0] : q_shape[0] * q_shape[1];
    const int d = c_.head_dim, seqlen = c_.varlen() ? 0 : c_.seqlen_q;
    for (int h = 0; h < c_.heads; ++h) {
      double acc = 0, mag = 0;
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t at = c_.varlen() ? h * rows + r : ((r / seqlen) * c_.heads + h) * seqlen + r % seqlen;
        const double lse = lse_host.get(at);
        if (lse == INFINITY) continue;
        const int64_t row = (r * c_.heads + h) * d;
        double dot = 0;
        for (int e = 0; e < d; ++e) dot += dout_host.get(row + e) * out_host.get(row + e);
        const double term = std::exp(sinks.get(h) - lse) * dot;
        acc -= term;
        mag += std::abs(term);
      }
      same.set(h, acc);
      magnitude = std::max(magnitude, mag);
    }
    ErrorReport own = compare(dsinks_host, same, nullptr);
    own.lowp_err = 1e-5 * magnitude;
    EXPECT_TRUE(within_tolerance(own, "dsinks (same inputs, fp64)", 2.0, 1e-6)) << c_.name();

    ErrorReport r = compare(dsinks_host, dsinks_ref, &dsinks_lowp);
    const ErrorReport inherited = compare(same, dsinks_ref, nullptr);
    double largest = 0;
    for (int64_t i = 0; i < dsinks_ref.numel(); ++i) largest = std::max(largest, std::abs(dsinks_ref.get(i)));
    const double unit = c_.dtype == DType::kBFloat16 ? 0x1p-7 : 0x1p-10;
    r.lowp_err = std::max({r.lowp_err, inherited.max_err, 1e-3 * (1 + largest), unit * largest});
    EXPECT_TRUE(within_tolerance(r, "dsinks", k, 1e-3)) << c_.name();
  }

  const AttnCase& spec() const { return c_; }
  ref::HostTensor dout_host, dq_host, dk_host, dv_host, dsinks_host;
  ref::HostTensor dq_ref, dk_ref, dv_ref, dsinks_ref, dq_lowp, dk_lowp, dv_lowp, dsinks_lowp;

  ref::HostTensor q, k, v, sinks, cu_q, cu_k;
  ref::HostTensor out_host, lse_host, out_ref, out_lowp, lse_ref, lse_lowp;
  std::vector<int64_t> q_shape, k_shape, lse_shape;
  int max_q = 0, max_k = 0;

 private:
  template <typename P>
  void fill_common(P& p) {
    p.mask = c_.mask;
    p.softcap = c_.softcap;
    if (dsinks_) p.sinks = *dsinks_;
    if (c_.varlen()) {
      p.cu_seqlens_q = *dcu_q_;
      p.cu_seqlens_k = *dcu_k_;
      p.max_seqlen_q = max_q;
      p.max_seqlen_k = max_k;
    }
  }
  template <typename P>
  void fill_common_host(P& p) {
    p.mask = c_.mask;
    p.softcap = c_.softcap;
    if (c_.sinks) p.sinks = sinks;
    if (c_.varlen()) {
      p.cu_seqlens_q = cu_q;
      p.cu_seqlens_k = cu_k;
      p.max_seqlen_q = max_q;
      p.max_seqlen_k = max_k;
    }
  }

  AttnCase c_;
  std::unique_ptr<DeviceTensor> dq_, dk_, dv_, dsinks_, dcu_q_, dcu_k_, dout_, dlse_;
  std::unique_ptr<DeviceTensor> dgrad_out_, ddq_, ddk_, ddv_, ddsinks_;
  struct CudaFree {
    void operator()(void* p) const { cudaFree(p); }
  };
  std::unique_ptr<void, CudaFree> workspace_;  // poison_workspace's
  std::size_t workspace_bytes_ = 0;
};

// The mask kinds the sweeps cycle through: none, causal, a two-sided window, causal + left window.
inline const MaskParams kSweepMasks[] = {MaskParams{}, MaskParams{true, -1, -1}, MaskParams{false, 100, 20},
                                         MaskParams{true, 64, -1}};

// Case li in [0, kBackwardSweepCases) of the backward sweep at head dim d: lengths round the block
// sizes both ways, GQA ratios 1/4/8 and the masks in turn, bf16/fp16 alternating.
inline constexpr int kBackwardSweepCases = 6;
inline AttnCase backward_sweep_case(int d, int li, uint64_t seed) {
  const std::pair<int, int> lens[kBackwardSweepCases] = {{1, 1}, {17, 17}, {127, 129}, {129, 127}, {300, 1000}, {1000, 300}};
  const int ratios[] = {1, 4, 8};
  AttnCase c;
  c.head_dim = d;
  c.seqlen_q = lens[li].first;
  c.seqlen_k = lens[li].second;
  c.heads = ratios[(li + d / 16) % 3];
  c.heads_kv = 1;
  c.batch = 2;
  c.mask = kSweepMasks[(li + d / 32) % 4];
  c.dtype = (li % 2) ? DType::kFloat16 : DType::kBFloat16;
  c.seed = seed;
  return c;
}

// A d128 case of 200 queries and 333 keys with mask m and `ratio` q heads per kv head.
inline AttnCase mask_ratio_case(const MaskParams& m, int ratio, uint64_t seed) {
  AttnCase c;
  c.head_dim = 128;
  c.seqlen_q = 200;
  c.seqlen_k = 333;
  c.heads = 4;
  c.heads_kv = 4 / ratio;
  c.mask = m;
  c.seed = seed;
  return c;
}

// Six sequences with empty and one-token ones on either side, attention sinks, 4 q heads.
inline AttnCase varlen_sinks_case(int d, int heads_kv, const MaskParams& m, uint64_t seed) {
  AttnCase c;
  c.head_dim = d;
  c.heads = 4;
  c.heads_kv = heads_kv;
  c.varlen_q = {0, 1, 17, 130, 1, 257};
  c.varlen_k = {5, 1, 40, 129, 0, 300};
  c.batch = 6;
  c.mask = m;
  c.sinks = true;
  c.seed = seed;
  return c;
}

// Runs the deterministic backward `runs` times on one problem (forward on `backend` too) and
// expects dQ, dK and dV bitwise identical to the first run's.
inline void expect_bitwise_reproducible(const AttnCase& c, Backend backend, int runs) {
  SCOPED_TRACE(c.name() + " deterministic, bitwise");
  AttnProblem prob(c);
  FLARE_ASSERT_OK_OR_UNBUILT(attention_forward(prob.forward_params(backend)));
  ref::HostTensor first_dq, first_dk, first_dv;
  for (int r = 0; r < runs; ++r) {
    AttentionBackwardParams b = prob.backward_params(backend, true);
    prob.poison_workspace(b);
    Status s = attention_backward(b);
    ASSERT_TRUE(s.ok()) << s.message();
    FLARE_CUDA_OK(cudaDeviceSynchronize());
    prob.download_grads();
    if (r == 0) {
      first_dq = prob.dq_host;
      first_dk = prob.dk_host;
      first_dv = prob.dv_host;
      continue;
    }
    ASSERT_EQ(std::memcmp(first_dq.data(), prob.dq_host.data(), first_dq.nbytes()), 0) << "dq differs in run " << r;
    ASSERT_EQ(std::memcmp(first_dk.data(), prob.dk_host.data(), first_dk.nbytes()), 0) << "dk differs in run " << r;
    ASSERT_EQ(std::memcmp(first_dv.data(), prob.dv_host.data(), first_dv.nbytes()), 0) << "dv differs in run " << r;
  }
}

}  // namespace flare::test
