// Decode attention kernels (sm_80+, mma.sync): a few query tokens per sequence against a long
// contiguous or paged KV cache. One kernel body serves both plans of include/flare/decode_plan.h:
//   standard (kSplit = false): one CTA per (sequence, KV head, row block) walks all the keys the
//     sequence attends and writes `out` / `lse`;
//   split-KV (kSplit = true): num_splits CTAs per (sequence, KV head, row block), each over one
//     chunk of keys (the planner's rule), write fp32 partial outputs and LSEs to the workspace;
//     the combine kernel (decode_kernel.cu) merges them by LSE.
//
// GQA packing. The group = heads_q / heads_kv query heads of a KV head and the q_len new tokens
// form the packed query rows of one CTA, row = token * group + head-in-group, so each K/V byte
// is read once for all of them. A CTA holds up to kRowsPerCta (64) rows; more rows (large groups
// with several tokens) take several row blocks, which re-read K/V (correct, not fast).
//
// Why mma.sync, not CUDA-core dot products. With 4 packed rows (heads 32/8, one token) the 16-row
// MMA wastes 3/4 of its work, yet the tensor cores stay far below the K/V stream: a 16-key step
// of head dim 128 is 32 MMAs per 8 KB of K/V, a few percent of an H100 SM's MMA rate at full
// memory bandwidth. CUDA cores would need rows x 2 x head_dim FMAs per key plus shuffle
// reductions, which stops being free at 16+ rows (speculative decoding with GQA: 8 tokens x
// group 8 = 64 rows) where the same MMAs simply fill up.
//
// Memory path. All 128 threads stream kBlockN-key tiles of K and V into shared memory with
// 16-byte cp.async (each key row coalesced; paged caches look up each row's page), kStages - 1
// tiles ahead of the compute. Keys past the sequence's end are zero-filled, never read.
//
// Work split inside the CTA. With m = ceil(rows / 16) rounded to 1, 2 or 4 m-tiles, the 4 warps
// form m row groups x (4 / m) key groups: warp (mt, kg) owns rows [16 mt, 16 mt + 16) and the
// 16-key chunks c of the key walk with c % (4 / m) == kg. Each warp keeps its own online-softmax
// state (exp2, fp32) and O in registers; at the end the key groups merge through shared memory
// (the K/V buffers, then free) and all threads write the rows with 16-byte stores.
//
// Masks (one mechanism): a 16-key chunk is EMPTY for a warp (skipped), FULL (no element mask) or
// PARTIAL (element predicate lo(row) <= key <= last(row)), where for query token t of a sequence
// with L keys: last = L - q_len + t (causal) or L - 1, and lo = last - window_left (window) or 0.
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cmath>
#include <cstdint>
#include <string>

#include "flare/status.h"
#include "src/attention/portable/warp_mma.h"
#include "src/common/cuda_check.h"
#include "src/common/grid_dependency.h"

namespace flare::decode {

// Packed query rows per CTA (4 warps x one 16-row m-tile); more rows take more row blocks.
inline constexpr int kDecodeRowsPerCta = 64;

// Host arguments resolved once (decode_kernel.cu): strides in elements, scale in log2 units.
struct DecodeKernelParams {
  const void* q = nullptr;       // [batch, q_len, heads_q, head_dim]
  // Contiguous [batch, max_cache_len, heads_kv, d] or paged [num_pages, page_size, heads_kv, d].
  const void* k = nullptr;
  const void* v = nullptr;
  const int32_t* page_table = nullptr;  // null: contiguous cache
  const int32_t* cache_seqlens = nullptr;
  void* out = nullptr;           // like q
  float* lse = nullptr;          // optional, contiguous [batch, heads_q, q_len]
  float* partial_out = nullptr;  // split-KV: [batch, heads_q, q_len, num_splits, head_dim]
  float* partial_lse = nullptr;  // split-KV: [batch, heads_q, q_len, num_splits]
  // Split-KV with the in-kernel combine (key-group kernel only): [batch, heads_kv] arrival counters,
  // 0 at the start of the call (decode_schedule.h); null: the combine is a separate kernel.
  int* counters = nullptr;
  // Split-KV with the cluster combine (key-group kernel only, DecodeCombine::kCluster): the
  // num_splits CTAs of a (sequence, head block) are one cluster and merge through shared memory.
  bool cluster_combine = false;
  // The sm_90 engines' K/V copies carry an evict-first L2 policy (DecodePlan::l2_evict_first).
  bool l2_evict_first = false;
  unsigned long long* timeline = nullptr;  // FLARE_DECODE_TIMELINE builds (decode_timeline.h)
  // The caches' first two extents: (batch, max_cache_len) contiguous, (num_pages, page_size) paged.
  int64_t k_extent_0 = 0, k_extent_1 = 0, v_extent_0 = 0, v_extent_1 = 0;

  int64_t q_stride_b = 0, q_stride_t = 0, q_stride_h = 0;
  int64_t out_stride_b = 0, out_stride_t = 0, out_stride_h = 0;
  // Dim 0 is the sequence (contiguous) or the page (paged); dim 1 the token (within the page).
  int64_t k_stride_0 = 0, k_stride_tok = 0, k_stride_h = 0;
  int64_t v_stride_0 = 0, v_stride_tok = 0, v_stride_h = 0;
  int64_t page_table_stride = 0;  // between sequences' rows of the page table
  int64_t seqlens_stride = 1;

  int batch = 0, q_len = 0, heads_q = 0, heads_kv = 0, group = 0;
  int rows = 0;        // group * q_len packed query rows per KV head
  int row_blocks = 0;  // ceil(rows / kRowsPerCta)
  int max_cache_len = 0;
  int page_shift = 0;  // log2(page_size) when paged
  bool causal = true;
  int window_left = -1;  // -1: unbounded (also when the window covers the whole cache)
  float scale_log2 = 0.f;  // softmax scale * log2(e)
  int num_splits = 1, kv_chunk = 0, kv_align = 64;
};

// A tile shape: 4 warps, kBlockN keys per pipeline stage, kStages shared K/V buffers.
template <int kHeadDim_, int kBlockN_, int kStages_>
struct DecodeTileConfig {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kWarps = 4;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kRowsPerCta = 16 * kWarps;  // 4 m-tiles when no key groups are needed
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kStages = kStages_;
  static constexpr int kChunk = 16;  // keys per warp step: one k-step of P V
  static constexpr int kChunksPerTile = kBlockN / kChunk;
  // Shared rows padded by 16 bytes: ldmatrix rows fall in distinct bank groups.
  static constexpr int kRowStride = kHeadDim + 8;
  static constexpr int kStageElems = 2 * kBlockN * kRowStride;  // K rows, then V rows
  // The key groups' merge reuses the K/V buffers: fp32 [kWarps][16][kMergeStride]. Padded by 8
  // floats so a warp's float2 stores of one fragment hit each bank at most twice (the minimum).
  static constexpr int kMergeStride = kHeadDim + 8;
  static constexpr int kLoadChunksPerRow = kHeadDim / 8;  // 16-byte pieces of a K/V row
  static constexpr int kLoadRowsPerPass = kThreads / kLoadChunksPerRow;

  template <typename T>
  static constexpr int smem_bytes() {
    return kStages * kStageElems * static_cast<int>(sizeof(T));
  }

  static_assert(kHeadDim % 64 == 0 && kHeadDim <= 256, "decode head dims: 64, 128, 256");
  static_assert(kRowsPerCta == kDecodeRowsPerCta, "the host sizes row blocks with kDecodeRowsPerCta");
  static_assert(kStages >= 2, "K/V are prefetched at least one tile ahead");
  static_assert(kBlockN % kChunk == 0, "a tile is whole 16-key chunks");
  static_assert(64 % kBlockN == 0, "split boundaries (multiples of kDecodeKvAlign = 64) are tile boundaries");
  static_assert(kThreads % kLoadChunksPerRow == 0 && kBlockN % kLoadRowsPerPass == 0,
                "the tile loads divide evenly over the threads");
  static_assert(kStages * kStageElems * 2 >= kWarps * 16 * kMergeStride * 4,
                "the merge buffer fits in the K/V buffers");
};

// Per head dim: about 16-34 KB of K/V per stage, 2-3 stages in flight while one is computed.
// (Untuned: the GPU session measures these.)
template <int kHeadDim>
struct DecodeConfigFor;
template <>
struct DecodeConfigFor<64> {
  using type = DecodeTileConfig<64, 64, 4>;  // 72 KB
};
template <>
struct DecodeConfigFor<128> {
  using type = DecodeTileConfig<128, 64, 3>;  // 102 KB: two CTAs per H100 SM
};
template <>
struct DecodeConfigFor<256> {
  using type = DecodeTileConfig<256, 32, 4>;  // 132 KB
};

namespace device {

using portable::cp_async_commit;
using portable::cp_async_wait;
using portable::accum_to_a;
using portable::ElemTraits;
using portable::fast_exp2;
using portable::ldmatrix_x4;
using portable::ldmatrix_x4_trans;
using portable::mma_16x8x16;

// 16-byte cp.async (zero-filled when !valid) with the L2 told to fetch the whole 256-byte
// neighbourhood: a K/V row of head dim 128 is 256 bytes, so its other half and, in a paged or
// contiguous cache, the next head's row are fetched with it instead of by separate DRAM requests.
__device__ __forceinline__ void cp_async_16_l2_256(void* smem, const void* gmem, bool valid) {
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(valid ? 16 : 0));
}

// Programmatic dependent launch: src/common/grid_dependency.h (the combine kernel is launched
// while the attention kernel still runs and waits for its results).
using flare::device::allow_dependent_launch;
using flare::device::wait_for_prerequisite_grids;

__device__ __forceinline__ int warp_min(int x) {
#pragma unroll
  for (int o = 16; o > 0; o /= 2) x = min(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}
__device__ __forceinline__ int warp_max(int x) {
#pragma unroll
  for (int o = 16; o > 0; o /= 2) x = max(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}

// Which keys a CTA attends: [kv_begin, kv_end), walked in tiles from tile_begin (a multiple of
// kBlockN, so no tile crosses a split boundary). Empty when kv_begin >= kv_end.
struct KeyRange {
  int seqlen = 0;  // L: keys in the cache (clamped to its capacity)
  int kv_begin = 0, kv_end = 0, tile_begin = 0, num_tiles = 0;
};

// Host and device: the host side is how the split rule is checked against brute force.
template <int kBlockN, bool kSplit>
__host__ __device__ __forceinline__ KeyRange key_range(const DecodeKernelParams& p, int b, int split) {
  KeyRange r;
  // Out-of-range lengths would read outside the cache: clamp (valid inputs are unaffected).
  const int stored = p.cache_seqlens[b * p.seqlens_stride];
  r.seqlen = stored < 0 ? 0 : (stored > p.max_cache_len ? p.max_cache_len : stored);
  // The span all q_len queries attend (decode_plan.h): the earliest key any of them sees.
  const int earliest = r.seqlen - p.q_len - p.window_left;
  const int span_begin = p.window_left >= 0 && earliest > 0 ? earliest : 0;
  r.kv_begin = span_begin;
  r.kv_end = r.seqlen;
  if constexpr (kSplit) {
    // Split `split` covers [origin + split * kv_chunk, + kv_chunk), origin = span_begin rounded
    // down to kv_align. int64: origin + num_splits * kv_chunk may pass 2^31 for empty splits.
    const int64_t origin = span_begin - span_begin % p.kv_align;
    const int64_t split_begin = origin + int64_t{split} * p.kv_chunk;
    const int64_t split_end = split_begin + p.kv_chunk;
    const int64_t begin = split_begin > r.kv_begin ? split_begin : r.kv_begin;
    const int64_t end = split_end < r.kv_end ? split_end : r.kv_end;
    // An empty split (past a short sequence's end) walks no tiles.
    r.kv_begin = begin < end ? static_cast<int>(begin) : 0;
    r.kv_end = begin < end ? static_cast<int>(end) : 0;
  }
  r.tile_begin = r.kv_begin - r.kv_begin % kBlockN;
  r.num_tiles = r.kv_end > r.kv_begin ? (r.kv_end - r.tile_begin + kBlockN - 1) / kBlockN : 0;
  return r;
}

// The rows of one thread (fragment rows g and g + 8 of its warp's m-tile) and the warp's bounds
// for classifying chunks.
struct RowBounds {
  int last[2];  // last visible key per row; -1 for padding rows (nothing visible)
  int lo[2];    // first visible key per row (may be negative: nothing below 0 exists)
  // Over the warp's real rows: a chunk [k0, k0 + 16) is EMPTY when k0 > last_max or
  // k0 + 15 < lo_min, FULL when k0 >= lo_max and k0 + 15 <= last_min.
  int lo_min, lo_max, last_min, last_max;
};

// The thread's rows first + g and first + g + 8 (valid below `count`, packed as token * group +
// head-in-group) for KV head hk of sequence b with L keys: their key bounds and query pointers,
// and the warp's bounds over its valid rows.
template <typename T>
__device__ __forceinline__ RowBounds setup_rows(const DecodeKernelParams& p, int b, int hk, int L, int first, int count,
                                                int g, const T* (&q_row)[2]) {
  RowBounds rows;
  int lo_min = INT_MAX, lo_max = INT_MIN, last_min = INT_MAX, last_max = -1;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int r = g + 8 * i;
    if (r < count) {
      const int row = first + r, tq = row / p.group, h = hk * p.group + row % p.group;
      rows.last[i] = p.causal ? L - p.q_len + tq : L - 1;
      rows.lo[i] = p.window_left >= 0 ? rows.last[i] - p.window_left : 0;
      q_row[i] = static_cast<const T*>(p.q) + b * p.q_stride_b + tq * p.q_stride_t + h * p.q_stride_h;
      lo_min = min(lo_min, rows.lo[i]);
      lo_max = max(lo_max, rows.lo[i]);
      last_min = min(last_min, rows.last[i]);
      last_max = max(last_max, rows.last[i]);
    } else {
      rows.last[i] = -1;
      rows.lo[i] = 0;
      q_row[i] = nullptr;
    }
  }
  rows.lo_min = warp_min(lo_min);
  rows.lo_max = warp_max(lo_max);
  rows.last_min = warp_min(last_min);
  rows.last_max = warp_max(last_max);
  return rows;
}

// Q as MMA A fragments of the thread's rows (setup_rows' q_row), straight from global memory (a
// few hundred bytes per warp): columns 16 ks + 2t (a0, a1) and + 8 (a2, a3). Padding rows are zero.
template <int kKSteps, typename T>
__device__ __forceinline__ void load_q_fragments(const T* const (&q_row)[2], int t, uint32_t (&qa)[kKSteps][4]) {
#pragma unroll
  for (int ks = 0; ks < kKSteps; ++ks) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int col = 16 * ks + 8 * half + 2 * t;
      qa[ks][2 * half] = q_row[0] != nullptr ? *reinterpret_cast<const uint32_t*>(q_row[0] + col) : 0u;
      qa[ks][2 * half + 1] = q_row[1] != nullptr ? *reinterpret_cast<const uint32_t*>(q_row[1] + col) : 0u;
    }
  }
}

}  // namespace device

template <typename Cfg, typename T, bool kSplit>
__global__ void __launch_bounds__(Cfg::kThreads) decode_attention_kernel(const DecodeKernelParams p) {
  using namespace device;
  constexpr int kHeadDim = Cfg::kHeadDim, kStride = Cfg::kRowStride, kBlockN = Cfg::kBlockN;
  constexpr int kStages = Cfg::kStages, kWarps = Cfg::kWarps;
  constexpr int kDTiles = kHeadDim / 8, kKSteps = kHeadDim / 16;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* const kv_smem = reinterpret_cast<T*>(smem_raw);            // [kStages][K | V][kBlockN][kStride]
  float* const merge_smem = reinterpret_cast<float*>(smem_raw);  // after the key walk
  __shared__ float warp_row_max[kWarps][16], warp_row_sum[kWarps][16];
  __shared__ float cta_row_max[Cfg::kRowsPerCta], cta_row_sum[Cfg::kRowsPerCta];

  if constexpr (kSplit) allow_dependent_launch();  // the combine may start launching now

  // ---- which work: blockIdx.x = ((b * heads_kv + hk) * row_blocks + rb) * num_splits + split
  int x = blockIdx.x;
  const int split = kSplit ? x % p.num_splits : 0;
  if constexpr (kSplit) x /= p.num_splits;
  const int rb = x % p.row_blocks;
  x /= p.row_blocks;
  const int hk = x % p.heads_kv;
  const int b = x / p.heads_kv;

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;

  const KeyRange keys = key_range<kBlockN, kSplit>(p, b, split);
  const int L = keys.seqlen;

  // ---- rows: the warp's m-tile and key group
  const int row0 = rb * Cfg::kRowsPerCta;  // first packed row of this block
  const int rows_in_block = min(Cfg::kRowsPerCta, p.rows - row0);
  const int num_mtiles = rows_in_block <= 16 ? 1 : (rows_in_block <= 32 ? 2 : 4);
  const int key_groups = kWarps / num_mtiles;
  const int mt = warp % num_mtiles, kg = warp / num_mtiles;

  const T* q_row[2];
  const RowBounds rows = setup_rows<T>(p, b, hk, L, row0 + mt * 16, rows_in_block - mt * 16, g, q_row);

  // ---- K/V tile loads: thread -> (row within a pass, 16-byte column); zero-fill past kv_end
  const int32_t* page_row = p.page_table != nullptr ? p.page_table + b * p.page_table_stride : nullptr;
  const T* k_base = static_cast<const T*>(p.k) + hk * p.k_stride_h;
  const T* v_base = static_cast<const T*>(p.v) + hk * p.v_stride_h;
  const int load_col = (threadIdx.x % Cfg::kLoadChunksPerRow) * 8;
  const int load_row = threadIdx.x / Cfg::kLoadChunksPerRow;
  constexpr int kLoadPasses = kBlockN / Cfg::kLoadRowsPerPass;
  // Paged caches: the page of each row this thread copies in the next tile, read from the page
  // table one tile ahead, so the table's latency hides behind a tile of work instead of stalling
  // every tile's copies.
  int32_t next_pages[kLoadPasses];
  auto fetch_pages = [&](int tile) {
    if (page_row == nullptr) return;
    const int key0 = keys.tile_begin + tile * kBlockN;
#pragma unroll
    for (int pass = 0; pass < kLoadPasses; ++pass) {
      const int key = key0 + load_row + pass * Cfg::kLoadRowsPerPass;
      next_pages[pass] = key < keys.kv_end ? page_row[key >> p.page_shift] : 0;
    }
  };
  auto load_tile = [&](int tile, int stage) {
    T* k_dst = kv_smem + stage * Cfg::kStageElems;
    T* v_dst = k_dst + kBlockN * kStride;
    const int key0 = keys.tile_begin + tile * kBlockN;
#pragma unroll
    for (int pass = 0; pass < kLoadPasses; ++pass) {
      const int r = load_row + pass * Cfg::kLoadRowsPerPass, key = key0 + r;
      const bool valid = key < keys.kv_end;
      int64_t k_off = 0, v_off = 0;
      if (valid) {
        // Contiguous: (sequence, token). Paged: (page, token within the page).
        const int64_t slot = page_row != nullptr ? next_pages[pass] : b;
        const int64_t tok = page_row != nullptr ? (key & ((1 << p.page_shift) - 1)) : key;
        k_off = slot * p.k_stride_0 + tok * p.k_stride_tok + load_col;
        v_off = slot * p.v_stride_0 + tok * p.v_stride_tok + load_col;
      }
      cp_async_16_l2_256(k_dst + r * kStride + load_col, k_base + k_off, valid);
      cp_async_16_l2_256(v_dst + r * kStride + load_col, v_base + v_off, valid);
    }
    fetch_pages(tile + 1);
  };
  fetch_pages(0);

  // Prologue: kStages - 1 tiles in flight (one commit group each, empty past the end).
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < keys.num_tiles) load_tile(s, s);
    cp_async_commit();
  }

  // Q, while the first tiles load.
  uint32_t qa[kKSteps][4];
  load_q_fragments(q_row, t, qa);

  float o[kDTiles][4];
#pragma unroll
  for (int dt = 0; dt < kDTiles; ++dt) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.f;
  float row_max[2] = {-INFINITY, -INFINITY};  // running max of the scores, scaled log2 units
  float row_sum[2] = {0.f, 0.f};              // this thread's share of the softmax denominator

  // ---- the key walk
  for (int it = 0; it < keys.num_tiles; ++it) {
    cp_async_wait<kStages - 2>();  // tile `it` has landed for this thread...
    __syncthreads();               // ...and for all; the stage refilled below was consumed at it - 1
    if (it + kStages - 1 < keys.num_tiles) load_tile(it + kStages - 1, (it + kStages - 1) % kStages);
    cp_async_commit();

    const T* k_tile = kv_smem + (it % kStages) * Cfg::kStageElems;
    const T* v_tile = k_tile + kBlockN * kStride;
#pragma unroll
    for (int c = 0; c < Cfg::kChunksPerTile; ++c) {
      if (((it * Cfg::kChunksPerTile + c) & (key_groups - 1)) != kg) continue;  // another key group's
      const int key0 = keys.tile_begin + it * kBlockN + c * Cfg::kChunk;
      if (key0 > rows.last_max || key0 + Cfg::kChunk - 1 < rows.lo_min) continue;  // EMPTY
      const bool full = key0 >= rows.lo_max && key0 + Cfg::kChunk - 1 <= rows.last_min;
      const T* k_chunk = k_tile + c * Cfg::kChunk * kStride;
      const T* v_chunk = v_tile + c * Cfg::kChunk * kStride;

      // S = Q K^T: 16 rows x 16 keys as two 8-key n-tiles.
      float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
      for (int ks = 0; ks < kKSteps; ++ks) {
        uint32_t bk[4];
        ldmatrix_x4(bk, k_chunk + (lane % 8 + (lane / 16) * 8) * kStride + 16 * ks + ((lane / 8) % 2) * 8);
        mma_16x8x16<T>(s[0], qa[ks], bk[0], bk[1]);
        mma_16x8x16<T>(s[1], qa[ks], bk[2], bk[3]);
      }

      if (!full) {  // PARTIAL: element predicate
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int key = key0 + 8 * j + 2 * t + (e % 2), i = e / 2;
            s[j][e] = (key >= rows.lo[i] && key <= rows.last[i]) ? s[j][e] : -INFINITY;
          }
      }

      // Online softmax in exp2: new max, rescale O and the sum, P = exp2(S * scale - max).
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        float mx = fmaxf(fmaxf(s[0][2 * i], s[0][2 * i + 1]), fmaxf(s[1][2 * i], s[1][2 * i + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float new_max = fmaxf(row_max[i], mx * p.scale_log2);
        const float base = new_max == -INFINITY ? 0.f : new_max;  // nothing visible yet
        const float alpha = fast_exp2(row_max[i] - base);
        row_max[i] = new_max;
        float sum = 0.f;
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          s[j][2 * i] = fast_exp2(fmaf(s[j][2 * i], p.scale_log2, -base));
          s[j][2 * i + 1] = fast_exp2(fmaf(s[j][2 * i + 1], p.scale_log2, -base));
          sum += s[j][2 * i] + s[j][2 * i + 1];
        }
        row_sum[i] = row_sum[i] * alpha + sum;
#pragma unroll
        for (int dt = 0; dt < kDTiles; ++dt) {
          o[dt][2 * i] *= alpha;
          o[dt][2 * i + 1] *= alpha;
        }
      }

      // O += P V: the S accumulators are P's A fragment (16 rows x 16 keys).
      uint32_t pa[4];
      accum_to_a<T>(s[0], s[1], pa);
#pragma unroll
      for (int dp = 0; dp < kDTiles / 2; ++dp) {
        uint32_t bv[4];
        ldmatrix_x4_trans(bv, v_chunk + (lane % 8 + ((lane / 8) % 2) * 8) * kStride + 16 * dp + (lane / 16) * 8);
        mma_16x8x16<T>(o[2 * dp], pa, bv[0], bv[1]);
        mma_16x8x16<T>(o[2 * dp + 1], pa, bv[2], bv[3]);
      }
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // every warp is done with the K/V buffers: they become the merge buffer

  // ---- merge the key groups: per row, M = max over groups, each group's O scaled by exp2(m - M)
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    row_sum[i] += __shfl_xor_sync(0xffffffffu, row_sum[i], 1);
    row_sum[i] += __shfl_xor_sync(0xffffffffu, row_sum[i], 2);
    if (t == 0) {
      warp_row_max[warp][g + 8 * i] = row_max[i];
      warp_row_sum[warp][g + 8 * i] = row_sum[i];
    }
  }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int r = g + 8 * i;
    float cta_max = -INFINITY;
    for (int k = 0; k < key_groups; ++k) cta_max = fmaxf(cta_max, warp_row_max[k * num_mtiles + mt][r]);
    const float f = row_max[i] == -INFINITY ? 0.f : fast_exp2(row_max[i] - cta_max);
    float* dst = merge_smem + (warp * 16 + r) * Cfg::kMergeStride + 2 * t;
#pragma unroll
    for (int dt = 0; dt < kDTiles; ++dt)
      *reinterpret_cast<float2*>(dst + 8 * dt) = make_float2(o[dt][2 * i] * f, o[dt][2 * i + 1] * f);
    if (kg == 0 && t == 0) {
      float cta_sum = 0.f;
      for (int k = 0; k < key_groups; ++k) {
        const float m = warp_row_max[k * num_mtiles + mt][r];
        if (m != -INFINITY) cta_sum += warp_row_sum[k * num_mtiles + mt][r] * fast_exp2(m - cta_max);
      }
      cta_row_max[mt * 16 + r] = cta_max;
      cta_row_sum[mt * 16 + r] = cta_sum;
    }
  }
  __syncthreads();

  // ---- epilogue: all threads, 8 columns each step; rows with no visible key get O = 0 and
  // LSE +inf (standard, as the oracle) or -inf (a partial state that weighs nothing)
  constexpr float kLn2 = 0.69314718055994530942f;
  for (int idx = threadIdx.x; idx < rows_in_block * (kHeadDim / 8); idx += Cfg::kThreads) {
    const int r = idx / (kHeadDim / 8), col = (idx % (kHeadDim / 8)) * 8;
    const int r_mt = r / 16, r_in = r % 16;
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int k = 0; k < key_groups; ++k) {
      const float* src = merge_smem + ((k * num_mtiles + r_mt) * 16 + r_in) * Cfg::kMergeStride + col;
      const float4 lo4 = *reinterpret_cast<const float4*>(src), hi4 = *reinterpret_cast<const float4*>(src + 4);
      acc[0] += lo4.x, acc[1] += lo4.y, acc[2] += lo4.z, acc[3] += lo4.w;
      acc[4] += hi4.x, acc[5] += hi4.y, acc[6] += hi4.z, acc[7] += hi4.w;
    }
    const float sum = cta_row_sum[r];
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
    const int row = row0 + r, tq = row / p.group, h = hk * p.group + row % p.group;
    const int64_t qrow = (int64_t{b} * p.heads_q + h) * p.q_len + tq;  // (b, h, t): LSE / partial order
    if constexpr (kSplit) {
      const int64_t part = qrow * p.num_splits + split;
      float* dst = p.partial_out + part * kHeadDim + col;
      *reinterpret_cast<float4*>(dst) = make_float4(acc[0] * inv, acc[1] * inv, acc[2] * inv, acc[3] * inv);
      *reinterpret_cast<float4*>(dst + 4) = make_float4(acc[4] * inv, acc[5] * inv, acc[6] * inv, acc[7] * inv);
      if (col == 0) p.partial_lse[part] = sum > 0.f ? (cta_row_max[r] + log2f(sum)) * kLn2 : -INFINITY;
    } else {
      uint4 packed;
      packed.x = ElemTraits<T>::pack(acc[0] * inv, acc[1] * inv);
      packed.y = ElemTraits<T>::pack(acc[2] * inv, acc[3] * inv);
      packed.z = ElemTraits<T>::pack(acc[4] * inv, acc[5] * inv);
      packed.w = ElemTraits<T>::pack(acc[6] * inv, acc[7] * inv);
      T* dst = static_cast<T*>(p.out) + b * p.out_stride_b + tq * p.out_stride_t + h * p.out_stride_h + col;
      *reinterpret_cast<uint4*>(dst) = packed;
      if (col == 0 && p.lse != nullptr) p.lse[qrow] = sum > 0.f ? (cta_row_max[r] + log2f(sum)) * kLn2 : INFINITY;
    }
  }
}

// Launches the portable standard (num_splits == 1) or split-KV kernel; the combine is the
// caller's. launch_decode_attention (decode_bulk_kernel.h) calls it where the sm_90 kernel does not apply.
template <int kHeadDim, typename T>
Status launch_decode_portable(const DecodeKernelParams& p, cudaStream_t stream) {
  using Cfg = typename DecodeConfigFor<kHeadDim>::type;
  constexpr int kSmem = Cfg::template smem_bytes<T>();
  auto standard = decode_attention_kernel<Cfg, T, false>;
  auto split_kv = decode_attention_kernel<Cfg, T, true>;
  // Once per kernel (not a stream operation, so also fine while a graph is being captured).
  static const cudaError_t attr = [&] {
    cudaError_t e = cudaFuncSetAttribute(standard, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
    if (e == cudaSuccess) e = cudaFuncSetAttribute(split_kv, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
    if (e != cudaSuccess) (void)cudaGetLastError();  // reported through the Status, not left sticky
    return e;
  }();
  if (attr != cudaSuccess) return detail::cuda_status(attr, "decode: shared memory attribute");
  const int64_t ctas = int64_t{p.batch} * p.heads_kv * p.row_blocks * p.num_splits;
  if (ctas > INT_MAX) return Status::NotSupported("decode: " + std::to_string(ctas) + " CTAs exceed the grid limit");
  if (p.num_splits > 1)
    split_kv<<<static_cast<unsigned>(ctas), Cfg::kThreads, kSmem, stream>>>(p);
  else
    standard<<<static_cast<unsigned>(ctas), Cfg::kThreads, kSmem, stream>>>(p);
  return detail::cuda_status(cudaGetLastError(), "decode attention launch");
}

}  // namespace flare::decode
