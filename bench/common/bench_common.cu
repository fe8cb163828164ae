#include "bench/common/bench_common.h"

#include <cublas_v2.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string_view>
#include <thread>
#include <vector>

namespace flare::bench {

void check_ok(const Status& s, const std::string& what) {
  if (s.ok()) return;
  std::fprintf(stderr, "%s: %s\n", what.c_str(), s.message().c_str());
  std::exit(1);
}

namespace detail {
void check_cuda(cudaError_t err, const char* expr, const char* file, int line) {
  if (err == cudaSuccess) return;
  std::fprintf(stderr, "%s:%d: CUDA error %s (%s) from %s\n", file, line, cudaGetErrorName(err),
               cudaGetErrorString(err), expr);
  std::exit(1);
}
}  // namespace detail

namespace {

void check_cublas(cublasStatus_t status, const char* expr, const char* file, int line) {
  if (status == CUBLAS_STATUS_SUCCESS) return;
  std::fprintf(stderr, "%s:%d: cuBLAS error %s from %s\n", file, line,
               cublasGetStatusString(status), expr);
  std::exit(1);
}
#define FLARE_BENCH_CHECK_CUBLAS(expr) check_cublas((expr), #expr, __FILE__, __LINE__)

// ---- L2 flush ----------------------------------------------------------------------------------

constexpr std::size_t kFlushOverL2 = 2;               // write twice the L2 so nothing survives
constexpr std::size_t kFlushBytesIfUnknown = 256 << 20;  // when the device reports no L2 size

// One buffer for the current device, kept for the life of the process (freeing it from a static
// destructor would race the CUDA runtime's own teardown). Benchmarks are single-threaded.
struct FlushBuffer {
  int device = -1;
  void* data = nullptr;
  std::size_t bytes = 0;
  unsigned char fill = 0;
};

FlushBuffer& flush_buffer() {
  static FlushBuffer buffer;
  return buffer;
}

// FLARE_BENCH_FLUSH=read: the flush reads the buffer instead of rewriting it, so L2 is left full of
// clean lines (a rewrite leaves twice the L2 of dirty lines, which the next kernel's first reads
// may wait behind while they are written back). Read once per process. Default: write.
bool flush_by_reading() {
  static const bool read = [] {
    const char* mode = std::getenv("FLARE_BENCH_FLUSH");
    return mode != nullptr && std::string_view(mode) == "read";
  }();
  return read;
}

// Reads n 16-byte words; writes only if the impossible happens (so the reads are not dropped).
__global__ void read_flush_kernel(const uint4* data, std::size_t n, unsigned* sink) {
  unsigned acc = 0;
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n;
       i += std::size_t{gridDim.x} * blockDim.x) {
    const uint4 v = __ldcg(data + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x9E3779B9u && sink != nullptr) *sink = acc;
}

// ---- holding the stream while samples are queued -----------------------------------------------
// Samples are queued back to back and read at the end. Without a hold, a GPU that drains the
// queue faster than the host fills it would stamp a start event, then idle until the host
// enqueues the launch, and time that gap. So before each group of samples a one-thread kernel
// blocks the stream until the host, having queued the group, raises a counter in mapped host
// memory. Groups keep the queue short of the driver's limit (past it, the host would block while
// the stream is held). The hold gives up after a timeout, so a launch that blocks the host (a
// synchronizing call) cannot deadlock; the host then warns that samples may include host gaps.

constexpr int kSamplesPerHold = 64;
constexpr unsigned long long kHoldTimeoutNs = 1'000'000'000ull;
constexpr unsigned kHoldPollNs = 500;

struct HoldFlags {
  int released_groups;  // host -> device: groups fully queued
  int timed_out;        // device -> host
};

__global__ void hold_stream_until_queued(volatile HoldFlags* flags, int group,
                                         unsigned long long timeout_ns) {
  unsigned long long start, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  while (flags->released_groups <= group) {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    if (now - start > timeout_ns) {
      flags->timed_out = 1;
      return;
    }
    __nanosleep(kHoldPollNs);
  }
}

HoldFlags* hold_flags_host() {
  static HoldFlags* flags = nullptr;  // kept for the process, like the flush buffer
  if (flags == nullptr) {
    FLARE_BENCH_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&flags), sizeof(HoldFlags),
                                    cudaHostAllocMapped | cudaHostAllocPortable));
  }
  return flags;
}

// ---- launches and CUDA graphs ------------------------------------------------------------------

// A launch's own errors (a bad grid, too much shared memory) surface in cudaGetLastError; name the
// phase, since the file:line of a check here would point into the harness.
void check_launch(const char* phase) {
  const cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess) return;
  std::fprintf(stderr, "time_kernel: CUDA error %s (%s) after the launch function (%s)\n",
               cudaGetErrorName(err), cudaGetErrorString(err), phase);
  std::exit(1);
}

// Captures `batch` launches on a private stream (the legacy default stream cannot be captured)
// and instantiates them.
cudaGraphExec_t capture_launches(const std::function<void(cudaStream_t)>& launch, int batch) {
  cudaStream_t capture_stream;
  FLARE_BENCH_CHECK(cudaStreamCreateWithFlags(&capture_stream, cudaStreamNonBlocking));
  FLARE_BENCH_CHECK(cudaStreamBeginCapture(capture_stream, cudaStreamCaptureModeGlobal));
  for (int i = 0; i < batch; ++i) {
    launch(capture_stream);
    check_launch("graph capture");
  }
  cudaGraph_t graph;
  FLARE_BENCH_CHECK(cudaStreamEndCapture(capture_stream, &graph));
  cudaGraphExec_t exec;
  FLARE_BENCH_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  FLARE_BENCH_CHECK(cudaGraphDestroy(graph));
  FLARE_BENCH_CHECK(cudaStreamDestroy(capture_stream));
  return exec;
}

// ---- random inputs for the GEMM ceiling --------------------------------------------------------

// A 64-bit integer mixer (the MurmurHash3 finalizer): index and seed in, 32 random bits out.
__device__ uint32_t mix_bits(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  x ^= x >> 33;
  return static_cast<uint32_t>(x);
}

// Uniform in (-1, 1), never zero: zeros would let the tensor cores idle and flatter the peak.
__global__ void fill_random_bf16(__nv_bfloat16* data, std::size_t count, uint64_t seed) {
  constexpr float kUnitBits = 1.0f / (1u << 23);
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < count;
       i += stride) {
    const uint32_t bits = mix_bits(i * 0x9e3779b97f4a7c15ull + seed) >> 9;  // 23 bits
    const float u = (static_cast<float>(bits) + 0.5f) * kUnitBits;          // (0, 1)
    data[i] = __float2bfloat16(2.0f * u - 1.0f);
  }
}

}  // namespace

// ---- device ------------------------------------------------------------------------------------

bool cuda_device_available(std::string* why) {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();  // leave no error behind for the caller's next CUDA call
    if (why != nullptr) {
      *why = std::string("cudaGetDeviceCount failed: ") + cudaGetErrorName(err) + " (" +
             cudaGetErrorString(err) + ")";
    }
    return false;
  }
  if (count == 0) {
    if (why != nullptr) *why = "no device visible (cudaGetDeviceCount returned 0)";
    return false;
  }
  return true;
}

void require_cuda_device_or_exit() {
  std::string why;
  if (cuda_device_available(&why)) return;
  std::fprintf(stderr, "no CUDA device: %s\n", why.c_str());
  std::exit(1);
}

std::map<std::string, std::string> device_tags() {
  int device = 0, runtime = 0, driver = 0;
  FLARE_BENCH_CHECK(cudaGetDevice(&device));
  cudaDeviceProp prop;
  FLARE_BENCH_CHECK(cudaGetDeviceProperties(&prop, device));
  FLARE_BENCH_CHECK(cudaRuntimeGetVersion(&runtime));
  FLARE_BENCH_CHECK(cudaDriverGetVersion(&driver));
  auto version = [](int v) {
    return std::to_string(v / 1000) + "." + std::to_string(v % 1000 / 10);
  };
  return {
      {"device", prop.name},
      {"sm", std::to_string(prop.major) + std::to_string(prop.minor)},
      {"sms", std::to_string(prop.multiProcessorCount)},
      {"l2_bytes", std::to_string(prop.l2CacheSize)},
      {"cuda_runtime", version(runtime)},
      {"cuda_driver", version(driver)},
  };
}

// ---- timing ------------------------------------------------------------------------------------

void flush_l2(cudaStream_t stream) {
  FlushBuffer& buffer = flush_buffer();
  int device = 0;
  FLARE_BENCH_CHECK(cudaGetDevice(&device));
  if (buffer.device != device) {
    if (buffer.data != nullptr) {  // the benchmark moved to another device: free the old one there
      FLARE_BENCH_CHECK(cudaSetDevice(buffer.device));
      FLARE_BENCH_CHECK(cudaFree(buffer.data));
      FLARE_BENCH_CHECK(cudaSetDevice(device));
    }
    cudaDeviceProp prop;
    FLARE_BENCH_CHECK(cudaGetDeviceProperties(&prop, device));
    buffer.bytes = prop.l2CacheSize > 0 ? kFlushOverL2 * static_cast<std::size_t>(prop.l2CacheSize)
                                        : kFlushBytesIfUnknown;
    FLARE_BENCH_CHECK(cudaMalloc(&buffer.data, buffer.bytes));
    buffer.device = device;
  }
  if (flush_by_reading()) {
    read_flush_kernel<<<1024, 256, 0, stream>>>(static_cast<const uint4*>(buffer.data), buffer.bytes / 16, nullptr);
    FLARE_BENCH_CHECK(cudaGetLastError());
    return;
  }
  buffer.fill ^= 1;  // a different value each time: no flush is a no-op rewrite of the last one
  FLARE_BENCH_CHECK(cudaMemsetAsync(buffer.data, buffer.fill, buffer.bytes, stream));
}

void* GrowingDeviceBuffer::reserve(std::size_t need) {
  if (need > bytes) {
    if (data != nullptr) FLARE_BENCH_CHECK(cudaFree(data));
    FLARE_BENCH_CHECK(cudaMalloc(&data, need));
    bytes = need;
  }
  return data;
}

// FLARE_BENCH_COOLDOWN_MS=N: the device idle for N ms before a measurement's samples (after its
// warm-up), so that each kernel's samples start from the same power and clock state, not from
// whatever the kernel timed before it left (bench/peers/cuda_timing.py reads the same variable).
static void cool_down() {
  static const int ms = [] {
    const char* e = std::getenv("FLARE_BENCH_COOLDOWN_MS");
    return e == nullptr ? 0 : std::atoi(e);
  }();
  if (ms <= 0) return;
  FLARE_BENCH_CHECK(cudaDeviceSynchronize());
  std::this_thread::sleep_for(std::chrono::milliseconds(ms));
}

Timing time_kernel(const std::function<void(cudaStream_t)>& launch, const TimingOptions& options,
                   cudaStream_t stream) {
  if (options.repeats < 1 || options.warmup < 0 || options.graph_batch < 1 || options.calls < 1) {
    std::fprintf(stderr,
                 "time_kernel: need repeats >= 1, warmup >= 0, graph_batch >= 1, calls >= 1 "
                 "(got %d, %d, %d, %d)\n",
                 options.repeats, options.warmup, options.graph_batch, options.calls);
    std::exit(1);
  }

  cudaGraphExec_t graph = nullptr;
  if (options.cuda_graph) {
    graph = capture_launches(launch, options.graph_batch);
    FLARE_BENCH_CHECK(cudaGraphUpload(graph, stream));  // so even warmup = 0 times no upload
  }
  const double launches_per_sample = (options.cuda_graph ? options.graph_batch : 1) * options.calls;
  auto run_once = [&](const char* phase) {
    for (int c = 0; c < options.calls; ++c) {
      if (graph != nullptr) {
        FLARE_BENCH_CHECK(cudaGraphLaunch(graph, stream));
      } else {
        launch(stream);
        check_launch(phase);
      }
    }
  };

  for (int i = 0; i < options.warmup; ++i) run_once("warm-up");
  FLARE_BENCH_CHECK(cudaStreamSynchronize(stream));
  cool_down();
  if (options.flush_l2) flush_l2(stream);  // allocate the flush buffer before the hold, untimed

  const int repeats = options.repeats;
  std::vector<cudaEvent_t> starts(repeats), stops(repeats);
  for (int r = 0; r < repeats; ++r) {
    FLARE_BENCH_CHECK(cudaEventCreate(&starts[r]));
    FLARE_BENCH_CHECK(cudaEventCreate(&stops[r]));
  }

  HoldFlags* flags = hold_flags_host();
  volatile HoldFlags* host_flags = flags;
  host_flags->released_groups = 0;
  host_flags->timed_out = 0;
  HoldFlags* device_flags = nullptr;
  FLARE_BENCH_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&device_flags), flags, 0));

  for (int r = 0; r < repeats; ++r) {
    const int group = r / kSamplesPerHold;
    if (r % kSamplesPerHold == 0) {
      hold_stream_until_queued<<<1, 1, 0, stream>>>(device_flags, group, kHoldTimeoutNs);
      FLARE_BENCH_CHECK(cudaGetLastError());
    }
    if (options.flush_l2) flush_l2(stream);
    FLARE_BENCH_CHECK(cudaEventRecord(starts[r], stream));
    run_once("timed sample");
    FLARE_BENCH_CHECK(cudaEventRecord(stops[r], stream));
    if ((r + 1) % kSamplesPerHold == 0 || r + 1 == repeats) host_flags->released_groups = group + 1;
  }
  FLARE_BENCH_CHECK(cudaStreamSynchronize(stream));
  if (host_flags->timed_out != 0) {
    std::fprintf(stderr,
                 "warning: time_kernel: a stream hold timed out before its samples were queued "
                 "(a launch that blocks the host?); samples may include host gaps\n");
  }

  std::vector<double> samples_ms(repeats);
  for (int r = 0; r < repeats; ++r) {
    float ms = 0;
    FLARE_BENCH_CHECK(cudaEventElapsedTime(&ms, starts[r], stops[r]));
    samples_ms[r] = ms / launches_per_sample;
    FLARE_BENCH_CHECK(cudaEventDestroy(starts[r]));
    FLARE_BENCH_CHECK(cudaEventDestroy(stops[r]));
  }
  if (graph != nullptr) FLARE_BENCH_CHECK(cudaGraphExecDestroy(graph));
  return summarize(std::move(samples_ms));
}

// ---- ceilings ----------------------------------------------------------------------------------

double measure_copy_bandwidth_gbps(cudaStream_t stream) {
  constexpr std::size_t kCopyBytes = std::size_t{1} << 30;
  constexpr std::size_t kMinCopyBytes = std::size_t{64} << 20;  // still far beyond any L2
  std::size_t free_bytes = 0, total_bytes = 0;
  FLARE_BENCH_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  std::size_t bytes = kCopyBytes;
  // Source and destination together take at most half the free memory.
  while (bytes > kMinCopyBytes && 2 * bytes > free_bytes / 2) bytes /= 2;

  void* src = nullptr;
  void* dst = nullptr;
  FLARE_BENCH_CHECK(cudaMalloc(&src, bytes));
  FLARE_BENCH_CHECK(cudaMalloc(&dst, bytes));
  FLARE_BENCH_CHECK(cudaMemsetAsync(src, 1, bytes, stream));

  TimingOptions options;
  options.warmup = 3;
  options.repeats = 10;
  options.flush_l2 = false;  // the copy is many times the L2 already
  const Timing t = time_kernel(
      [&](cudaStream_t s) {
        FLARE_BENCH_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, s));
      },
      options, stream);

  FLARE_BENCH_CHECK(cudaFree(src));
  FLARE_BENCH_CHECK(cudaFree(dst));
  return gbps(2.0 * static_cast<double>(bytes), t.median_ms);  // read + written
}

double measure_gemm_tflops(cudaStream_t stream) {
  constexpr int kGemmSize = 8192;
  constexpr std::size_t kElements = std::size_t{kGemmSize} * kGemmSize;
  constexpr int kFillThreads = 256;
  constexpr int kFillBlocks = 1024;

  __nv_bfloat16 *a = nullptr, *b = nullptr, *c = nullptr;
  FLARE_BENCH_CHECK(cudaMalloc(&a, kElements * sizeof(__nv_bfloat16)));
  FLARE_BENCH_CHECK(cudaMalloc(&b, kElements * sizeof(__nv_bfloat16)));
  FLARE_BENCH_CHECK(cudaMalloc(&c, kElements * sizeof(__nv_bfloat16)));
  fill_random_bf16<<<kFillBlocks, kFillThreads, 0, stream>>>(a, kElements, 1);
  FLARE_BENCH_CHECK(cudaGetLastError());
  fill_random_bf16<<<kFillBlocks, kFillThreads, 0, stream>>>(b, kElements, 2);
  FLARE_BENCH_CHECK(cudaGetLastError());

  cublasHandle_t handle;
  FLARE_BENCH_CHECK_CUBLAS(cublasCreate(&handle));
  const float alpha = 1.0f, beta = 0.0f;
  TimingOptions options;
  options.warmup = 5;
  options.repeats = 20;
  options.flush_l2 = false;  // operands of 128 MiB each do not fit in L2 anyway
  // C = Aᵀ·B in column-major terms ("TN"): both operands K-major, cuBLAS's best-tuned layout.
  const Timing t = time_kernel(
      [&](cudaStream_t s) {
        FLARE_BENCH_CHECK_CUBLAS(cublasSetStream(handle, s));
        FLARE_BENCH_CHECK_CUBLAS(cublasGemmEx(
            handle, CUBLAS_OP_T, CUBLAS_OP_N, kGemmSize, kGemmSize, kGemmSize, &alpha, a,
            CUDA_R_16BF, kGemmSize, b, CUDA_R_16BF, kGemmSize, &beta, c, CUDA_R_16BF, kGemmSize,
            CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
      },
      options, stream);

  FLARE_BENCH_CHECK_CUBLAS(cublasDestroy(handle));
  FLARE_BENCH_CHECK(cudaFree(a));
  FLARE_BENCH_CHECK(cudaFree(b));
  FLARE_BENCH_CHECK(cudaFree(c));
  const double flops = 2.0 * kGemmSize * static_cast<double>(kGemmSize) * kGemmSize;
  return tflops(flops, t.median_ms);
}

// ---- device data -------------------------------------------------------------------------------

namespace {

__global__ void fill_normal_bf16_kernel(__nv_bfloat16* x, int64_t n, uint64_t seed) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    uint64_t h = (i + 1) * 0x9E3779B97F4A7C15ull ^ seed;
    h ^= h >> 31;
    h *= 0xBF58476D1CE4E5B9ull;
    h ^= h >> 29;
    const float u1 = ((h & 0xffffff) + 1) / 16777217.f, u2 = ((h >> 24) & 0xffffff) / 16777216.f;
    x[i] = __float2bfloat16(sqrtf(-2.f * logf(u1)) * cospif(2.f * u2));
  }
}

// sums[0] += sum (a - b)^2, sums[1] += sum b^2, sums[2] = max |a - b| (inf for NaN).
__global__ void error_sums_kernel(const __nv_bfloat16* a, const __nv_bfloat16* b, int64_t n, double* sums) {
  double num = 0, den = 0, mx = 0;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    const double x = __bfloat162float(a[i]), y = __bfloat162float(b[i]);
    num += isnan(x) ? INFINITY : (x - y) * (x - y);
    den += y * y;
    mx = fmax(mx, isnan(x) ? INFINITY : fabs(x - y));
  }
  atomicAdd(&sums[0], num);
  atomicAdd(&sums[1], den);
  atomicMax(reinterpret_cast<unsigned long long*>(&sums[2]), __double_as_longlong(mx));  // non-negative: bits order
}

}  // namespace

void fill_normal_bf16(void* data, int64_t n, uint64_t seed, cudaStream_t stream) {
  fill_normal_bf16_kernel<<<1024, 256, 0, stream>>>(static_cast<__nv_bfloat16*>(data), n, seed);
  FLARE_BENCH_CHECK(cudaGetLastError());
}

ErrorStats compare_bf16(const void* got, const void* ref, int64_t n, cudaStream_t stream) {
  static double* sums = nullptr;
  if (sums == nullptr) FLARE_BENCH_CHECK(cudaMalloc(&sums, 3 * sizeof(double)));
  FLARE_BENCH_CHECK(cudaMemsetAsync(sums, 0, 3 * sizeof(double), stream));
  error_sums_kernel<<<512, 256, 0, stream>>>(static_cast<const __nv_bfloat16*>(got),
                                             static_cast<const __nv_bfloat16*>(ref), n, sums);
  FLARE_BENCH_CHECK(cudaGetLastError());
  double host[3];
  FLARE_BENCH_CHECK(cudaMemcpyAsync(host, sums, sizeof host, cudaMemcpyDeviceToHost, stream));
  FLARE_BENCH_CHECK(cudaStreamSynchronize(stream));
  return {std::sqrt(host[0] / host[1]), host[2]};
}

}  // namespace flare::bench
