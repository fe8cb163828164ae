// KDA recurrent step (decode) benchmark: bf16, H = HV = 32, K = V = 128, a state pool of N fp32
// slots addressed through a permutation (continuous batching), N in {1, 8, 64, 128, 256} sequences
// of Tq in {1, 4, 8} tokens; plus GDN and the layer mode (gate, l2norm, beta sigmoid in the
// kernel) at N = 256. Timed under CUDA-graph replay with L2 flushed before every sample (each
// step reads and writes the whole state: N = 256 is 1 GiB each way).
//
// Reports the time, the state traffic's bandwidth (the pool slots read and written once:
// 2 x N x HV x K x V x 4 bytes), the bandwidth of everything moved (state, q, k, v, g, beta, out)
// and its fraction of the measured copy bandwidth; checks that every output is finite.
//
//   bench_kda_recurrent [--quick] [--json PATH] [--filter S] [--repeats N] [--warmup N] [--no-flush]
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "bench/common/bench_common.h"
#include "bench/common/kda_inputs.cuh"
#include "flare/kda.h"

namespace flare::bench {
namespace {

constexpr int kHeads = 32, kDim = 128, kMaxSeqs = 256, kMaxTokens = 8;

struct Case {
  std::string name;
  int seqs, tokens;
  bool gdn = false, layer_mode = false;
};

__global__ void bf16_to_f32(const __nv_bfloat16* in, float* out, int64_t n, float scale) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x)
    out[i] = scale * __bfloat162float(in[i]);
}

__global__ void count_nonfinite(const __nv_bfloat16* x, int64_t n, unsigned long long* bad) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x)
    if (!isfinite(__bfloat162float(x[i]))) atomicAdd(bad, 1ull);
}

struct Buffers {
  __nv_bfloat16 *q, *k, *v, *beta, *out;
  float *g, *g_gdn, *A_log, *dt_bias, *pool;
  int* indices;
};

KdaRecurrentParams make_params(const Case& c, const Buffers& b) {
  const int64_t N = c.seqs, T = c.tokens, H = kHeads, D = kDim;
  const Device gpu{DeviceKind::kCUDA, 0};
  KdaRecurrentParams p;
  p.q = TensorView::contiguous(b.q, DType::kBFloat16, {N, T, H, D}, gpu);
  p.k = TensorView::contiguous(b.k, DType::kBFloat16, {N, T, H, D}, gpu);
  p.v = TensorView::contiguous(b.v, DType::kBFloat16, {N, T, H, D}, gpu);
  p.g = c.gdn ? TensorView::contiguous(b.g_gdn, DType::kFloat32, {N, T, H}, gpu)
              : TensorView::contiguous(b.g, DType::kFloat32, {N, T, H, D}, gpu);
  p.beta = TensorView::contiguous(b.beta, DType::kBFloat16, {N, T, H}, gpu);
  p.out = TensorView::contiguous(b.out, DType::kBFloat16, {N, T, H, D}, gpu);
  p.state = TensorView::contiguous(b.pool, DType::kFloat32, {N, H, D, D}, gpu);
  p.state_indices = TensorView::contiguous(b.indices, DType::kInt32, {N}, gpu);
  if (c.layer_mode) {
    p.options.qk_l2norm = p.options.beta_sigmoid = p.options.gate_in_kernel = true;
    p.A_log = TensorView::contiguous(b.A_log, DType::kFloat32, {H}, gpu);
    p.dt_bias = TensorView::contiguous(b.dt_bias, DType::kFloat32, {c.gdn ? H : H * D}, gpu);
  }
  return p;
}

int run(int argc, char** argv) {
  const Args args = parse_args_or_exit(argc, argv);
  require_cuda_device_or_exit();
  cudaStream_t stream;
  FLARE_BENCH_CHECK(cudaStreamCreate(&stream));
  const double copy_gbps = measure_copy_bandwidth_gbps(stream);

  std::vector<Case> cases;
  const std::vector<int> seqs = args.quick ? std::vector<int>{1, 64, 256} : std::vector<int>{1, 8, 64, 128, 256};
  for (int T : {1, 4, 8})
    for (int N : seqs) cases.push_back({"N" + std::to_string(N) + " Tq" + std::to_string(T), N, T});
  cases.push_back({"N256 Tq1 GDN", 256, 1, true, false});
  cases.push_back({"N256 Tq1 layer", 256, 1, false, true});
  cases.push_back({"N256 Tq1 GDN layer", 256, 1, true, true});

  const int64_t rows = int64_t{kMaxSeqs} * kMaxTokens * kHeads, elems = rows * kDim;
  const int64_t pool_elems = int64_t{kMaxSeqs} * kHeads * kDim * kDim;
  Buffers b;
  FLARE_BENCH_CHECK(cudaMalloc(&b.q, elems * 2));
  FLARE_BENCH_CHECK(cudaMalloc(&b.k, elems * 2));
  FLARE_BENCH_CHECK(cudaMalloc(&b.v, elems * 2));
  FLARE_BENCH_CHECK(cudaMalloc(&b.out, elems * 2));
  FLARE_BENCH_CHECK(cudaMalloc(&b.g, elems * 4));
  FLARE_BENCH_CHECK(cudaMalloc(&b.g_gdn, rows * 4));
  FLARE_BENCH_CHECK(cudaMalloc(&b.beta, rows * 2));
  FLARE_BENCH_CHECK(cudaMalloc(&b.A_log, kHeads * 4));
  FLARE_BENCH_CHECK(cudaMalloc(&b.dt_bias, kHeads * kDim * 4));
  FLARE_BENCH_CHECK(cudaMalloc(&b.pool, pool_elems * 4));
  FLARE_BENCH_CHECK(cudaMalloc(&b.indices, kMaxSeqs * 4));
  unsigned long long* bad;
  FLARE_BENCH_CHECK(cudaMalloc(&bad, sizeof(*bad)));
  {
    std::vector<float> a_log(kHeads), dt(kHeads * kDim);
    for (int h = 0; h < kHeads; ++h) a_log[h] = std::log(1.f + 15.f * h / kHeads);
    for (int i = 0; i < kHeads * kDim; ++i) dt[i] = -1.f + 0.001f * (i % 997);
    FLARE_BENCH_CHECK(cudaMemcpy(b.A_log, a_log.data(), kHeads * 4, cudaMemcpyHostToDevice));
    FLARE_BENCH_CHECK(cudaMemcpy(b.dt_bias, dt.data(), dt.size() * 4, cudaMemcpyHostToDevice));
  }

  Table table;
  std::vector<Record> records;
  int failures = 0;
  int filled_mode = -1;  // the mode the inputs were last filled for
  for (const Case& c : cases) {
    if (!args.selected(c.name)) continue;
    if (int{c.layer_mode} != filled_mode) {  // fresh inputs per mode
      fill_normal_bf16(b.q, elems, 1, stream);
      fill_normal_bf16(b.k, elems, 2, stream);
      fill_normal_bf16(b.v, elems, 3, stream);
      fill_normal_bf16(b.out, elems, 4, stream);  // scratch for g
      bf16_to_f32<<<1024, 256, 0, stream>>>(b.out, b.g, elems, 1.f);
      fill_normal_bf16(b.beta, rows, 5, stream);
      shape_kda_inputs<kDim><<<(rows + 7) / 8, dim3(32, 8), 0, stream>>>(b.k, b.g, b.beta, rows, c.layer_mode, 1.f);
      // GDN: one decay per (token, head), the first channel's.
      FLARE_BENCH_CHECK(cudaMemcpy2DAsync(b.g_gdn, 4, b.g, kDim * 4, 4, rows, cudaMemcpyDeviceToDevice, stream));
      // The pool: small random states (the same every mode).
      fill_normal_bf16(b.out, std::min(pool_elems, elems), 6, stream);
      for (int64_t at = 0; at < pool_elems; at += elems)
        bf16_to_f32<<<1024, 256, 0, stream>>>(b.out, b.pool + at, std::min(elems, pool_elems - at), 0.1f);
      filled_mode = c.layer_mode;
    }
    // Slots in a fixed random order: the pool as continuous batching addresses it.
    std::vector<int> order(c.seqs);
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), std::mt19937(c.seqs));
    FLARE_BENCH_CHECK(cudaMemcpyAsync(b.indices, order.data(), order.size() * 4, cudaMemcpyHostToDevice, stream));
    FLARE_BENCH_CHECK(cudaStreamSynchronize(stream));

    const KdaRecurrentParams p = make_params(c, b);
    const Timing t = time_op(kda_recurrent_step, p, c.name,
                             args.timing({.warmup = 10, .repeats = 50, .flush_l2 = true, .cuda_graph = true}), stream);

    const int64_t out_elems = int64_t{c.seqs} * c.tokens * kHeads * kDim;
    FLARE_BENCH_CHECK(cudaMemsetAsync(bad, 0, sizeof(*bad), stream));
    count_nonfinite<<<1024, 256, 0, stream>>>(b.out, out_elems, bad);
    unsigned long long nonfinite = 0;
    FLARE_BENCH_CHECK(cudaMemcpyAsync(&nonfinite, bad, sizeof(nonfinite), cudaMemcpyDeviceToHost, stream));
    FLARE_BENCH_CHECK(cudaStreamSynchronize(stream));
    failures += nonfinite != 0;

    const double state_bytes = 2.0 * c.seqs * kHeads * kDim * kDim * 4;
    const double token_rows = double(c.seqs) * c.tokens * kHeads;
    // q, k, v, out bf16; g fp32 per channel (one value for GDN); beta bf16; indices.
    const double io_bytes = token_rows * (kDim * 2.0 * 4 + (c.gdn ? 4.0 : kDim * 4.0) + 2.0) + c.seqs * 4.0;
    const double state_gbps = gbps(state_bytes, t.median_ms), total_gbps = gbps(state_bytes + io_bytes, t.median_ms);
    table.add_row({{"case", c.name},
                   {"us", Table::Cell(1e3 * t.median_ms, 1)},
                   {"p10-p90 us", Table::format_number(1e3 * t.p10_ms, 1) + "-" + Table::format_number(1e3 * t.p90_ms, 1)},
                   {"state GB/s", Table::Cell(state_gbps, 0)},
                   {"all GB/s", Table::Cell(total_gbps, 0)},
                   {"of copy bw", Table::Cell(total_gbps / copy_gbps, 2)},
                   {"non-finite", Table::Cell(static_cast<int64_t>(nonfinite))}});
    Record r;
    r.name = "kda_recurrent " + c.name;
    r.metrics = {{"median_ms", t.median_ms},
                 {"state_gbps", state_gbps},
                 {"total_gbps", total_gbps},
                 {"fraction_of_copy_bw", total_gbps / copy_gbps}};
    r.tags = device_tags();
    r.tags["dtype"] = "bf16";
    records.push_back(r);
  }
  std::printf("KDA recurrent step, bf16, H = HV = %d, K = V = %d, fp32 state pool, CUDA graph, L2 flushed "
              "(copy bandwidth %.0f GB/s)\n",
              kHeads, kDim, copy_gbps);
  table.print();
  if (!args.json_path.empty()) write_json(args.json_path, records);
  return failures ? 1 : 0;
}

}  // namespace
}  // namespace flare::bench

int main(int argc, char** argv) { return flare::bench::run(argc, argv); }
