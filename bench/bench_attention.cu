// Attention forward benchmark and check: the default configuration of issue 3/4 (bf16, 16k
// tokens, hidden 2048: heads = 2048 / head_dim, batch = 16384 / seqlen), for each backend, with
// the error against the simple fp32 GPU kernel. Prints time, TFLOP/s, the fraction of the
// measured bf16 GEMM ceiling and the error; exits non-zero when a check fails or no GPU exists.
#include <cuda_bf16.h>

#include <cmath>
#include <cstdlib>
#include <cstdio>
#include <string>
#include <vector>

#include "bench/common/bench_common.h"
#include "src/attention/hopper/fwd_timeline.h"  // FLARE_HOPPER_FWD_TIMELINE builds
#include "flare/attention.h"

namespace flare::bench {
namespace {

constexpr int kTotalTokens = 16384;
constexpr int kHidden = 2048;
constexpr double kMaxRelError = 2e-2;  // relative L2 error vs the fp32 GPU kernel (bf16 output)

struct Case {
  int seqlen, head_dim;
  bool causal;
  int batch() const { return kTotalTokens / seqlen; }
  int heads() const { return kHidden / head_dim; }
  std::string name() const {
    return "fwd d" + std::to_string(head_dim) + " s" + std::to_string(seqlen) + (causal ? " causal" : "");
  }
};

struct Buffers {
  __nv_bfloat16 *q, *k, *v, *out, *ref, *dout, *dq, *dk, *dv;
  GrowingDeviceBuffer workspace, fwd_workspace;
  float* lse;
  int64_t n;
};

// A [batch, seqlen, heads, head_dim] bf16 tensor of case c (q, k, v, out and their gradients).
TensorView token_view(const Case& c, void* p) {
  return TensorView::contiguous(p, DType::kBFloat16, {c.batch(), c.seqlen, c.heads(), c.head_dim});
}

AttentionForwardParams make_params(const Case& c, const Buffers& b, Backend backend, void* out) {
  auto view = [&](void* p) { return token_view(c, p); };
  AttentionForwardParams p;
  p.q = view(b.q);
  p.k = view(b.k);
  p.v = view(b.v);
  p.out = view(out);
  p.lse = TensorView::contiguous(b.lse, DType::kFloat32, {c.batch(), c.heads(), c.seqlen});
  p.mask.causal = c.causal;
  p.backend = backend;
  return p;
}

int run(int argc, char** argv) {
  Args args = parse_args_or_exit(argc, argv);
  require_cuda_device_or_exit();
  cudaStream_t stream;
  FLARE_BENCH_CHECK(cudaStreamCreate(&stream));
  const double gemm_ceiling = measure_gemm_tflops(stream);
  std::printf("measured bf16 GEMM ceiling: %.0f TFLOP/s\n", gemm_ceiling);

  std::vector<Case> cases;
  const std::vector<int> seqlens = args.quick ? std::vector<int>{1024, 4096} : std::vector<int>{1024, 2048, 4096, 8192, 16384};
  for (int d : {64, 128, 256})
    for (bool causal : {false, true})
      for (int s : seqlens) cases.push_back({s, d, causal});

  Buffers b{};
  b.n = int64_t{kTotalTokens} * kHidden;
  for (__nv_bfloat16** p : {&b.q, &b.k, &b.v, &b.out, &b.ref, &b.dout, &b.dq, &b.dk, &b.dv})
    FLARE_BENCH_CHECK(cudaMalloc(p, b.n * 2));
  FLARE_BENCH_CHECK(cudaMalloc(&b.lse, int64_t{kTotalTokens} * kHidden / 64 * 4));
  fill_normal_bf16(b.q, b.n, 1, stream);
  fill_normal_bf16(b.k, b.n, 2, stream);
  fill_normal_bf16(b.v, b.n, 3, stream);
  fill_normal_bf16(b.dout, b.n, 4, stream);

  Table table;
  std::vector<Record> records;
  bool all_ok = true;
  // A portable kernel that does not run fails the checks, unless a reduced build (FLARE_HEAD_DIMS)
  // lacks the case's head dim; the Hopper kernel may be absent on this device or in this build.
  auto failed_here = [](Backend backend, const Status& s) {
    return backend == Backend::kPortable && !not_in_this_build(s);
  };
  for (const Case& c : cases) {
    if (!args.selected(c.name())) continue;
    // The reference once per case, then the checked and timed backend.
    Status s = attention_forward(make_params(c, b, Backend::kReference, b.ref));
    if (!s.ok()) {
      std::printf("%s: reference failed: %s\n", c.name().c_str(), s.message().c_str());
      return 1;
    }
    // Every forward backend this build and device have, each checked against the reference.
    // FLARE_BENCH_SKIP_PORTABLE (set): the portable kernels are not timed (their forward still runs
    // once: the backward starts from its output), as in bench_block_sparse.
    static const bool skip_portable = std::getenv("FLARE_BENCH_SKIP_PORTABLE") != nullptr;
    AttentionForwardParams p;
    for (Backend backend : {Backend::kPortable, Backend::kHopper}) {
      const char* bname = backend == Backend::kHopper ? "hopper" : "portable";
      AttentionForwardParams fp = make_params(c, b, backend, b.out);
      fp.stream = stream;
      std::size_t fwd_need = 0;
      if (attention_forward_workspace_size(fp, &fwd_need).ok() && fwd_need > 0) {
        fp.workspace = b.fwd_workspace.reserve(fwd_need);
        fp.workspace_bytes = b.fwd_workspace.bytes;
      }
      FLARE_BENCH_CHECK(cudaMemsetAsync(b.out, 0xFF, b.n * 2, stream));
      Status run_status = attention_forward(fp);
      if (!run_status.ok()) {
        std::printf("%s %s: %s\n", c.name().c_str(), bname, run_status.message().c_str());
        if (failed_here(backend, run_status)) all_ok = false;
        continue;
      }
      if (skip_portable && backend == Backend::kPortable) {
        p = fp;
        continue;
      }
      const ErrorStats err = compare_bf16(b.out, b.ref, b.n, stream);
      const double rel = err.rel_l2;
      const bool ok = rel < kMaxRelError && std::isfinite(err.max_abs);
      all_ok &= ok;
      Timing t = time_kernel([&](cudaStream_t st) {
        fp.stream = st;
        if (!attention_forward(fp).ok()) std::abort();
      }, args.timing({.warmup = 5, .repeats = 30}), stream);
      const double flops = attention_fwd_flops(c.batch(), c.heads(), c.seqlen, c.seqlen, c.head_dim, c.causal);
      const double tf = tflops(flops, t.median_ms);
      table.add_row({{"case", c.name()}, {"backend", bname}, {"ms", Table::Cell(t.median_ms, 3)},
                     {"spread%", Table::Cell(100 * (t.p90_ms - t.p10_ms) / t.median_ms, 1)},
                     {"TFLOP/s", Table::Cell(tf, 1)}, {"of GEMM", Table::Cell(tf / gemm_ceiling, 2)},
                     {"rel err", Table::Cell(rel, 5)}, {"max abs err", Table::Cell(err.max_abs, 4)},
                     {"check", ok ? "ok" : "FAIL"}});
      records.push_back({c.name() + " " + bname,
                         {{"median_ms", t.median_ms}, {"tflops", tf}, {"fraction_of_gemm", tf / gemm_ceiling},
                          {"rel_err", rel}, {"max_abs_err", err.max_abs}},
                         {{"backend", bname}, {"dtype", "bf16"}, {"head_dim", std::to_string(c.head_dim)},
                          {"seqlen", std::to_string(c.seqlen)}, {"causal", c.causal ? "1" : "0"}}});
      if (backend == Backend::kPortable) p = fp;
#if FLARE_HOPPER_FWD_TIMELINE
      if (backend == Backend::kHopper) {  // one more launch, stamped (src/attention/hopper/fwd_timeline.h)
        flare::hopper::fwd_timeline_reset(stream);
        if (!attention_forward(fp).ok()) std::abort();
        std::printf("%s hopper %s", c.name().c_str(), flare::hopper::fwd_timeline_summary().c_str());
      }
#endif
    }
    if (p.q.data == nullptr) continue;
    if (args.forward_only) continue;
    const double flops = attention_fwd_flops(c.batch(), c.heads(), c.seqlen, c.seqlen, c.head_dim, c.causal);
    // Backward, ordinary and deterministic, on every backend this build and device have, from the
    // portable forward's out and lse (run again first: the Hopper forward wrote out last).
    if (!attention_forward(p).ok()) std::abort();
    AttentionBackwardParams grads;
    grads.q = p.q;
    grads.k = p.k;
    grads.v = p.v;
    grads.out = p.out;
    grads.lse = p.lse;
    grads.dout = token_view(c, b.dout);
    grads.dq = token_view(c, b.dq);
    grads.dk = token_view(c, b.dk);
    grads.dv = token_view(c, b.dv);
    grads.mask = p.mask;
    grads.stream = stream;
    for (Backend backend : {Backend::kPortable, Backend::kHopper}) {
      if (skip_portable && backend == Backend::kPortable) continue;
      const char* bname = backend == Backend::kHopper ? "hopper" : "portable";
      double bwd_ms[2] = {0, 0};
      for (int det = 0; det < 2; ++det) {
        AttentionBackwardParams bp = grads;
        bp.deterministic = det == 1;
        bp.backend = backend;
        size_t need = 0;
        Status ws = attention_backward_workspace_size(bp, &need);
        if (!ws.ok()) {
          std::printf("%s %s backward: %s\n", c.name().c_str(), bname, ws.message().c_str());
          if (failed_here(backend, ws)) all_ok = false;
          break;
        }
        bp.workspace = b.workspace.reserve(need);
        bp.workspace_bytes = b.workspace.bytes;
        Status bs = attention_backward(bp);
        if (!bs.ok()) {
          std::printf("%s %s backward: %s\n", c.name().c_str(), bname, bs.message().c_str());
          if (failed_here(backend, bs)) all_ok = false;
          break;
        }
        Timing tb = time_kernel([&](cudaStream_t st) {
          bp.stream = st;
          if (!attention_backward(bp).ok()) std::abort();
        }, args.timing({.warmup = 3, .repeats = 20}), stream);
        bwd_ms[det] = tb.median_ms;
      }
      if (bwd_ms[0] <= 0) continue;
      const double bwd_tf = tflops(2.5 * flops, bwd_ms[0]);
      const double det_tf = bwd_ms[1] > 0 ? tflops(2.5 * flops, bwd_ms[1]) : 0;
      table.add_row({{"case", c.name()}, {"backend", std::string(bname) + " bwd"}, {"bwd ms", Table::Cell(bwd_ms[0], 3)},
                     {"bwd TFLOP/s", Table::Cell(bwd_tf, 1)}, {"det ms", Table::Cell(bwd_ms[1], 3)},
                     {"det TFLOP/s", Table::Cell(det_tf, 1)},
                     {"det/ord", Table::Cell(bwd_ms[1] > 0 ? bwd_ms[0] / bwd_ms[1] : 0, 2)}});
      records.push_back({c.name() + " backward " + bname,
                         {{"bwd_ms", bwd_ms[0]}, {"bwd_tflops", bwd_tf}, {"bwd_det_ms", bwd_ms[1]}, {"bwd_det_tflops", det_tf}},
                         {{"backend", bname}, {"dtype", "bf16"}, {"head_dim", std::to_string(c.head_dim)},
                          {"seqlen", std::to_string(c.seqlen)}, {"causal", c.causal ? "1" : "0"}}});
    }
  }
  table.print();
  if (!args.json_path.empty()) write_json(args.json_path, records);
  std::printf(all_ok ? "all checks passed\n" : "SOME CHECKS FAILED\n");
  return all_ok ? 0 : 1;
}

}  // namespace
}  // namespace flare::bench

int main(int argc, char** argv) { return flare::bench::run(argc, argv); }
