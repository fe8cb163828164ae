// How fast each load path the kernels use streams a buffer from HBM, with no math behind it
// (issue 7: at batch 8 and 65536 keys decode's kernels read at about 90 % of the DRAM peak with
// bulk copies where cuDNN's cp.async kernel reads at 96 %: bench/RESULTS.md, session 42). Every
// mode reads the same buffer (2 GiB by default) exactly once, each CTA a contiguous slice of it,
// L2 flushed before each sample (the harness's flush), CUDA events, median of the samples; GB/s of
// bytes read, and the fraction of the device-to-device copy's read + write bandwidth measured in
// the same run.
//
//   ldg      every thread loads 16-byte words (ld.global.nc.v4), four in flight, and folds them
//   cp.async every thread copies 16-byte pieces of a stage into a shared ring (cp.async.cg, kStages
//            stages of `stage` bytes, one commit group a stage), reads its own words back, and
//            refills the stage it has left
//   bulk     one producer warp copies a stage in `piece`-byte cp.async.bulk copies (one lane per
//            piece, completing on the stage's mbarrier), eight consumer warps wait for it and release
//            it (decode_bulk_kernel's pipeline: 2 KB pieces, 64 KB stages, 3 stages); "K|V": each
//            stage half from each of two regions, as decode's K and V caches
//   boxes    the producer's lane 0 loads a stage as TMA tensor boxes of the key-group decode
//            kernel's shape (8 heads x 16 tokens x the 64-column blocks its boxes hold, 128-byte
//            swizzled, a long walk's L2 promotion), token-major or head-major maps; "box shapes":
//            other shapes, swizzles and promotions through maps of the probe's own
//
// Usage: probe_stream_bandwidth [--gib N] [--repeats N] [--fill constant|random]
//   --fill: the buffer's contents (default constant, a 0x5a byte; random: normal bf16 values,
//   as bench_decode fills its caches)
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <initializer_list>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "bench/common/bench_common.h"
#include "src/common/bulk_copy.h"
#include "src/decode/decode_tensor_maps.h"

namespace {

using flare::sm90::bulk_copy_g2s;
using flare::sm90::mbar_arrive;
using flare::sm90::mbar_arrive_expect_tx;
using flare::sm90::mbar_init;
using flare::sm90::mbar_init_fence;
using flare::sm90::mbar_wait;
using flare::sm90::prefetch_tensor_map;
using flare::sm90::tma_load_5d;

// Folds a word into the accumulator the kernels keep live (written out only if it matches a value
// it never takes, so the loads cannot be dropped).
__device__ __forceinline__ uint32_t fold(uint32_t acc, uint4 v) { return acc ^ v.x ^ (v.y << 1) ^ (v.z << 2) ^ (v.w << 3); }

__global__ void ldg_stream(const uint4* src, int64_t words_per_cta, uint32_t* sink) {
  const uint4* base = src + blockIdx.x * words_per_cta;
  uint32_t acc = 0;
  const int64_t stride = blockDim.x;
  int64_t i = threadIdx.x;
  for (; i + 3 * stride < words_per_cta; i += 4 * stride) {
    uint4 v[4];
#pragma unroll
    for (int k = 0; k < 4; ++k)
      asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
                   : "=r"(v[k].x), "=r"(v[k].y), "=r"(v[k].z), "=r"(v[k].w)
                   : "l"(base + i + k * stride));
#pragma unroll
    for (int k = 0; k < 4; ++k) acc = fold(acc, v[k]);
  }
  for (; i < words_per_cta; i += stride) acc = fold(acc, base[i]);
  if (acc == 0x9e3779b9u) sink[0] = acc;
}

template <int kStages>
__global__ void cp_async_stream(const char* src, int64_t bytes_per_cta, int stage_bytes, uint32_t* sink) {
  extern __shared__ __align__(128) char ring[];
  const char* base = src + blockIdx.x * bytes_per_cta;
  const int tiles = static_cast<int>(bytes_per_cta / stage_bytes);
  auto issue = [&](int tile) {
    if (tile < tiles) {
      char* dst = ring + (tile % kStages) * stage_bytes;
      const char* s = base + int64_t{tile} * stage_bytes;
      for (int off = threadIdx.x * 16; off < stage_bytes; off += blockDim.x * 16) {
        const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(dst + off));
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d), "l"(s + off));
      }
    }
    asm volatile("cp.async.commit_group;\n" ::);
  };
  for (int t = 0; t < kStages - 1; ++t) issue(t);
  uint32_t acc = 0;
  for (int t = 0; t < tiles; ++t) {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(kStages - 2));
    const uint4* stage = reinterpret_cast<const uint4*>(ring + (t % kStages) * stage_bytes);
    for (int w = threadIdx.x; w < stage_bytes / 16; w += blockDim.x) acc = fold(acc, stage[w]);  // its own copies
    __syncthreads();  // every thread is done with the stage refilled next (t - 1's)
    issue(t + kStages - 1);
  }
  if (acc == 0x9e3779b9u) sink[0] = acc;
}

constexpr int kBulkConsumerWarps = 8;
constexpr int kBulkMaxStages = 8;
// The mbarrier rings of bulk_stream and box_stream: one producer arrival a stage filled, one
// arrival a consumer warp a stage released; the block's threads see them initialized on return.
__device__ __forceinline__ void init_ring(uint64_t* full, uint64_t* empty, int stages) {
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], kBulkConsumerWarps);
    }
    mbar_init_fence();
  }
  __syncthreads();
}

// The consumer warps of the mbarrier rings (bulk_stream, box_stream): wait for each stage, fold a
// word of it, release it.
__device__ __forceinline__ void drain_ring(const char* ring, int ring_stage, int tiles, int stages, uint64_t* full,
                                           uint64_t* empty, uint32_t* sink) {
  uint32_t acc = 0;
  for (int t = 0; t < tiles; ++t) {
    const int s = t % stages;
    mbar_wait(&full[s], (t / stages) & 1);
    acc = fold(acc, reinterpret_cast<const uint4*>(ring + s * ring_stage)[threadIdx.x]);
    __syncwarp();
    if (threadIdx.x % 32 == 0) mbar_arrive(&empty[s]);
  }
  if (acc == 0x9e3779b9u) sink[0] = acc;
}

// regions > 1: the buffer is `regions` equal parts (decode's K and V caches) and every stage takes
// stage_bytes / regions from the CTA's slice of each, as a decode stage takes 16 keys of K and V.
__global__ void bulk_stream(const char* src, int64_t bytes_per_cta, int stage_bytes, int stages, int piece,
                            int regions, int dst_pad, uint32_t* sink) {
  extern __shared__ __align__(128) char ring[];
  __shared__ __align__(8) uint64_t full[kBulkMaxStages], empty[kBulkMaxStages];
  const int64_t region_bytes = bytes_per_cta / regions * gridDim.x;  // one part of the buffer
  const int region_stage = stage_bytes / regions;                   // a stage's bytes from each part
  const char* base = src + blockIdx.x * (bytes_per_cta / regions);
  const int tiles = static_cast<int>(bytes_per_cta / stage_bytes);
  // dst_pad: each piece lands dst_pad bytes after the previous one ends (decode's padded rows)
  const int ring_stage = stage_bytes + stage_bytes / piece * dst_pad;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  init_ring(full, empty, stages);
  if (warp == kBulkConsumerWarps) {  // the producer warp
    for (int t = 0; t < tiles; ++t) {
      const int s = t % stages;
      if (t >= stages) mbar_wait(&empty[s], ((t / stages) + 1) & 1);
      if (lane == 0) mbar_arrive_expect_tx(&full[s], static_cast<uint32_t>(stage_bytes));
      __syncwarp();
      for (int off = lane * piece; off < stage_bytes; off += 32 * piece) {
        const int r = off / region_stage, in = off % region_stage;
        bulk_copy_g2s(ring + s * ring_stage + off / piece * (piece + dst_pad),
                      base + r * region_bytes + int64_t{t} * region_stage + in, static_cast<uint32_t>(piece), &full[s]);
      }
    }
    return;
  }
  drain_ring(ring, ring_stage, tiles, stages, full, empty, sink);
}

// TMA tensor boxes: the buffer is K of one sequence, [tokens, 8 heads, 128 columns] bf16 (2 KB a
// token), and a 64 KB stage (32 tokens) is `boxes` boxes of a 5-D map; box b's coordinates are
// coord[b], its token coordinate (dimension tok_dim) advanced by the stage's first token. The
// key-group kernel's loads at 8 heads a CTA come through the map decode's launcher makes
// (cache_tensor_map); the box-shape rows through maps of other shapes, swizzles and L2 promotions.
constexpr int kBoxStageBytes = 64 << 10;
constexpr int kBoxStageTokens = kBoxStageBytes / 2048;
struct BoxShape {
  int boxes = 0, tok_dim = 0;
  int coord[4][5] = {};
};
__global__ void box_stream(const __grid_constant__ CUtensorMap map, BoxShape shape, int tokens_per_cta, int stages,
                           uint32_t* sink) {
  extern __shared__ __align__(1024) char box_raw[];
  char* const ring = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(box_raw) + 1023) & ~uintptr_t{1023});
  __shared__ __align__(8) uint64_t full[kBulkMaxStages], empty[kBulkMaxStages];
  const int tiles = tokens_per_cta / kBoxStageTokens;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (threadIdx.x == 0) prefetch_tensor_map(&map);
  init_ring(full, empty, stages);
  if (warp == kBulkConsumerWarps) {  // the producer warp: lane 0 issues the boxes
    if (lane == 0) {
      for (int t = 0; t < tiles; ++t) {
        const int s = t % stages;
        if (t >= stages) mbar_wait(&empty[s], ((t / stages) + 1) & 1);
        mbar_arrive_expect_tx(&full[s], static_cast<uint32_t>(kBoxStageBytes));
        for (int b = 0; b < shape.boxes; ++b) {
          int c[5];
          for (int k = 0; k < 5; ++k) c[k] = shape.coord[b][k];
          c[shape.tok_dim] += blockIdx.x * tokens_per_cta + t * kBoxStageTokens;
          tma_load_5d(ring + s * kBoxStageBytes + b * (kBoxStageBytes / shape.boxes), &map, c[0], c[1], c[2], c[3],
                      c[4], &full[s]);
        }
      }
    }
    return;
  }
  drain_ring(ring, kBoxStageBytes, tiles, stages, full, empty, sink);
}

BoxShape box_shape(int boxes, int tok_dim, std::initializer_list<std::array<int, 5>> coords) {
  BoxShape b;
  b.boxes = boxes, b.tok_dim = tok_dim;
  int i = 0;
  for (const auto& c : coords) {
    for (int k = 0; k < 5; ++k) b.coord[i][k] = c[k];
    ++i;
  }
  return b;
}

}  // namespace

int main(int argc, char** argv) {
  int64_t gib = 2;
  int repeats = 10;
  bool random_fill = false;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--gib")) gib = std::atoll(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--repeats")) repeats = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--fill")) random_fill = !std::strcmp(argv[i + 1], "random");
  }
  flare::bench::require_cuda_device_or_exit();
  cudaStream_t stream;
  FLARE_BENCH_CHECK(cudaStreamCreate(&stream));
  int dev = 0, sms = 0, major = 0;
  FLARE_BENCH_CHECK(cudaGetDevice(&dev));
  FLARE_BENCH_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  FLARE_BENCH_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  const double copy_gbps = flare::bench::measure_copy_bandwidth_gbps(stream);
  const int64_t bytes = gib << 30;
  char* buf = nullptr;
  uint32_t* sink = nullptr;
  FLARE_BENCH_CHECK(cudaMalloc(&buf, bytes));
  FLARE_BENCH_CHECK(cudaMalloc(&sink, sizeof(uint32_t)));
  FLARE_BENCH_CHECK(cudaMemset(buf, 0x5a, bytes));
  if (random_fill) {
    flare::bench::fill_normal_bf16(buf, bytes / 2, 1, stream);
    FLARE_BENCH_CHECK(cudaStreamSynchronize(stream));
  }
  std::printf("%s: %d SMs; device-to-device copy %.0f GB/s (read + write); %lld GiB (%s) read once a sample, "
              "L2 flushed, median of %d\n",
              flare::bench::device_tags()["device"].c_str(), sms, copy_gbps, static_cast<long long>(gib),
              random_fill ? "random" : "constant", repeats);

  // Times `launch(ctas)` over a buffer split into `ctas` slices of a multiple of `granule` bytes.
  auto measure = [&](const std::string& name, int ctas, int64_t granule, auto&& launch) {
    const int64_t per_cta = bytes / ctas / granule * granule;
    flare::bench::TimingOptions o;
    o.warmup = 2;
    o.repeats = repeats;
    const flare::bench::Timing t = flare::bench::time_kernel([&](cudaStream_t st) { launch(st, ctas, per_cta); }, o, stream);
    const double gbps = static_cast<double>(per_cta) * ctas / (t.median_ms * 1e6);
    std::printf("  %-44s %5d CTAs  %8.1f us  %6.0f GB/s  %.3f of the copy\n", name.c_str(), ctas, t.median_ms * 1e3,
                gbps, gbps / copy_gbps);
  };

  for (int per_sm : {4, 8})
    measure("ldg, 256 threads, 4 x 16 B in flight", per_sm * sms, 16 * 256 * 4, [&](cudaStream_t st, int ctas, int64_t per) {
      ldg_stream<<<ctas, 256, 0, st>>>(reinterpret_cast<const uint4*>(buf), per / 16, sink);
    });

  struct CpAsyncCase {
    int threads, stage, per_sm;
  };
  for (const CpAsyncCase c : {CpAsyncCase{128, 32 << 10, 1}, CpAsyncCase{128, 32 << 10, 2}, CpAsyncCase{256, 32 << 10, 2},
                              CpAsyncCase{128, 16 << 10, 2}}) {
    const int smem = 3 * c.stage;
    FLARE_BENCH_CHECK(cudaFuncSetAttribute(cp_async_stream<3>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    const std::string name = "cp.async, " + std::to_string(c.threads) + " threads, 3 x " + std::to_string(c.stage >> 10) + " KB";
    measure(name, c.per_sm * sms, c.stage, [&](cudaStream_t st, int ctas, int64_t per) {
      cp_async_stream<3><<<ctas, c.threads, smem, st>>>(buf, per, c.stage, sink);
    });
  }

  if (major < 9) return 0;
  struct BulkCase {
    int stage, stages, piece, ctas, regions, dst_pad = 0;
  };
  const int ctas_128 = std::min(128, sms);
  // The last rows: decode's grids at batch 8 and 65536 keys (K and V as two regions): the head-warp
  // kernel's 128 CTAs (16 splits), the key-group kernel's 40 (5 splits of 8 heads), and one region
  // at the same CTA counts.
  for (const BulkCase c : {BulkCase{64 << 10, 3, 2048, ctas_128, 1}, BulkCase{64 << 10, 3, 2048, sms, 1},
                           BulkCase{64 << 10, 3, 512, sms, 1}, BulkCase{64 << 10, 3, 8192, sms, 1},
                           BulkCase{32 << 10, 6, 1024, sms, 1}, BulkCase{32 << 10, 3, 1024, 2 * sms, 1},
                           BulkCase{16 << 10, 6, 512, 2 * sms, 1}, BulkCase{64 << 10, 3, 2048, ctas_128, 2},
                           BulkCase{64 << 10, 3, 2048, 40, 1}, BulkCase{64 << 10, 3, 2048, 40, 2},
                           BulkCase{32 << 10, 3, 1024, 2 * ctas_128, 2},
                           BulkCase{64 << 10, 3, 2048, ctas_128, 2, 16}}) {
    const int smem = c.stages * (c.stage + c.stage / c.piece * c.dst_pad);
    FLARE_BENCH_CHECK(cudaFuncSetAttribute(bulk_stream, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    const std::string name = "bulk, " + std::to_string(c.stages) + " x " + std::to_string(c.stage >> 10) + " KB, " +
                             std::to_string(c.piece) + " B pieces" + (c.regions > 1 ? ", K|V" : "") +
                             (c.dst_pad > 0 ? ", +" + std::to_string(c.dst_pad) + " B apart" : "");
    measure(name, c.ctas, c.stage, [&](cudaStream_t st, int ctas, int64_t per) {
      bulk_stream<<<ctas, 32 * (kBulkConsumerWarps + 1), smem, st>>>(buf, per, c.stage, c.stages, c.piece, c.regions,
                                                                   c.dst_pad, sink);
    });
  }

  const int box_smem = 3 * kBoxStageBytes + 1024;
  FLARE_BENCH_CHECK(cudaFuncSetAttribute(box_stream, cudaFuncAttributeMaxDynamicSharedMemorySize, box_smem));
  auto measure_boxes = [&](const std::string& name, int ctas, const CUtensorMap& map, const BoxShape& shape) {
    measure(name, ctas, kBoxStageBytes, [&](cudaStream_t st, int n, int64_t per) {
      box_stream<<<n, 32 * (kBulkConsumerWarps + 1), box_smem, st>>>(map, shape, static_cast<int>(per / 2048), 3, sink);
    });
  };

  // The key-group kernel's boxes, both dimension orders: the buffer mapped as decode's launcher maps
  // a cache (cache_tensor_map), a long walk's L2 promotion; row boxes (both column blocks, 2 a
  // stage) or one column block a box (4).
  for (bool head_major : {false, true}) {
    flare::decode::CacheMapKey key;
    key.base = buf, key.head_dim = 128, key.heads = 8, key.extent_1 = bytes / 2048, key.extent_0 = 1;
    key.stride_h = 128, key.stride_tok = 1024, key.stride_0 = key.extent_1 * 1024;
    key.box_heads = 8, key.elem_bytes = 2, key.head_major = head_major, key.bf16 = true;
    key.l2_promotion_bytes = flare::decode::cache_map_l2_promotion_bytes(int64_t{1} << 30);
    CUtensorMap map;
    if (!flare::decode::cache_tensor_map(key, &map)) {
      std::printf("  boxes: no %s map (the driver's encoder refused it or is missing)\n",
                  head_major ? "head-major" : "token-major");
      continue;
    }
    const int tok_dim = head_major ? 1 : 2;
    auto at = [&](int tok, int cb) {
      std::array<int, 5> c = {0, 0, 0, cb, 0};
      c[tok_dim] = tok;
      return c;
    };
    const BoxShape shape = flare::decode::kCacheRowBoxes
                               ? box_shape(2, tok_dim, {at(0, 0), at(16, 0)})
                               : box_shape(4, tok_dim, {at(0, 0), at(0, 1), at(16, 0), at(16, 1)});
    for (int ctas : {ctas_128, sms})
      measure_boxes(std::string(flare::decode::kCacheRowBoxes ? "TMA row boxes 8 heads x 16 tokens, "
                                                              : "TMA boxes 64 x 8 heads x 16 tokens, ") +
                        (head_major ? "head" : "token") + "-major, 3 x 64 KB",
                    ctas, map, shape);
  }

  // Box shapes: the buffer [tokens, 8 heads, 128] bf16 through 5-D maps of the probe's own (the
  // last dimension of extent 1 where the shape needs four).
  {
    const PFN_cuTensorMapEncodeTiled_v12000 encode = flare::decode::tensor_map_encoder();
    const cuuint64_t tokens = static_cast<cuuint64_t>(bytes / 2048), all = static_cast<cuuint64_t>(bytes);
    struct ShapeCase {
      const char* name;
      const cuuint64_t* dims;     // 5 extents, the dimension order below
      const cuuint64_t* strides;  // bytes, dimensions 1-4
      cuuint32_t box[5];
      CUtensorMapSwizzle swizzle;
      CUtensorMapL2promotion promotion;
      BoxShape shape;
    };
    const auto swz = CU_TENSOR_MAP_SWIZZLE_128B, none = CU_TENSOR_MAP_SWIZZLE_NONE;
    const auto p256 = CU_TENSOR_MAP_L2_PROMOTION_L2_256B, p128 = CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
               pnone = CU_TENSOR_MAP_L2_PROMOTION_NONE;
    const BoxShape four = box_shape(4, 1, {{0, 0, 0, 0, 0}, {64, 0, 0, 0, 0}, {0, 16, 0, 0, 0}, {64, 16, 0, 0, 0}});
    const BoxShape two_cb = box_shape(2, 1, {{0, 0, 0, 0, 0}, {64, 0, 0, 0, 0}});
    const BoxShape two_tok = box_shape(2, 1, {{0, 0, 0, 0, 0}, {0, 16, 0, 0, 0}});
    const BoxShape two_tok_d2 = box_shape(2, 2, {{0, 0, 0, 0, 0}, {0, 0, 16, 0, 0}});
    // (d, token, head): the key-group kernel's head-major boxes per column block, 16 tokens (a
    // sub-tile) and 32
    const cuuint64_t dth[5] = {128, tokens, 8, 1, 1}, dth_s[4] = {2048, 256, all, all};
    // (d 64, token, column block, head): both halves of a row in one box
    const cuuint64_t dtch[5] = {64, tokens, 2, 8, 1}, dtch_s[4] = {2048, 128, 256, all};
    // (d, head, token): unswizzled whole rows, 32 KB contiguous a box
    const cuuint64_t dht[5] = {128, 8, tokens, 1, 1}, dht_s[4] = {256, 2048, all, all};
    const ShapeCase cases[] = {
        {"swz (64, 16 tok, 8 h) x4, L2 256B", dth, dth_s, {64, 16, 8, 1, 1}, swz, p256, four},
        {"swz (64, 16 tok, 8 h) x4, L2 128B", dth, dth_s, {64, 16, 8, 1, 1}, swz, p128, four},
        {"swz (64, 16 tok, 8 h) x4, L2 none", dth, dth_s, {64, 16, 8, 1, 1}, swz, pnone, four},
        {"none (64, 16 tok, 8 h) x4, L2 128B", dth, dth_s, {64, 16, 8, 1, 1}, none, p128, four},
        {"swz (64, 32 tok, 8 h) x2, L2 256B", dth, dth_s, {64, 32, 8, 1, 1}, swz, p256, two_cb},
        {"swz (64, 32 tok, 8 h) x2, L2 128B", dth, dth_s, {64, 32, 8, 1, 1}, swz, p128, two_cb},
        {"swz (64, 16 tok, 2 cb, 8 h) x2, L2 128B", dtch, dtch_s, {64, 16, 2, 8, 1}, swz, p128, two_tok},
        {"swz (64, 32 tok, 2 cb, 8 h) x1, L2 128B", dtch, dtch_s, {64, 32, 2, 8, 1}, swz, p128,
         box_shape(1, 1, {{0, 0, 0, 0, 0}})},
        {"none (128, 8 h, 16 tok) x2, L2 256B", dht, dht_s, {128, 8, 16, 1, 1}, none, p256, two_tok_d2},
        {"none (128, 8 h, 16 tok) x2, L2 128B", dht, dht_s, {128, 8, 16, 1, 1}, none, p128, two_tok_d2},
    };
    for (const ShapeCase& c : cases) {
      CUtensorMap map;
      const cuuint32_t unit[5] = {1, 1, 1, 1, 1};
      if (encode == nullptr ||
          encode(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 5, buf, c.dims, c.strides, c.box, unit,
                 CU_TENSOR_MAP_INTERLEAVE_NONE, c.swizzle, c.promotion,
                 CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS) {
        std::printf("  %s: the encoder refused it\n", c.name);
        continue;
      }
      measure_boxes(std::string("boxes ") + c.name, ctas_128, map, c.shape);
    }
  }
  return 0;
}
