// The benchmark harness every flare benchmark binary uses: CUDA-event timing (direct launches or
// CUDA-graph replays) with L2 flushed between samples, the measured ceilings (copy bandwidth,
// cuBLAS GEMM) that results are reported against, and the host-only half from bench_stats.h
// (statistics, FLOP counting, table, JSON, command line).
//
// A benchmark's main, in outline:
//   auto args = flare::bench::parse_args_or_exit(argc, argv);
//   flare::bench::require_cuda_device_or_exit();
//   const double peak = flare::bench::measure_gemm_tflops(stream);
//   Timing t = flare::bench::time_kernel([&](cudaStream_t s) { run(plan, s); }, args.timing(),
//                                        stream);
//   table.add_row({{"case", name}, {"ms", t.median_ms}, {"TFLOP/s", tflops(flops, t.median_ms)},
//                  {"of peak", tflops(flops, t.median_ms) / peak}});
#pragma once

#include <cuda_runtime.h>

#include <functional>
#include <map>
#include <string>

#include "bench/common/bench_stats.h"
#include "flare/status.h"

// Evaluates a cudaError_t expression; on failure prints the CUDA error with file:line and
// exits(1). A benchmark that hits a CUDA error has no result worth continuing for.
#define FLARE_BENCH_CHECK(expr) \
  ::flare::bench::detail::check_cuda((expr), #expr, __FILE__, __LINE__)

namespace flare::bench {

namespace detail {
void check_cuda(cudaError_t err, const char* expr, const char* file, int line);
}  // namespace detail

// ---- device ------------------------------------------------------------------------------------

// False, with a plain reason in *why (may be null), when no CUDA device can be used: the driver
// is missing or too old, or no device is visible.
bool cuda_device_available(std::string* why);
// Prints "no CUDA device: <why>" to stderr and exits(1) when cuda_device_available is false.
void require_cuda_device_or_exit();
// Tags describing the current device for JSON records: "device", "sm", "sms", "l2_bytes",
// "cuda_runtime", "cuda_driver".
std::map<std::string, std::string> device_tags();

// ---- timing ------------------------------------------------------------------------------------

// Overwrites a device buffer twice the size of the current device's L2 on `stream`, so data a
// kernel reads next comes from HBM. The buffer is allocated on first use and kept.
// FLARE_BENCH_FLUSH=read reads the buffer instead, leaving L2 full of clean lines (the peers'
// bench/peers/cuda_timing.py follows the same variable).
void flush_l2(cudaStream_t stream);

// A device buffer that only grows: reserve(need) makes it at least `need` bytes (the old one freed)
// and returns it, for workspaces whose size changes from case to case. Kept for the process.
struct GrowingDeviceBuffer {
  void* data = nullptr;
  std::size_t bytes = 0;
  void* reserve(std::size_t need);
};

// Times `launch` on `stream`: `warmup` untimed runs, then `repeats` samples, each an event pair
// around one launch (or one graph replay of `graph_batch` launches, divided by graph_batch; or
// `calls` launches or replays back to back, divided by calls), preceded by an L2 flush when
// flush_l2 is set. The flush sits outside the event pair, so it is not timed; with graph_batch
// or calls > 1 it precedes the whole sample, so only its first launch starts cold. Samples are queued while a one-thread kernel holds the stream, then run
// back to back, so the host's launch overhead never shows up inside a sample.
//
// With cuda_graph, `launch` is captured once (on a private stream in global capture mode, since
// the legacy default stream cannot be captured) and the graph is replayed on `stream`. A launch
// that synchronizes or copies to the host fails the capture and exits with the CUDA error; one
// that allocates may still capture, so plan-then-run stays the launch function's own duty.
//
// `launch` must enqueue its work on the stream it is given. Every CUDA call is checked; the first
// failure exits(1) with its message.
Timing time_kernel(const std::function<void(cudaStream_t)>& launch, const TimingOptions& options,
                   cudaStream_t stream);

// Prints "<what>: <message>" to stderr and exits(1) unless `s` is ok.
void check_ok(const Status& s, const std::string& what);

// time_kernel of a flare call that takes its params (stream inside): each sample calls op on a
// copy of `params` given the sample's stream; a failing call exits with `what` and its message.
template <typename Params, typename Op>
Timing time_op(Op op, const Params& params, const std::string& what, const TimingOptions& options,
               cudaStream_t stream) {
  return time_kernel(
      [&](cudaStream_t st) {
        Params q = params;
        q.stream = st;
        check_ok(op(q), what);
      },
      options, stream);
}

// ---- ceilings ----------------------------------------------------------------------------------

// Device-to-device copy bandwidth in GB/s (1e9 B/s), counting bytes read plus bytes written:
// the median of several cudaMemcpyAsync calls of up to 1 GiB (less when memory is short).
double measure_copy_bandwidth_gbps(cudaStream_t stream);
// Dense bf16 GEMM throughput in TFLOP/s: cuBLAS (cublasGemmEx, fp32 accumulation) on 8192^3 with
// random non-zero inputs, median time, counting 2·m·n·k FLOPs.
double measure_gemm_tflops(cudaStream_t stream);

// ---- device data -------------------------------------------------------------------------------

// n bf16 values, roughly standard normal, from a counter-based hash of (index, seed): the same
// seed gives the same data, never zeros.
void fill_normal_bf16(void* data, int64_t n, uint64_t seed, cudaStream_t stream);

// `got` against `ref` (both n bf16 values): relative L2 error and max abs error; a NaN in `got`
// (an unwritten, poisoned element) makes both infinite.
struct ErrorStats {
  double rel_l2 = 0, max_abs = 0;
};
ErrorStats compare_bf16(const void* got, const void* ref, int64_t n, cudaStream_t stream);

}  // namespace flare::bench
