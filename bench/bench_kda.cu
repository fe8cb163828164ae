// KDA chunked forward and backward benchmark: bf16, H = HV = 32, K = V = 128, 32k tokens (B x T =
// 32768 for T from 1k to 32k, and a varlen batch of uneven lengths), in the plain mode
// (pre-computed fp32 log-space gate, as FLA's chunk_kda is usually timed) and the layer mode (raw
// gate activated in the kernel, q/k l2norm, beta sigmoid). Prints the forward's time, the
// bandwidth of the tensors it reads and writes once (q, k, v, g, beta, out) and its fraction of
// the measured copy bandwidth, the backward's time (every gradient, from dout and d_final_state)
// and forward + backward, and the training path (a forward that keeps its per-chunk WY form for
// the backward, keep_for_backward, and the backward that reads it); checks that every output and
// dq is finite. FLA's figures (H100): ~4.1 ms
// forward, ~21 ms forward + backward for this size.
#include <cuda_bf16.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <initializer_list>
#include <string>
#include <vector>

#include "bench/common/bench_common.h"
#include "bench/common/kda_inputs.cuh"
#include "flare/kda.h"

namespace flare::bench {
namespace {

constexpr int kTokens = 32768, kHeads = 32, kDim = 128;

struct Case {
  std::string name;
  int batch, seqlen;
  std::vector<int> seqlens;  // varlen (batch 1, seqlen = sum)
  bool layer_mode;
};

__global__ void bf16_to_f32(const __nv_bfloat16* in, float* out, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x)
    out[i] = __bfloat162float(in[i]);
}

__global__ void count_nonfinite(const __nv_bfloat16* x, int64_t n, unsigned long long* bad) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x)
    if (!isfinite(__bfloat162float(x[i]))) atomicAdd(bad, 1ull);
}

// The non-finite elements of `tensors` (n bf16 each), counted in *bad on the device.
unsigned long long count_nonfinite_outputs(std::initializer_list<const __nv_bfloat16*> tensors, int64_t n,
                                           unsigned long long* bad, cudaStream_t stream) {
  FLARE_BENCH_CHECK(cudaMemsetAsync(bad, 0, sizeof(*bad), stream));
  for (const __nv_bfloat16* x : tensors) count_nonfinite<<<1024, 256, 0, stream>>>(x, n, bad);
  unsigned long long nonfinite = 0;
  FLARE_BENCH_CHECK(cudaMemcpyAsync(&nonfinite, bad, sizeof(nonfinite), cudaMemcpyDeviceToHost, stream));
  FLARE_BENCH_CHECK(cudaStreamSynchronize(stream));
  return nonfinite;
}

struct Buffers {
  __nv_bfloat16 *q, *k, *v, *beta, *out;
  float *g, *A_log, *dt_bias, *final_state;
  int* cu_seqlens;
  GrowingDeviceBuffer workspace;
  // backward
  __nv_bfloat16 *dout, *dq, *dk, *dv, *dbeta;
  float *dg, *dA_log, *ddt_bias, *d_final_state;
};

KdaForwardParams make_params(const Case& c, const Buffers& b) {
  const int64_t B = c.batch, T = c.seqlen, H = kHeads, D = kDim;
  const int64_t N = c.seqlens.empty() ? B : static_cast<int64_t>(c.seqlens.size());
  KdaForwardParams p;
  p.q = TensorView::contiguous(b.q, DType::kBFloat16, {B, T, H, D});
  p.k = TensorView::contiguous(b.k, DType::kBFloat16, {B, T, H, D});
  p.v = TensorView::contiguous(b.v, DType::kBFloat16, {B, T, H, D});
  p.g = TensorView::contiguous(b.g, DType::kFloat32, {B, T, H, D});
  p.beta = TensorView::contiguous(b.beta, DType::kBFloat16, {B, T, H});
  p.out = TensorView::contiguous(b.out, DType::kBFloat16, {B, T, H, D});
  p.final_state = TensorView::contiguous(b.final_state, DType::kFloat32, {N, H, D, D});
  for (TensorView* t : {&p.q, &p.k, &p.v, &p.g, &p.beta, &p.out, &p.final_state}) t->device = {DeviceKind::kCUDA, 0};
  if (!c.seqlens.empty()) {
    p.cu_seqlens = TensorView::contiguous(b.cu_seqlens, DType::kInt32, {N + 1}, {DeviceKind::kCUDA, 0});
  }
  if (c.layer_mode) {
    p.options.qk_l2norm = p.options.beta_sigmoid = p.options.gate_in_kernel = true;
    p.A_log = TensorView::contiguous(b.A_log, DType::kFloat32, {H}, {DeviceKind::kCUDA, 0});
    p.dt_bias = TensorView::contiguous(b.dt_bias, DType::kFloat32, {H * D}, {DeviceKind::kCUDA, 0});
  }
  return p;
}

// The backward of the same problem: dout, d_final_state in; every gradient out (in place of the
// forward's out / final_state, which it does not read).
KdaBackwardParams make_backward_params(const KdaForwardParams& f, const Buffers& b) {
  KdaBackwardParams p;
  p.q = f.q, p.k = f.k, p.v = f.v, p.g = f.g, p.beta = f.beta, p.A_log = f.A_log, p.dt_bias = f.dt_bias;
  p.cu_seqlens = f.cu_seqlens, p.options = f.options;
  auto like = [](const TensorView& t, void* data, DType dtype) {
    TensorView v = t;
    v.data = data, v.dtype = dtype;
    return v;
  };
  p.dout = like(f.out, b.dout, DType::kBFloat16);
  p.d_final_state = like(f.final_state, b.d_final_state, DType::kFloat32);
  p.dq = like(f.q, b.dq, DType::kBFloat16), p.dk = like(f.k, b.dk, DType::kBFloat16);
  p.dv = like(f.v, b.dv, DType::kBFloat16);
  p.dg = like(f.g, b.dg, DType::kFloat32), p.dbeta = like(f.beta, b.dbeta, DType::kBFloat16);
  if (f.A_log.defined()) p.dA_log = like(f.A_log, b.dA_log, DType::kFloat32);
  if (f.dt_bias.defined()) p.ddt_bias = like(f.dt_bias, b.ddt_bias, DType::kFloat32);
  return p;
}

int run(int argc, char** argv) {
  const Args args = parse_args_or_exit(argc, argv);
  require_cuda_device_or_exit();
  cudaStream_t stream;
  FLARE_BENCH_CHECK(cudaStreamCreate(&stream));
  const double copy_gbps = measure_copy_bandwidth_gbps(stream);

  std::vector<Case> cases;
  for (bool layer : {false, true}) {
    const std::string mode = layer ? " layer" : "";
    for (int T : {1024, 2048, 4096, 8192, 16384, 32768}) cases.push_back({"B" + std::to_string(kTokens / T) + " T" + std::to_string(T) + mode, kTokens / T, T, {}, layer});
    // varlen: uneven lengths summing to 32k (partial chunks in most sequences)
    cases.push_back({"varlen 12" + mode, 1, kTokens, {8000, 100, 3000, 1, 6000, 4567, 2222, 64, 5000, 1800, 1000, 1014}, layer});
  }

  const int64_t elems = int64_t{kTokens} * kHeads * kDim, rows = int64_t{kTokens} * kHeads;
  Buffers b;
  FLARE_BENCH_CHECK(cudaMalloc(&b.q, elems * 2));
  FLARE_BENCH_CHECK(cudaMalloc(&b.k, elems * 2));
  FLARE_BENCH_CHECK(cudaMalloc(&b.v, elems * 2));
  FLARE_BENCH_CHECK(cudaMalloc(&b.out, elems * 2));
  FLARE_BENCH_CHECK(cudaMalloc(&b.g, elems * 4));
  FLARE_BENCH_CHECK(cudaMalloc(&b.beta, rows * 2));
  FLARE_BENCH_CHECK(cudaMalloc(&b.A_log, kHeads * 4));
  FLARE_BENCH_CHECK(cudaMalloc(&b.dt_bias, kHeads * kDim * 4));
  FLARE_BENCH_CHECK(cudaMalloc(&b.final_state, int64_t{kTokens} * kHeads * kDim * kDim / 64 * 4));  // >= N states
  FLARE_BENCH_CHECK(cudaMalloc(&b.cu_seqlens, 64 * 4));
  for (__nv_bfloat16** x : {&b.dout, &b.dq, &b.dk, &b.dv}) FLARE_BENCH_CHECK(cudaMalloc(x, elems * 2));
  FLARE_BENCH_CHECK(cudaMalloc(&b.dbeta, rows * 2));
  FLARE_BENCH_CHECK(cudaMalloc(&b.dg, elems * 4));
  FLARE_BENCH_CHECK(cudaMalloc(&b.dA_log, kHeads * 4));
  FLARE_BENCH_CHECK(cudaMalloc(&b.ddt_bias, kHeads * kDim * 4));
  FLARE_BENCH_CHECK(cudaMalloc(&b.d_final_state, int64_t{kTokens} * kHeads * kDim * kDim / 64 * 4));
  GrowingDeviceBuffer bwd_workspace;
  unsigned long long* bad;
  FLARE_BENCH_CHECK(cudaMalloc(&bad, sizeof(*bad)));

  Table table;
  std::vector<Record> records;
  int failures = 0;
  for (const Case& c : cases) {
    if (!args.selected(c.name)) continue;
    // fresh inputs per mode
    fill_normal_bf16(b.q, elems, 1, stream);
    fill_normal_bf16(b.k, elems, 2, stream);
    fill_normal_bf16(b.v, elems, 3, stream);
    fill_normal_bf16(b.out, elems, 4, stream);  // scratch for g
    bf16_to_f32<<<1024, 256, 0, stream>>>(b.out, b.g, elems);
    fill_normal_bf16(b.beta, rows, 5, stream);
    fill_normal_bf16(b.dout, elems, 6, stream);
    const int64_t num_states = (c.seqlens.empty() ? c.batch : static_cast<int64_t>(c.seqlens.size())) * kHeads;
    fill_normal_bf16(b.dq, elems, 7, stream);  // scratch for d_final_state
    bf16_to_f32<<<1024, 256, 0, stream>>>(b.dq, b.d_final_state, num_states * kDim * kDim);
    {
      std::vector<float> a_log(kHeads), dt(kHeads * kDim);
      for (int h = 0; h < kHeads; ++h) a_log[h] = std::log(1.f + 15.f * h / kHeads);
      for (int i = 0; i < kHeads * kDim; ++i) dt[i] = -1.f + 0.001f * (i % 997);
      FLARE_BENCH_CHECK(cudaMemcpyAsync(b.A_log, a_log.data(), kHeads * 4, cudaMemcpyHostToDevice, stream));
      FLARE_BENCH_CHECK(cudaMemcpyAsync(b.dt_bias, dt.data(), dt.size() * 4, cudaMemcpyHostToDevice, stream));
    }
    shape_kda_inputs<kDim><<<(rows + 7) / 8, dim3(32, 8), 0, stream>>>(b.k, b.g, b.beta, rows, c.layer_mode, INFINITY);
    if (!c.seqlens.empty()) {
      std::vector<int> cu{0};
      for (int len : c.seqlens) cu.push_back(cu.back() + len);
      FLARE_BENCH_CHECK(cudaMemcpyAsync(b.cu_seqlens, cu.data(), cu.size() * 4, cudaMemcpyHostToDevice, stream));
    }
    FLARE_BENCH_CHECK(cudaStreamSynchronize(stream));

    KdaForwardParams p = make_params(c, b);
    p.stream = stream;
    size_t bytes = 0;
    check_ok(kda_forward_workspace_size(p, &bytes), c.name);
    p.workspace = b.workspace.reserve(bytes);
    p.workspace_bytes = b.workspace.bytes;
    const Timing t = time_op(kda_forward, p, c.name, args.timing(), stream);
    // q, k, v, out bf16, g fp32, beta bf16: each once
    const double io_bytes = elems * (2.0 * 4 + 4.0) + rows * 2.0;
    const double gbps = io_bytes / (t.median_ms * 1e6);
    Record r;
    r.name = "kda_fwd " + c.name;
    r.tags = device_tags();
    r.tags["dtype"] = "bf16";
    r.metrics = {{"median_ms", t.median_ms}, {"gbps_io_once", gbps}, {"fraction_of_copy_bw", gbps / copy_gbps}};
    std::vector<std::pair<std::string, Table::Cell>> row = {{"case", c.name},
                                                            {"ms", Table::Cell(t.median_ms, 3)},
                                                            {"GB/s (io once)", Table::Cell(gbps, 0)},
                                                            {"of copy bw", Table::Cell(gbps / copy_gbps, 2)}};
    if (args.forward_only) {
      const unsigned long long nonfinite = count_nonfinite_outputs({b.out}, elems, bad, stream);
      failures += nonfinite != 0;
      row.push_back({"non-finite", Table::Cell(static_cast<int64_t>(nonfinite))});
      table.add_row(row);
      records.push_back(r);
      continue;
    }

    KdaBackwardParams bp = make_backward_params(p, b);
    check_ok(kda_backward_workspace_size(bp, &bytes), c.name + " backward");
    bp.workspace = bwd_workspace.reserve(bytes);
    bp.workspace_bytes = bwd_workspace.bytes;
    const Timing tb = time_op(kda_backward, bp, c.name + " backward", args.timing(), stream);

    // Training: the forward keeps its per-chunk WY form in the backward's workspace and the
    // backward reads it (its prep skipped). Timed the same way; the backward runs repeatedly from
    // the one kept forward (it leaves that part of the workspace intact).
    KdaForwardParams pk = p;
    pk.keep_for_backward = true;
    size_t kept_bytes = 0;
    check_ok(kda_forward_workspace_size(pk, &kept_bytes), c.name + " kept forward");
    if (kept_bytes != bytes) {
      std::fprintf(stderr, "%s: the kept forward's workspace (%zu) is not the backward's (%zu)\n", c.name.c_str(),
                   kept_bytes, bytes);
      return 1;
    }
    pk.workspace = bwd_workspace.data, pk.workspace_bytes = bwd_workspace.bytes;
    const Timing tk = time_op(kda_forward, pk, c.name + " kept forward", args.timing(), stream);
    KdaBackwardParams bk = bp;
    bk.workspace_from_forward = true;
    const Timing tbk = time_op(kda_backward, bk, c.name + " backward from the forward", args.timing(), stream);

    const unsigned long long nonfinite = count_nonfinite_outputs({b.out, b.dq}, elems, bad, stream);
    failures += nonfinite != 0;

    row.insert(row.end(), {{"bwd ms", Table::Cell(tb.median_ms, 3)},
                           {"fwd+bwd ms", Table::Cell(t.median_ms + tb.median_ms, 3)},
                           {"kept fwd ms", Table::Cell(tk.median_ms, 3)},
                           {"bwd from fwd ms", Table::Cell(tbk.median_ms, 3)},
                           {"training ms", Table::Cell(tk.median_ms + tbk.median_ms, 3)},
                           {"non-finite", Table::Cell(static_cast<int64_t>(nonfinite))}});
    table.add_row(row);
    r.metrics.insert({{"backward_median_ms", tb.median_ms}, {"kept_forward_median_ms", tk.median_ms},
                      {"backward_from_forward_median_ms", tbk.median_ms}});
    records.push_back(r);
  }
  std::printf("KDA forward and backward, bf16, H = HV = %d, K = V = %d, %d tokens (copy bandwidth %.0f GB/s)\n", kHeads, kDim,
              kTokens, copy_gbps);
  table.print();
  if (!args.json_path.empty()) write_json(args.json_path, records);
  return failures ? 1 : 0;
}

}  // namespace
}  // namespace flare::bench

int main(int argc, char** argv) { return flare::bench::run(argc, argv); }
