// How long one load takes to come back from HBM right after the benchmarks' L2 flush, for the
// latency floors of short kernels (decode's first K/V loads: bench/RESULTS.md, session 19).
//
// One thread walks a chain of dependent 16-byte loads (ld.global.cg, so L1 is bypassed) through a
// 1 GiB buffer and stamps clock64 around each: the first touch of a 2 MiB page (a TLB miss and an
// HBM read), another line of the same page (HBM only), the first line again (an L2 hit), then the
// first lines of pages 2 MiB, 64 MiB and 512 MiB away. Each trial starts at a different offset, so
// no line is in L2 from an earlier trial. Two modes: after the harness's L2 flush (a rewrite, or a
// read under FLARE_BENCH_FLUSH=read: run the probe once each way) and with no flush.
//
// Then the same for the sm_90 copy engines, one thread issuing and waiting on an mbarrier: a TMA
// tensor load of one decode box (64 columns x 16 tokens of a [batch, tokens, 8 heads, 128] bf16
// cache, 2 KB, src/decode/decode_tensor_maps.h) with a fresh tensor map (the first load also
// fetches the map), then another box far away, the same box again (L2), and a cp.async.bulk
// copy of 2 KB (no map) from a third place; once without and once after prefetch.tensormap.
//
// Last, bursts: one thread of each CTA issues N such boxes back to back (N = 1 .. 32, distinct
// tokens) on one mbarrier, on 1 and on 132 CTAs at once: the issue time and the time until all
// have landed, medians over the CTAs (decode's first stages land 2-3 us after a CTA starts:
// bench/RESULTS.md, sessions 18 and 19).
//
// Usage: [FLARE_BENCH_FLUSH=read] probe_load_latency [--trials N]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "bench/common/bench_common.h"
#include "src/common/bulk_copy.h"
#include "src/decode/decode_tensor_maps.h"

namespace {

constexpr int kSteps = 6;
constexpr long long kMiB = 1 << 20;
// Byte offsets of the chain's loads from the trial's base (see the header).
__constant__ long long kOffsets[kSteps] = {0, 64 * 1024, 0, 2 * kMiB, 64 * kMiB, 512 * kMiB};
const char* kNames[kSteps] = {"first touch of a page", "same page, other line", "first line again (L2)",
                              "page +2 MiB", "page +64 MiB", "page +512 MiB"};

__global__ void load_chain(const char* base, unsigned mask, long long* cycles, unsigned long long* ns,
                           unsigned* sink) {
  unsigned carry = 0;  // each address depends on the previous load's value (zero at run time)
  unsigned long long g0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(g0));
  for (int i = 0; i < kSteps; ++i) {
    const char* p = base + kOffsets[i] + (carry & mask);
    const long long t0 = clock64();
    unsigned a, b, c, d;
    asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(a), "=r"(b), "=r"(c), "=r"(d) : "l"(p));
    carry = a + b + c + d;  // used before the clock is read: the stamp waits for the data
    asm volatile("" : "+r"(carry));
    const long long t1 = clock64() + (carry & mask);
    cycles[i] = t1 - t0;
  }
  unsigned long long g1;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(g1));
  *ns = g1 - g0;
  *sink = carry;
}

constexpr int kTmaSteps = 4;
const char* kTmaNames[kTmaSteps] = {"tensor box, first (map too)", "tensor box, far away", "tensor box again (L2)",
                                    "bulk copy 2 KB, no map"};

// `token0` and `seq` pick the first box; the second is 32768 tokens further, the bulk copy reads
// `bulk_src`. Cycles from each issue to its mbarrier's completion.
__global__ void tma_chain(const __grid_constant__ CUtensorMap map, int token0, int seq, const char* bulk_src,
                          bool prefetch, long long* cycles) {
  __shared__ alignas(1024) unsigned char box[4096];
  __shared__ uint64_t bar;
  if (threadIdx.x != 0) return;
  flare::sm90::mbar_init(&bar, 1);
  flare::sm90::mbar_init_fence();
  if (prefetch) {
    flare::sm90::prefetch_tensor_map(&map);
    const long long t = clock64();
    while (clock64() - t < 20000) {  // 10 us: the prefetch has landed
    }
  }
  const int tokens[3] = {token0, token0 + 32768, token0 + 32768};
  for (int i = 0; i < kTmaSteps; ++i) {
    const long long t0 = clock64();
    flare::sm90::mbar_arrive_expect_tx(&bar, 2048);
    if (i < 3)
      flare::sm90::tma_load_4d(box, &map, 0, 0, tokens[i], seq, &bar);
    else
      flare::sm90::bulk_copy_g2s(box, bulk_src, 2048, &bar);
    flare::sm90::mbar_wait(&bar, i & 1);
    cycles[i] = clock64() - t0;
  }
}

// Each CTA: `boxes` boxes of 16 tokens from its own region, then the wait; out[2 c] = cycles to
// issue them all, out[2 c + 1] = cycles until all landed.
__global__ void tma_burst(const __grid_constant__ CUtensorMap map, int boxes, long long* out) {
  extern __shared__ __align__(1024) unsigned char boxes_smem[];
  __shared__ uint64_t bar;
  if (threadIdx.x != 0) return;
  flare::sm90::mbar_init(&bar, 1);
  flare::sm90::mbar_init_fence();
  flare::sm90::prefetch_tensor_map(&map);
  const int seq = blockIdx.x % 8, token0 = (blockIdx.x * 16 * 37) % 32768;
  const long long t0 = clock64();
  flare::sm90::mbar_arrive_expect_tx(&bar, 2048u * boxes);
  for (int i = 0; i < boxes; ++i)
    flare::sm90::tma_load_4d(boxes_smem + 2048 * i, &map, 0, 0, token0 + 16 * i, seq, &bar);
  const long long t1 = clock64();
  flare::sm90::mbar_wait(&bar, 0);
  const long long t2 = clock64();
  out[2 * blockIdx.x] = t1 - t0;
  out[2 * blockIdx.x + 1] = t2 - t0;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  int trials = 31;
  for (int i = 1; i < argc; ++i)
    if (std::strcmp(argv[i], "--trials") == 0 && i + 1 < argc) trials = std::atoi(argv[++i]);
  flare::bench::require_cuda_device_or_exit();
  cudaStream_t stream;
  FLARE_BENCH_CHECK(cudaStreamCreate(&stream));
  const size_t bytes = size_t{1} << 30;
  const long long span = 600 * kMiB;  // the chain reaches base + 512 MiB + a line
  char* buf = nullptr;
  long long* d_cycles = nullptr;
  unsigned long long* d_ns = nullptr;
  unsigned* d_sink = nullptr;
  FLARE_BENCH_CHECK(cudaMalloc(&buf, bytes));
  FLARE_BENCH_CHECK(cudaMemset(buf, 0, bytes));
  FLARE_BENCH_CHECK(cudaMalloc(&d_cycles, kSteps * sizeof(long long)));
  FLARE_BENCH_CHECK(cudaMalloc(&d_ns, sizeof(unsigned long long)));
  FLARE_BENCH_CHECK(cudaMalloc(&d_sink, sizeof(unsigned)));
  int clock_khz = 0, dev = 0;
  FLARE_BENCH_CHECK(cudaGetDevice(&dev));
  FLARE_BENCH_CHECK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, dev));
  const char* flush_env = std::getenv("FLARE_BENCH_FLUSH");
  const bool read_flush = flush_env != nullptr && std::strcmp(flush_env, "read") == 0;
  const char* modes[] = {read_flush ? "after a read flush" : "after a rewrite flush", "no flush"};
  std::printf("load latency, one thread, dependent 16-byte ld.global.cg; median of %d trials (cycles; us at %.0f MHz)\n",
              trials, clock_khz / 1000.0);
  for (int mode = 0; mode < 2; ++mode) {
    std::vector<double> cyc[kSteps], total;
    for (int t = 0; t < trials; ++t) {
      // A new base each trial, 2 MiB aligned plus a line, far from the previous trial's lines.
      const long long off = (static_cast<long long>(t) * 37 % 200) * 2 * kMiB + 128;
      if (off + span > static_cast<long long>(bytes)) continue;
      if (mode == 0) flare::bench::flush_l2(stream);
      load_chain<<<1, 1, 0, stream>>>(buf + off, 0u, d_cycles, d_ns, d_sink);
      FLARE_BENCH_CHECK(cudaGetLastError());
      long long c[kSteps];
      unsigned long long ns = 0;
      FLARE_BENCH_CHECK(cudaMemcpyAsync(c, d_cycles, sizeof c, cudaMemcpyDeviceToHost, stream));
      FLARE_BENCH_CHECK(cudaMemcpyAsync(&ns, d_ns, sizeof ns, cudaMemcpyDeviceToHost, stream));
      FLARE_BENCH_CHECK(cudaStreamSynchronize(stream));
      if (t == 0) continue;  // the first trial also pays the kernel's own first launch
      for (int i = 0; i < kSteps; ++i) cyc[i].push_back(static_cast<double>(c[i]));
      total.push_back(static_cast<double>(ns));
    }
    std::printf("%s (chain %.2f us by globaltimer)\n", modes[mode], median(total) / 1000.0);
    for (int i = 0; i < kSteps; ++i)
      std::printf("  %-24s %7.0f cycles  %6.2f us\n", kNames[i], median(cyc[i]), median(cyc[i]) / (clock_khz / 1000.0));
  }
  // The copy engines: a map over the whole buffer as a [8 sequences, 65536 tokens, 8 heads, 128]
  // bf16 cache (2 KB boxes of 64 columns x 1 head x 16 tokens).
  flare::decode::CacheMapKey key;
  key.base = buf;
  key.head_dim = 128;
  key.heads = 8;
  key.extent_1 = 65536;
  key.extent_0 = 8;
  key.stride_h = 128;
  key.stride_tok = 128 * 8;
  key.stride_0 = 128 * 8 * 65536;
  key.box_heads = 1;
  key.elem_bytes = 2;
  key.bf16 = true;
  CUtensorMap map;
  if (!flare::decode::cache_tensor_map(key, &map)) {
    std::printf("tensor map: the driver refused it\n");
    return 1;
  }
  for (int prefetch = 0; prefetch < 2; ++prefetch) {
    std::vector<double> cyc[kTmaSteps];
    for (int t = 0; t < trials; ++t) {
      const int seq = t % 8, token0 = (t * 997) % 30000;
      const char* bulk_src = buf + ((static_cast<long long>(t) * 7919 % 4000) + 4000) * 65536 % (bytes - 4096);
      flare::bench::flush_l2(stream);
      tma_chain<<<1, 32, 0, stream>>>(map, token0, seq, bulk_src, prefetch != 0, d_cycles);
      FLARE_BENCH_CHECK(cudaGetLastError());
      long long c[kTmaSteps];
      FLARE_BENCH_CHECK(cudaMemcpyAsync(c, d_cycles, sizeof c, cudaMemcpyDeviceToHost, stream));
      FLARE_BENCH_CHECK(cudaStreamSynchronize(stream));
      if (t == 0) continue;
      for (int i = 0; i < kTmaSteps; ++i) cyc[i].push_back(static_cast<double>(c[i]));
    }
    std::printf("copy engines after the flush, %s prefetch.tensormap\n", prefetch ? "after" : "without");
    for (int i = 0; i < kTmaSteps; ++i)
      std::printf("  %-28s %7.0f cycles  %6.2f us\n", kTmaNames[i], median(cyc[i]), median(cyc[i]) / (clock_khz / 1000.0));
  }
  // Bursts of boxes.
  constexpr int kMaxBoxes = 32, kMaxCtas = 132;
  FLARE_BENCH_CHECK(cudaFuncSetAttribute(tma_burst, cudaFuncAttributeMaxDynamicSharedMemorySize, 2048 * kMaxBoxes));
  long long* d_burst = nullptr;
  FLARE_BENCH_CHECK(cudaMalloc(&d_burst, 2 * kMaxCtas * sizeof(long long)));
  std::printf("bursts of 2 KB tensor boxes after the flush (medians over CTAs and trials; cycles, us)\n");
  for (int ctas : {1, kMaxCtas})
    for (int boxes : {1, 4, 16, 32}) {
      std::vector<double> issue, land;
      for (int t = 0; t < trials; ++t) {
        flare::bench::flush_l2(stream);
        tma_burst<<<ctas, 32, 2048 * boxes, stream>>>(map, boxes, d_burst);
        FLARE_BENCH_CHECK(cudaGetLastError());
        std::vector<long long> h(2 * ctas);
        FLARE_BENCH_CHECK(cudaMemcpyAsync(h.data(), d_burst, h.size() * sizeof(long long), cudaMemcpyDeviceToHost, stream));
        FLARE_BENCH_CHECK(cudaStreamSynchronize(stream));
        if (t == 0) continue;
        for (int c = 0; c < ctas; ++c) {
          issue.push_back(static_cast<double>(h[2 * c]));
          land.push_back(static_cast<double>(h[2 * c + 1]));
        }
      }
      const double mhz = clock_khz / 1000.0;
      std::printf("  %3d CTAs x %2d boxes: issued %6.0f (%5.2f us), all landed %6.0f (%5.2f us)\n", ctas, boxes,
                  median(issue), median(issue) / mhz, median(land), median(land) / mhz);
    }
  return 0;
}
