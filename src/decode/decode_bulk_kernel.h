// Decode attention on sm_90+: bulk copies (cp.async.bulk, mbarrier completion) of whole cache
// rows, one CTA for several KV heads of a sequence. Serves the same two plans as
// decode_kernel.h (standard and split-KV, same key ranges, same workspace layout, same combine).
// DecodeEngine::kHeadWarps: the kernel of 2026-11-22, kept for comparisons with the key-group
// kernel (decode_key_groups_kernel.h), which replaced it as the default; decode_launch.h
// dispatches between them.
//
// Why. The portable kernel gives each (sequence, KV head) its own CTA: it copies 256-byte rows
// 16 bytes per thread-instruction through cp.async, at a 2 KB stride, and its 4 warps spend most
// of their issue slots on copy addresses. Here a CTA takes heads_per_cta KV heads whose slices of
// a key row are adjacent in memory ([.., token, heads_kv, head_dim] caches), so one key's K (or V)
// for all of them is one contiguous copy of heads_per_cta x head_dim x 2 bytes: a 16-key tile of
// K and V is 32 bulk copies, one per lane of the producer warp, whatever the head dim. The CTA
// streams contiguous memory, and up to kStages tiles (about 190 KB) are in flight per SM.
//
// Warps. Warp w < heads_per_cta computes KV head hk0 + w: its group x q_len packed query rows
// (at most 16: one m-tile, rows past them are zero padding) against every key of the CTA's range,
// 16 keys per step, with its own online softmax, then writes its rows. The last warp produces:
// for tile i, stage i % stages, it waits until every consumer warp released the stage (empty
// barrier), announces the tile's bytes (full barrier) and issues the copies.
//
// Latency. For contiguous caches without a window a split's first keys do not depend on the
// cache length (split s starts at s x kv_chunk), so the first `stages` tiles are issued before
// cache_seqlens is read: the length's memory round trip overlaps the first K/V round trip.
// Their keys are bounded by the split and the cache's capacity, so they stay inside the cache;
// keys at or past the sequence's end are zeroed in V (a masked key has P = 0, and 0 x garbage
// may be NaN) and masked in S.
//
// Heads per CTA (launch_decode_head_warps): the most that fit (8 at head dim 128), halved while
// the grid would fill under half the SMs, so small batches with few splits still stream on most
// SMs; narrow CTAs (1 or 2 heads) with long splits run the portable kernel instead, since one
// warp per head is slow to walk many keys (see the launcher). Known limit: that per-warp walk
// also caps batch 1 on long caches; the key-group kernel lifts it.
//
// Shared rows are padded by 16 bytes, so the 8 rows of an ldmatrix fall in distinct bank groups.
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "src/common/bulk_copy.h"
#include "src/common/device_facts.h"
#include "src/decode/decode_kernel.h"
#include "src/decode/decode_subtile.h"

namespace flare::decode {

inline constexpr int kBulkBlockN = 16;        // keys per tile: one P V k-step, one copy per producer lane
inline constexpr int kBulkMaxHeadsPerCta = 8; // consumer warps
// Per head dim: 3 stages of 8 heads of head dim 256 would not fit, and 4 heads keep its launch
// bounds (5 warps) loose enough for O and Q in registers without spills.
constexpr int bulk_heads_cap(int head_dim) { return head_dim > 128 ? 4 : kBulkMaxHeadsPerCta; }
inline constexpr int kBulkMaxStages = 8;
inline constexpr int kBulkSmemBudget = 200 * 1024;  // K/V stages: one CTA per SM, ~190 KB in flight
// Longest split (keys) that CTAs of 1 or 2 KV heads take; longer ones run the portable kernel.
inline constexpr int kBulkNarrowMaxKeys1 = 64;
inline constexpr int kBulkNarrowMaxKeys2 = 512;

// Shared row padding in elements: 16 bytes, so the 8 rows of an ldmatrix fall in distinct bank
// groups. The cost: row k lands 16 k bytes off its global row's 128-byte alignment, and its bulk
// copy reaches L2 in pieces (42.5 M requests and 74.0 M sectors for the 67.1 M of 2.15 GB at batch
// 8, 65536 keys; about 7 % of the pipeline's speed). An experiment switch (bench/RESULTS.md,
// session 43): 0 aligns the rows (the copies then stream at the probe's speed, but the consumers'
// ldmatrix reads conflict 8 ways).
#ifndef FLARE_DECODE_EXPERIMENT_ROW_PAD
#define FLARE_DECODE_EXPERIMENT_ROW_PAD 8
#endif
inline constexpr int kBulkRowPad = FLARE_DECODE_EXPERIMENT_ROW_PAD;

// How a launch lays out its CTA (host and device agree through these).
struct BulkLayout {
  int heads_per_cta = 0;  // KV heads per CTA (consumer warps), divides heads_kv
  int row_elems = 0;      // shared row stride: heads_per_cta * head_dim + kBulkRowPad
  int stages = 0;
};

// The most KV heads per CTA: a power of two dividing heads_kv, at most bulk_heads_cap, and
// small enough that 3 stages (K and V of 16 keys each) fit in the shared-memory budget.
template <int kHeadDim, typename T>
inline int bulk_max_heads_per_cta(int heads_kv) {
  int h = bulk_heads_cap(kHeadDim);
  while (h > 1 &&
         (heads_kv % h != 0 || 3 * 2 * kBulkBlockN * (h * kHeadDim + kBulkRowPad) * int(sizeof(T)) > kBulkSmemBudget))
    h /= 2;
  return h;
}

template <int kHeadDim, typename T>
inline BulkLayout bulk_layout(int heads_per_cta) {
  BulkLayout l;
  l.heads_per_cta = heads_per_cta;
  l.row_elems = heads_per_cta * kHeadDim + kBulkRowPad;
  const int stage_bytes = 2 * kBulkBlockN * l.row_elems * int(sizeof(T));
  l.stages = kBulkSmemBudget / stage_bytes < kBulkMaxStages ? kBulkSmemBudget / stage_bytes : kBulkMaxStages;
  return l;
}

template <int kHeadDim, typename T, bool kSplit>
__global__ void __launch_bounds__(32 * (bulk_heads_cap(kHeadDim) + 1)) decode_bulk_kernel(const DecodeKernelParams p,
                                                                                    const BulkLayout lay) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using namespace device;
  using namespace sm90;
  constexpr int kN = kBulkBlockN, kDTiles = kHeadDim / 8, kKSteps = kHeadDim / 16;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* const kv_smem = reinterpret_cast<T*>(smem_raw);  // [stages][K | V][kN][row_elems]
  __shared__ __align__(8) uint64_t full_bar[kBulkMaxStages], empty_bar[kBulkMaxStages];

  if constexpr (kSplit) allow_dependent_launch();  // the combine may start launching now

  const int hpc = lay.heads_per_cta, R = lay.row_elems, stages = lay.stages;
  const int stage_elems = 2 * kN * R;
  // blockIdx.x = (b * head_blocks + hb) * num_splits + split
  const int head_blocks = p.heads_kv / hpc;
  int x = blockIdx.x;
  const int split = kSplit ? x % p.num_splits : 0;
  if constexpr (kSplit) x /= p.num_splits;
  const int hb = x % head_blocks, b = x / head_blocks;
  const int hk0 = hb * hpc;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) {
      mbar_init(&full_bar[s], 1);
      mbar_init(&empty_bar[s], hpc);
    }
    mbar_init_fence();
  }
  __syncthreads();

  // Speculative tiles: contiguous, no window: the split's keys start at split * kv_chunk whatever
  // the length, and they are inside the cache up to `spec_cap`.
  const bool speculate = p.page_table == nullptr && p.window_left < 0;
  const int split_begin = kSplit ? split * p.kv_chunk : 0;  // < max_cache_len when the plan fits
  int spec_cap = 0, spec_tiles = 0;
  if (speculate && split_begin < p.max_cache_len) {
    const int64_t end = kSplit ? int64_t{split_begin} + p.kv_chunk : int64_t{p.max_cache_len};
    spec_cap = static_cast<int>(end < p.max_cache_len ? end : p.max_cache_len);
    spec_tiles = min(stages, (spec_cap - split_begin + kN - 1) / kN);
  }
  const int row_bytes = hpc * kHeadDim * int(sizeof(T));

  if (warp == hpc) {
    // ================= producer warp: lane l copies key l % 16, K (l < 16) or V
    const int key_in_tile = lane % kN;
    const bool is_v = lane >= kN;
    const T* base = static_cast<const T*>(is_v ? p.v : p.k) + int64_t{hk0} * kHeadDim;
    const int64_t stride_0 = is_v ? p.v_stride_0 : p.k_stride_0, stride_tok = is_v ? p.v_stride_tok : p.k_stride_tok;
    const int dst_off = (is_v ? kN * R : 0) + key_in_tile * R;
    const uint64_t policy = l2_policy_evict_first();  // used where p.l2_evict_first
    // Issues tile i (keys tile_begin + 16 i ...) for the keys below `end`, at row `slot, tok`.
    auto issue = [&](int i, int tile_begin, int end, int64_t slot, int64_t tok) {
      const int s = i % stages;
      if (i >= stages) mbar_wait(&empty_bar[s], ((i / stages) + 1) & 1);
      const int key0 = tile_begin + i * kN;
      const int valid = min(kN, end - key0);
      if (lane == 0) mbar_arrive_expect_tx(&full_bar[s], 2u * valid * row_bytes);
      __syncwarp();
      if (key_in_tile < valid) {
        T* const dst = kv_smem + s * stage_elems + dst_off;
        const T* const src = base + slot * stride_0 + tok * stride_tok;
        if (p.l2_evict_first)
          bulk_copy_g2s(dst, src, row_bytes, &full_bar[s], policy);
        else
          bulk_copy_g2s(dst, src, row_bytes, &full_bar[s]);
      }
    };
    for (int i = 0; i < spec_tiles; ++i) {
      const int key = split_begin + i * kN + key_in_tile;
      issue(i, split_begin, spec_cap, b, key);
    }
    const KeyRange keys = key_range<kN, kSplit>(p, b, split);
    const int32_t* page_row = p.page_table != nullptr ? p.page_table + b * p.page_table_stride : nullptr;
    const int page_mask = (1 << p.page_shift) - 1;
    auto page_of = [&](int i) {
      const int key = keys.tile_begin + i * kN + key_in_tile;
      return page_row != nullptr && i < keys.num_tiles && key < keys.kv_end ? page_row[key >> p.page_shift] : 0;
    };
    int page = page_of(spec_tiles);
    for (int i = spec_tiles; i < keys.num_tiles; ++i) {
      const int key = keys.tile_begin + i * kN + key_in_tile;
      const int64_t slot = page_row != nullptr ? page : b;
      const int64_t tok = page_row != nullptr ? (key & page_mask) : key;
      const int next_page = page_of(i + 1);  // one tile ahead: its latency hides behind the wait
      issue(i, keys.tile_begin, keys.kv_end, slot, tok);
      page = next_page;
    }
    return;
  }

  // ================= consumer warps: warp w computes KV head hk0 + w
  const KeyRange keys = key_range<kN, kSplit>(p, b, split);
  const int L = keys.seqlen;
  const int hk = hk0 + warp;
  const int g = lane / 4, t = lane % 4;
  const T* q_row[2];
  const RowBounds rows = setup_rows<T>(p, b, hk, L, 0, p.rows, g, q_row);
  uint32_t qa[kKSteps][4];
  load_q_fragments(q_row, t, qa);

  float o[kDTiles][4];
#pragma unroll
  for (int dt = 0; dt < kDTiles; ++dt) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.f;
  float row_max[2] = {-INFINITY, -INFINITY};
  float row_sum[2] = {0.f, 0.f};

  // Every issued tile is waited for (speculative ones past a short sequence too: no copy may
  // still be writing shared memory when the CTA exits).
  const int total_tiles = max(keys.num_tiles, spec_tiles);
  for (int it = 0; it < total_tiles; ++it) {
    const int s = it % stages;
    mbar_wait(&full_bar[s], (it / stages) & 1);
    T* const k_chunk = kv_smem + s * stage_elems + warp * kHeadDim;
    T* const v_chunk = k_chunk + kN * R;
    const int key0 = keys.tile_begin + it * kN;
    const bool visible = !FLARE_DECODE_EXPERIMENT_SKIP_MATH && it < keys.num_tiles && key0 <= rows.last_max &&
                         key0 + kN - 1 >= rows.lo_min;
    if (visible) {
      zero_v_rows_past_end<kHeadDim, kN>(v_chunk, R, key0, keys.kv_end, lane);
      const bool full = key0 >= rows.lo_max && key0 + kN - 1 <= rows.last_min;
      float sc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
      for (int ks = 0; ks < kKSteps; ++ks) {
        uint32_t bk[4];
        ldmatrix_x4(bk, k_chunk + (lane % 8 + (lane / 16) * 8) * R + 16 * ks + ((lane / 8) % 2) * 8);
        mma_16x8x16<T>(sc[0], qa[ks], bk[0], bk[1]);
        mma_16x8x16<T>(sc[1], qa[ks], bk[2], bk[3]);
      }
      softmax_pv_step<kDTiles, T>(sc, full, key0, t, rows, p.scale_log2, row_max, row_sum, o,
                                  StridedRows<T>(v_chunk, R, lane));
    }
    __syncwarp();
    if (lane == 0) mbar_arrive(&empty_bar[s]);  // this warp is done with the stage
  }

  // ---- epilogue: the warp's rows g and g + 8; no visible key: O = 0 and LSE +inf (standard, as
  // the oracle) or -inf (a partial state that weighs nothing)
  constexpr float kLn2 = 0.69314718055994530942f;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    row_sum[i] += __shfl_xor_sync(0xffffffffu, row_sum[i], 1);
    row_sum[i] += __shfl_xor_sync(0xffffffffu, row_sum[i], 2);
    const int r = g + 8 * i;
    if (r >= p.rows) continue;
    const float sum = row_sum[i];
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
    const int tq = r / p.group, h = hk * p.group + r % p.group;
    const int64_t qrow = (int64_t{b} * p.heads_q + h) * p.q_len + tq;
    if constexpr (kSplit) {
      const int64_t part = qrow * p.num_splits + split;
      float* dst = p.partial_out + part * kHeadDim + 2 * t;
#pragma unroll
      for (int dt = 0; dt < kDTiles; ++dt)
        *reinterpret_cast<float2*>(dst + 8 * dt) = make_float2(o[dt][2 * i] * inv, o[dt][2 * i + 1] * inv);
      if (t == 0) p.partial_lse[part] = sum > 0.f ? (row_max[i] + log2f(sum)) * kLn2 : -INFINITY;
    } else {
      T* dst = static_cast<T*>(p.out) + b * p.out_stride_b + tq * p.out_stride_t + h * p.out_stride_h + 2 * t;
#pragma unroll
      for (int dt = 0; dt < kDTiles; ++dt)
        *reinterpret_cast<uint32_t*>(dst + 8 * dt) = ElemTraits<T>::pack(o[dt][2 * i] * inv, o[dt][2 * i + 1] * inv);
      if (t == 0 && p.lse != nullptr) p.lse[qrow] = sum > 0.f ? (row_max[i] + log2f(sum)) * kLn2 : INFINITY;
    }
  }
#endif
}

}  // namespace flare::decode

namespace flare::decode {

// Whether the bulk kernel runs these params: packed rows fit one m-tile, each KV head's slice of
// a key row is head_dim contiguous elements next to the next head's, and every copy's address and
// size are 16-byte multiples. (The device must also run sm_90 code: see decode_launch.h.)
template <int kHeadDim, typename T>
inline bool bulk_kernel_applies(const DecodeKernelParams& p) {
  constexpr int64_t kElemsPer16B = 16 / sizeof(T);
  auto aligned = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
  // Head dims 64 and 256 compile (without spills) but have not run on a GPU yet: portable until then.
  return kHeadDim == 128 && p.rows <= 16 && p.row_blocks == 1 && p.k_stride_h == kHeadDim && p.v_stride_h == kHeadDim && aligned(p.k) &&
         aligned(p.v) && p.k_stride_0 % kElemsPer16B == 0 && p.k_stride_tok % kElemsPer16B == 0 &&
         p.v_stride_0 % kElemsPer16B == 0 && p.v_stride_tok % kElemsPer16B == 0;
}

// Launches this kernel (DecodeEngine::kHeadWarps) for the standard (num_splits == 1) or the
// split-KV plan; the combine is the caller's. The dispatcher (decode_launch.h) has checked that
// the device runs sm_90 code and bulk_kernel_applies. Narrow CTAs with long splits run the
// portable kernel instead (the rule below).
template <int kHeadDim, typename T>
Status launch_decode_head_warps(const DecodeKernelParams& p, cudaStream_t stream) {
  auto standard = decode_bulk_kernel<kHeadDim, T, false>;
  auto split_kv = decode_bulk_kernel<kHeadDim, T, true>;
  // Once per kernel (not a stream operation, so also fine while a graph is being captured).
  static const bool ready = [&] {
    const bool ok = cudaFuncSetAttribute(standard, cudaFuncAttributeMaxDynamicSharedMemorySize, kBulkSmemBudget) ==
                        cudaSuccess &&
                    cudaFuncSetAttribute(split_kv, cudaFuncAttributeMaxDynamicSharedMemorySize, kBulkSmemBudget) ==
                        cudaSuccess;
    if (!ok) (void)cudaGetLastError();  // the portable kernel runs
    return ok;
  }();
  if (!ready) return launch_decode_portable<kHeadDim, T>(p, stream);

  // Heads per CTA: as many as fit (longest contiguous rows), but fewer while that would leave
  // the grid under half the SMs (small batches with few splits: more, narrower CTAs keep more
  // SMs streaming; the tuner picks the split count knowing this rule).
  int heads_per_cta = bulk_max_heads_per_cta<kHeadDim, T>(p.heads_kv);
  const int num_sms = detail::current_device_facts().num_sms;
  while (heads_per_cta > 1 &&
         int64_t{p.batch} * (p.heads_kv / heads_per_cta) * p.num_splits < num_sms / 2)
    heads_per_cta /= 2;
  // One warp walks a head's keys alone (about 14 keys per microsecond on the H100: a tile's S
  // chain, softmax and P V are serial in the warp), so narrow CTAs only win on short splits,
  // where one round trip for all their keys beats the portable kernel's 4 warps per head:
  // measured 305 vs 114 us at batch 1, 65536 keys, 16 splits of one head per CTA. (The key-group
  // kernel, decode_key_groups_kernel.h, gives every CTA 8 warps instead.)
  const int64_t keys_per_cta = p.num_splits > 1 ? p.kv_chunk : p.max_cache_len;
  if (heads_per_cta < 4 && keys_per_cta > (heads_per_cta == 1 ? kBulkNarrowMaxKeys1 : kBulkNarrowMaxKeys2))
    return launch_decode_portable<kHeadDim, T>(p, stream);
  const BulkLayout lay = bulk_layout<kHeadDim, T>(heads_per_cta);
  const int smem = lay.stages * 2 * kBulkBlockN * lay.row_elems * static_cast<int>(sizeof(T));
  const int64_t ctas = int64_t{p.batch} * (p.heads_kv / lay.heads_per_cta) * p.num_splits;
  if (ctas > INT_MAX) return Status::NotSupported("decode: " + std::to_string(ctas) + " CTAs exceed the grid limit");
  const dim3 grid(static_cast<unsigned>(ctas)), block(32 * (lay.heads_per_cta + 1));
  if (p.num_splits > 1)
    split_kv<<<grid, block, smem, stream>>>(p, lay);
  else
    standard<<<grid, block, smem, stream>>>(p, lay);
  return detail::cuda_status(cudaGetLastError(), "decode attention launch");
}

}  // namespace flare::decode
