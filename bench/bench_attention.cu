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
#include "flare/attention.h"

namespace flare::bench {
namespace {

constexpr int kTotalTokens = 16384;
constexpr int kHidden = 2048;
constexpr double kMaxRelError = 2e-2;  // relative L2 error vs the fp32 GPU kernel (bf16 output)

__global__ void fill_normal_bf16(__nv_bfloat16* x, int64_t n, uint64_t seed) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    uint64_t h = (i + 1) * 0x9E3779B97F4A7C15ull ^ seed;
    h ^= h >> 31;
    h *= 0xBF58476D1CE4E5B9ull;
    h ^= h >> 29;
    float u1 = ((h & 0xffffff) + 1) / 16777217.f, u2 = ((h >> 24) & 0xffffff) / 16777216.f;
    x[i] = __float2bfloat16(sqrtf(-2.f * logf(u1)) * cospif(2.f * u2));
  }
}

// Relative L2 error and max abs error of a against b, on the device.
__global__ void error_sums(const __nv_bfloat16* a, const __nv_bfloat16* b, int64_t n, double* sums) {
  double num = 0, den = 0, mx = 0;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    double x = __bfloat162float(a[i]), y = __bfloat162float(b[i]);
    num += (x - y) * (x - y);
    den += y * y;
    mx = fmax(mx, isnan(x) ? INFINITY : fabs(x - y));
  }
  atomicAdd(&sums[0], num);
  atomicAdd(&sums[1], den);
  unsigned long long* m = reinterpret_cast<unsigned long long*>(&sums[2]);
  atomicMax(m, __double_as_longlong(mx));  // non-negative doubles order like their bits
}

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
  void* workspace;
  size_t workspace_bytes;
  float* lse;
  double* sums;
  int64_t n;
};

AttentionForwardParams make_params(const Case& c, const Buffers& b, Backend backend, void* out) {
  auto view = [&](void* p) {
    return TensorView::contiguous(p, DType::kBFloat16, {c.batch(), c.seqlen, c.heads(), c.head_dim});
  };
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
  b.workspace_bytes = 0;
  FLARE_BENCH_CHECK(cudaMalloc(&b.lse, int64_t{kTotalTokens} * kHidden / 64 * 4));
  FLARE_BENCH_CHECK(cudaMalloc(&b.sums, 3 * sizeof(double)));
  fill_normal_bf16<<<1024, 256, 0, stream>>>(b.q, b.n, 1);
  fill_normal_bf16<<<1024, 256, 0, stream>>>(b.k, b.n, 2);
  fill_normal_bf16<<<1024, 256, 0, stream>>>(b.v, b.n, 3);
  fill_normal_bf16<<<1024, 256, 0, stream>>>(b.dout, b.n, 4);

  Table table;
  std::vector<Record> records;
  const bool forward_only = std::getenv("FLARE_BENCH_FORWARD_ONLY") != nullptr;
  bool all_ok = true;
  for (const Case& c : cases) {
    if (!args.selected(c.name())) continue;
    // The reference once per case, then the checked and timed backend.
    Status s = attention_forward(make_params(c, b, Backend::kReference, b.ref));
    if (!s.ok()) {
      std::printf("%s: reference failed: %s\n", c.name().c_str(), s.message().c_str());
      return 1;
    }
    AttentionForwardParams p = make_params(c, b, Backend::kPortable, b.out);
    p.stream = stream;
    FLARE_BENCH_CHECK(cudaMemsetAsync(b.out, 0xFF, b.n * 2, stream));
    Status run_status = attention_forward(p);
    if (!run_status.ok()) {
      std::printf("%s: %s\n", c.name().c_str(), run_status.message().c_str());
      all_ok = false;
      continue;
    }
    FLARE_BENCH_CHECK(cudaMemsetAsync(b.sums, 0, 3 * sizeof(double), stream));
    error_sums<<<512, 256, 0, stream>>>(b.out, b.ref, b.n, b.sums);
    double sums[3];
    FLARE_BENCH_CHECK(cudaMemcpyAsync(sums, b.sums, sizeof sums, cudaMemcpyDeviceToHost, stream));
    FLARE_BENCH_CHECK(cudaStreamSynchronize(stream));
    const double rel = std::sqrt(sums[0] / sums[1]);
    const bool ok = rel < kMaxRelError && std::isfinite(sums[2]);
    all_ok &= ok;

    Timing t = time_kernel([&](cudaStream_t st) {
      p.stream = st;
      if (!attention_forward(p).ok()) std::abort();
    }, args.timing({.warmup = 5, .repeats = 30}), stream);
    const double flops = attention_fwd_flops(c.batch(), c.heads(), c.seqlen, c.seqlen, c.head_dim, c.causal);
    const double tf = tflops(flops, t.median_ms);
    table.add_row({{"case", c.name()}, {"backend", "portable"}, {"ms", Table::Cell(t.median_ms, 3)},
                   {"spread%", Table::Cell(100 * (t.p90_ms - t.p10_ms) / t.median_ms, 1)},
                   {"TFLOP/s", Table::Cell(tf, 1)}, {"of GEMM", Table::Cell(tf / gemm_ceiling, 2)},
                   {"rel err", Table::Cell(rel, 5)}, {"max abs err", Table::Cell(sums[2], 4)},
                   {"check", ok ? "ok" : "FAIL"}});
    // Backward, ordinary and deterministic, from this forward's out and lse.
    double bwd_ms[2] = {0, 0};
    for (int det = 0; det < 2 && !forward_only; ++det) {
      AttentionBackwardParams bp;
      bp.q = p.q;
      bp.k = p.k;
      bp.v = p.v;
      bp.out = p.out;
      bp.lse = p.lse;
      bp.dout = TensorView::contiguous(b.dout, DType::kBFloat16, {c.batch(), c.seqlen, c.heads(), c.head_dim});
      bp.dq = TensorView::contiguous(b.dq, DType::kBFloat16, {c.batch(), c.seqlen, c.heads(), c.head_dim});
      bp.dk = TensorView::contiguous(b.dk, DType::kBFloat16, {c.batch(), c.seqlen, c.heads(), c.head_dim});
      bp.dv = TensorView::contiguous(b.dv, DType::kBFloat16, {c.batch(), c.seqlen, c.heads(), c.head_dim});
      bp.mask = p.mask;
      bp.deterministic = det == 1;
      bp.stream = stream;
      size_t need = 0;
      Status ws = attention_backward_workspace_size(bp, &need);
      if (!ws.ok()) {
        std::printf("%s backward: %s\n", c.name().c_str(), ws.message().c_str());
        all_ok = false;
        break;
      }
      if (need > b.workspace_bytes) {
        if (b.workspace) FLARE_BENCH_CHECK(cudaFree(b.workspace));
        FLARE_BENCH_CHECK(cudaMalloc(&b.workspace, need));
        b.workspace_bytes = need;
      }
      bp.workspace = b.workspace;
      bp.workspace_bytes = b.workspace_bytes;
      Status bs = attention_backward(bp);
      if (!bs.ok()) {
        std::printf("%s backward: %s\n", c.name().c_str(), bs.message().c_str());
        all_ok = false;
        break;
      }
      Timing tb = time_kernel([&](cudaStream_t st) {
        bp.stream = st;
        if (!attention_backward(bp).ok()) std::abort();
      }, args.timing({.warmup = 3, .repeats = 20}), stream);
      bwd_ms[det] = tb.median_ms;
    }
    const double bwd_tf = bwd_ms[0] > 0 ? tflops(2.5 * flops, bwd_ms[0]) : 0;
    const double det_tf = bwd_ms[1] > 0 ? tflops(2.5 * flops, bwd_ms[1]) : 0;
    table.add_row({{"case", c.name()}, {"bwd ms", Table::Cell(bwd_ms[0], 3)}, {"bwd TFLOP/s", Table::Cell(bwd_tf, 1)},
                   {"det ms", Table::Cell(bwd_ms[1], 3)}, {"det TFLOP/s", Table::Cell(det_tf, 1)},
                   {"det/ord", Table::Cell(bwd_ms[1] > 0 ? bwd_ms[0] / bwd_ms[1] : 0, 2)}});
    records.push_back({c.name() + " portable",
                       {{"median_ms", t.median_ms}, {"tflops", tf}, {"fraction_of_gemm", tf / gemm_ceiling},
                        {"rel_err", rel}, {"max_abs_err", sums[2]}, {"bwd_ms", bwd_ms[0]}, {"bwd_tflops", bwd_tf},
                        {"bwd_det_ms", bwd_ms[1]}, {"bwd_det_tflops", det_tf}},
                       {{"backend", "portable"}, {"dtype", "bf16"}, {"head_dim", std::to_string(c.head_dim)},
                        {"seqlen", std::to_string(c.seqlen)}, {"causal", c.causal ? "1" : "0"}}});
  }
  table.print();
  if (!args.json_path.empty()) write_json(args.json_path, records);
  std::printf(all_ok ? "all checks passed\n" : "SOME CHECKS FAILED\n");
  return all_ok ? 0 : 1;
}

}  // namespace
}  // namespace flare::bench

int main(int argc, char** argv) { return flare::bench::run(argc, argv); }
