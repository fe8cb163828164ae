// Decode attention on sm_90+, key groups (DecodeEngine::kKeyGroups): TMA boxes of 16 keys of
// heads_per_cta KV heads (decode_tensor_maps.h), computed by 8 consumer warps whatever
// heads_per_cta is. Serves both plans (standard and split-KV, same key ranges and workspace
// layout as decode_kernel.h) and merges the splits in the kernel (DecodeCombine::kInKernel or,
// in a thread-block cluster, kCluster).
//
// Why. The head-warp kernel (decode_bulk_kernel.h) gives each KV head one warp, so a CTA of 1, 2
// or 4 heads, which small batches need to cover the SMs, has 1, 2 or 4 warps walking its keys, and
// one warp walks about 14 keys per microsecond (a tile's S chain, softmax and P V are serial in
// it). Here the consumer warps are heads x key groups (decode_schedule.h): a stage holds 16 keys
// per key group, and warp w computes head w % heads_per_cta over the 16-key sub-tile
// w / heads_per_cta of every stage, with its own running max, sum and O. After the walk the key
// groups of each head merge through shared memory by their maxima, as the portable kernel merges.
//
// S = Q K^T of a sub-tile is four independent MMA chains (two 8-key n-tiles x two halves of the
// head dim, added at the end) instead of two chains over the whole head dim: half the serial
// latency per sub-tile, for 8 more accumulator registers.
//
// Producer. The last warp issues stage i into buffer i % stages once every consumer warp released
// it (empty barrier, count = consumer warps): per sub-tile holding keys of the stage's range (per
// stage on contiguous caches with FLARE_DECODE_STAGE_BOXES=1), a box of K and one of V (whole rows:
// every 64-column block; per column block with FLARE_DECODE_ROW_BOXES=0), issued by one lane,
// completing on the stage's full barrier. A stage is [K | V][sub-tile][column block][head][key][64
// columns] (column block outermost without row boxes), 128-byte swizzled (head-major boxes where a
// CTA has 2+ heads, decode_tensor_maps.h: cache_box_line; the consumers' ldmatrix addresses follow:
// swizzled_chunk). Paged caches: a sub-tile's 16 keys lie in one page (pages are >= 16 keys and
// sub-tiles 16-aligned), so lane g < key_groups reads the page of sub-tile g one stage ahead, and
// the issuing lane takes it by a shuffle. Contiguous caches without a window issue their first
// stages before reading cache_seqlens (speculative; see decode_bulk_kernel.h): keys past the
// sequence's end are zeroed in V and masked in S.
// Measured and not kept: each consumer warp copying its own lines with 16-byte cp.async instead of
// the producer's boxes (no stage barriers) ran 1-19 % slower at every shape, short walks included
// (bench/RESULTS.md, session 23).
//
// In-kernel combine (split-KV, p.counters set). Each CTA writes its partial states, fences, and
// one thread increments the (sequence, head block) arrival counter; the CTA that brings it to
// num_splits is the last, resets it to 0 and merges every split's states of its rows (reading them
// through L2, since they were written by other SMs) into out and lse. No CTA waits for another, so
// any CTA order works. The counters must be 0 when the call starts: the launcher runs a zeroing
// kernel first, whose programmatic dependent this kernel is (its thread waits for it only just
// before arriving), unless the caller zeroed them (DecodeCombine::kInKernelPrezeroed).
//
// Cluster combine (split-KV, p.cluster_combine: DecodeCombine::kCluster). The num_splits CTAs of a
// (sequence, head block) are one thread-block cluster, rank = split. Each CTA leaves its partial
// states (normalized O of its rows, fp32, and their LSE) in its own shared memory instead of the
// workspace; after a cluster barrier every CTA merges a slice of the rows' 4-column pieces,
// reading all splits' states of that piece through distributed shared memory, and writes out and
// lse; a second barrier keeps every CTA's shared memory alive until its peers have read it. The
// producer warp joins both barriers. No global round trip between the splits' last stores and
// the merge, no counters, no second kernel.
//
// Both merges are decode_split_merge.h's.
#pragma once

#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "flare/decode_plan.h"
#include "src/common/bulk_copy.h"
#include "src/common/named_barrier.h"
#include "src/decode/decode_kernel.h"
#include "src/decode/decode_subtile.h"
#include "src/decode/decode_tensor_maps.h"
#include "src/decode/decode_schedule.h"
#include "src/decode/decode_split_merge.h"
#include "src/decode/decode_timeline.h"

// The producer initializes the stage barriers and issues its first stages without waiting for the
// consumer warps (a named barrier the consumers wait at and it only arrives at) where 1; 0: thread 0
// initializes them before a CTA-wide barrier. Measured against 0 (H200, batch 1 and 8, 256-65536
// keys, contiguous and paged, 3 alternating rounds): geometric mean 0.996, paged caches 0.98-0.99 at
// batch 1 up to 4096 keys and batch 8 at 256 keys, nothing slower than 1.009 (bench/RESULTS.md,
// session 45).
#ifndef FLARE_DECODE_EARLY_ISSUE
#define FLARE_DECODE_EARLY_ISSUE 1
#endif

namespace flare::decode {

namespace device {

// Offset (elements) of 8-column chunk c of a row at 128-byte line `line` of a stage's K or V, past
// the line's start: its 64-column block, then the chunk within the line as TMA's 128-byte swizzle
// placed it (j ^ (line % 8); the stage is 1024-byte aligned, block_elems a multiple of 512).
__device__ __forceinline__ int swizzled_chunk(int c, int line, int block_elems) {
  return (c >> 3) * block_elems + (((c & 7) ^ (line & 7)) << 3);
}

// V rows of this warp's sub-tile (key group kg, head `head`) at keys [kv_end, key0 + kN) hold stale
// or garbage values (loaded past the sequence, or left by an earlier stage): zeroed, so that P = 0
// multiplies zeros. Whole 128-byte lines, so the swizzle does not matter. As zero_v_rows_past_end
// (decode_subtile.h) for the TMA stage layout.
template <int kHeadDim, int kN, bool kHeadMajor, typename T>
__device__ __forceinline__ void zero_v_lines_past_end(const T* v_stage, int block_elems, int box_subs, int kg,
                                                      int hpc, int head, int key0, int kv_end, int lane) {
  constexpr int kBoxColBlocks = cache_box_col_blocks(kHeadDim);
  if (key0 + kN <= kv_end) return;
  T* const v_rows = const_cast<T*>(v_stage);
  for (int idx = lane; idx < (key0 + kN - kv_end) * (kHeadDim / 8); idx += 32) {
    const int r = kv_end - key0 + idx / (kHeadDim / 8), c = idx % (kHeadDim / 8);
    const int line = cache_box_line<kHeadMajor>(kg, r, head, hpc, kBoxColBlocks, box_subs);
    *reinterpret_cast<uint4*>(v_rows + (c / 8) * block_elems + line * kCacheBoxCols + (c % 8) * 8) =
        make_uint4(0, 0, 0, 0);
  }
  sm90::fence_proxy_async_shared();  // before a later TMA load refills the stage
  __syncwarp();
}

}  // namespace device

// The zeroing kernel the in-kernel combine's counters need (DecodeCombine::kInKernel): lets its
// programmatic dependent (the attention kernel) launch at once. A template so that every
// translation unit including this header may instantiate it.
template <typename T>
__global__ void __launch_bounds__(256) zero_arrival_counters_kernel(int* counters, int64_t n) {
  device::allow_dependent_launch();
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) counters[i] = 0;
}

// kHeadMajor: the maps' boxes are head-major (decode_tensor_maps.h: cache_boxes_head_major).
template <int kHeadDim, typename T, bool kSplit, bool kHeadMajor>
__global__ void __launch_bounds__(32 * (key_group_consumer_warps(kHeadDim) + 1))
    decode_key_groups_kernel(const DecodeKernelParams p, const KeyGroupLayout lay,
                             const __grid_constant__ CUtensorMap tmap_k, const __grid_constant__ CUtensorMap tmap_v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using namespace device;
  using namespace sm90;
  constexpr int kN = kSubTileKeys, kDTiles = kHeadDim / 8, kKSteps = kHeadDim / 16, kHalf = kKSteps / 2;
  constexpr int kWarps = key_group_consumer_warps(kHeadDim), kConsumerThreads = 32 * kWarps;
  constexpr int kMergeStride = kHeadDim + kKeyGroupMergePad;
  static_assert(kKSteps % 2 == 0, "S runs as two chains over the halves of the head dim");
  constexpr int kColBlocks = kHeadDim / kCacheBoxCols;  // 64-column blocks of a row (TMA boxes)
  extern __shared__ __align__(16) unsigned char smem_raw[];
  // [stages][K | V][key group][column block][heads_per_cta][16 keys][64] (cache_box_line; column
  // block outermost without row boxes), 128-byte swizzled: 1024-aligned
  T* const kv_smem = reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(smem_raw) + kKeyGroupSmemAlign - 1) &
                                          ~uintptr_t{kKeyGroupSmemAlign - 1});
  float* const merge_smem = reinterpret_cast<float*>(smem_raw);  // after the walk: [kWarps][16][kMergeStride]
  __shared__ __align__(8) uint64_t full_bar[kKeyGroupMaxStages], empty_bar[kKeyGroupMaxStages];
  __shared__ float warp_max[kWarps][16], warp_sum[kWarps][16];
  __shared__ float state_lse[kDecodeMaxHeadsPerCta * 16];  // the cluster combine's LSE per (head, row)
  __shared__ int is_last_split;

  FLARE_DECODE_MARK(threadIdx.x == 0, kDecodeMarkStart);
  FLARE_DECODE_MARK(threadIdx.x == 0, kDecodeMarkStartNs);
  FLARE_DECODE_MARK(threadIdx.x == 0, kDecodeMarkSm);
  const bool in_kernel_combine = kSplit && p.counters != nullptr;
  if (kSplit && !in_kernel_combine) allow_dependent_launch();  // the combine kernel may start launching

  const int hpc = lay.heads_per_cta, kgs = lay.key_groups, SK = lay.stage_keys;
  constexpr int kBoxColBlocks = cache_box_col_blocks(kHeadDim);  // column blocks a box holds
  static_assert(kKeyGroupRowPad == 0, "a stage is K then V of unpadded box lines");
  const int kv_elems = lay.stage_elems / 2;                       // K (or V) of a stage
  // Sub-tiles a box holds: 1 (a constant unless stage boxes are built in), or the stage's (cache_box_tokens).
  const int box_subs = cache_box_tokens(p.page_table == nullptr, SK) / kN;
  const int block_elems = cache_col_block_lines(hpc, SK, box_subs) * kCacheBoxCols;  // column block to column block
  const int stages = lay.stages;
  // blockIdx.x = (b * head_blocks + hb) * num_splits + split
  const int head_blocks = p.heads_kv / hpc;
  int x = blockIdx.x;
  const int split = kSplit ? x % p.num_splits : 0;
  if constexpr (kSplit) x /= p.num_splits;
  const int hb = x % head_blocks, b = x / head_blocks;
  const int hk0 = hb * hpc;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  // The stage barriers: initialized by thread 0 before a CTA-wide barrier, or (kEarlyIssue) by the
  // producer's lane 0, which then lets the consumer warps go through a named barrier it only
  // arrives at, and issues its first stages without waiting for them.
  constexpr bool kEarlyIssue = FLARE_DECODE_EARLY_ISSUE != 0;
  if (kEarlyIssue ? warp == kWarps && lane == 0 : threadIdx.x == 0) {
    prefetch_tensor_map(&tmap_k);  // the first loads need the descriptors: fetch them under the setup
    prefetch_tensor_map(&tmap_v);
    for (int s = 0; s < stages; ++s) {
      mbar_init(&full_bar[s], 1);
      mbar_init(&empty_bar[s], kWarps);
    }
    mbar_init_fence();
  }
  if constexpr (kEarlyIssue) {
    if (warp == kWarps) {
      __syncwarp();  // the other producer lanes see the barriers initialized
      ::flare::device::named_arrive<2>(32 * (kWarps + 1));  // bar 2: consumer_sync takes bar 1
    } else {
      ::flare::device::named_sync<2>(32 * (kWarps + 1));
    }
  } else {
    __syncthreads();
  }

  const bool speculate = p.page_table == nullptr && p.window_left < 0;
  const int64_t split_begin = kSplit ? int64_t{split} * p.kv_chunk : 0;
  const int64_t split_end = kSplit ? split_begin + p.kv_chunk : int64_t{p.max_cache_len};
  const int spec_stages = key_group_speculative_stages(speculate, split_begin, split_end, p.max_cache_len, SK, stages);

  if (warp == kWarps) {
    // ================= producer warp
    FLARE_DECODE_MARK(lane == 0, kDecodeMarkSetup);
    // One TMA box: box_subs x 16 keys (a sub-tile's or the stage's) x hpc heads x kBoxColBlocks x
    // 64 columns (decode_tensor_maps.h).
    const uint32_t box_bytes = box_subs * kN * hpc * kBoxColBlocks * kCacheBoxCols * uint32_t(sizeof(T));
    const uint64_t policy = l2_policy_evict_first();  // used where p.l2_evict_first
    // Issues stage i of a walk from walk_begin for the keys below `end`: the boxes covering the
    // sub-tiles that hold such keys (lane g locates sub-tile g, each box takes its first sub-tile's
    // coordinates), each with K and V, every column block. locate(key0, key_in_stage, &slot, &tok)
    // gives a key's cache coordinates (called by every lane: it may shuffle). The boxes are whole
    // (keys past the cache are zero-filled, keys past `end` inside it are loaded and masked), so
    // the stage's bytes are boxes x box_bytes.
    auto issue = [&](int i, int walk_begin, int end, auto&& locate) {
      const int s = i % stages;
      if (i >= stages) mbar_wait(&empty_bar[s], ((i / stages) + 1) & 1);
      const int key0 = key_group_stage_key0(walk_begin, i, SK);
      const int subs = min(kgs, (end - key0 + kN - 1) / kN);
      const int boxes = (subs + box_subs - 1) / box_subs;
      int64_t slot = 0, tok = 0;
      locate(key0, kN * (lane % kgs), &slot, &tok);  // lane g: sub-tile g's coordinates
      const bool leader = elect_one_lane();
      if (leader) mbar_arrive_expect_tx(&full_bar[s], 2u * (kColBlocks / kBoxColBlocks) * boxes * box_bytes);
      // One lane issues every box (a warp-uniform loop, so the operands sit in uniform registers as
      // TMA wants them, with no per-lane loop around each load).
      for (int j = 0; j < boxes; ++j) {
        const int g_tok = __shfl_sync(0xffffffffu, static_cast<int>(tok), j * box_subs);
        const int g_slot = __shfl_sync(0xffffffffu, static_cast<int>(slot), j * box_subs);
        const int box_y = kHeadMajor ? g_tok : hk0, box_z = kHeadMajor ? hk0 : g_tok;
        if (leader) {
          T* const k_dst = kv_smem + s * lay.stage_elems + j * kBoxColBlocks * box_subs * kN * hpc * kCacheBoxCols;
          // The two policies as two written-out branches: the same calls through one lambda ran
          // 14-28 % slower at batch 1 with 65536 keys and batch 8 with 1k (session 22, call 12).
#pragma unroll
          for (int cb = 0; cb < kColBlocks / kBoxColBlocks; ++cb) {
            T* const dst = k_dst + cb * block_elems;
            if (p.l2_evict_first) {
              tma_load_5d(dst, &tmap_k, 0, box_y, box_z, cb, g_slot, &full_bar[s], policy);
              tma_load_5d(dst + kv_elems, &tmap_v, 0, box_y, box_z, cb, g_slot, &full_bar[s], policy);
            } else {
              tma_load_5d(dst, &tmap_k, 0, box_y, box_z, cb, g_slot, &full_bar[s]);
              tma_load_5d(dst + kv_elems, &tmap_v, 0, box_y, box_z, cb, g_slot, &full_bar[s]);
            }
          }
        }
        __syncwarp();
      }
    };
    auto contiguous = [&](int key0, int key_in, int64_t* slot, int64_t* tok) {
      *slot = b;
      *tok = key0 + key_in;
    };
    for (int i = 0; i < spec_stages; ++i) {
      const int64_t cap = split_end < p.max_cache_len ? split_end : int64_t{p.max_cache_len};
      issue(i, static_cast<int>(split_begin), static_cast<int>(cap), contiguous);
    }
    FLARE_DECODE_MARK(lane == 0, kDecodeMarkIssued);
    const KeyRange keys = key_range<kN, kSplit>(p, b, split);
    const int num_stages = key_group_walk_stages(keys.num_tiles, kgs);
    if (p.page_table == nullptr) {
      for (int i = spec_stages; i < num_stages; ++i) issue(i, keys.tile_begin, keys.kv_end, contiguous);
    } else {
      const int32_t* page_row = p.page_table + b * p.page_table_stride;
      const int page_mask = (1 << p.page_shift) - 1;
      // Lane g < key_groups: the page of sub-tile g of stage i (0 past the walk).
      auto sub_tile_page = [&](int i) {
        const int key = key_group_sub_tile_key0(keys.tile_begin, i, SK, lane);
        return lane < kgs && i < num_stages && key < keys.kv_end ? page_row[key >> p.page_shift] : 0;
      };
      int page = sub_tile_page(spec_stages);
      for (int i = spec_stages; i < num_stages; ++i) {
        const int next_page = sub_tile_page(i + 1);  // one stage ahead: its latency hides behind the wait
        issue(i, keys.tile_begin, keys.kv_end, [&](int key0, int key_in, int64_t* slot, int64_t* tok) {
          *slot = __shfl_sync(0xffffffffu, page, key_in / kN);
          *tok = (key0 + key_in) & page_mask;
        });
        page = next_page;
      }
    }
    if (kSplit && p.cluster_combine) {  // the producer joins the merge's two cluster barriers, idle between them
      cooperative_groups::this_cluster().sync();
      cooperative_groups::this_cluster().sync();
    }
    return;
  }

  // ================= consumer warps: warp w computes KV head hk0 + w % hpc over key group w / hpc
  const KeyRange keys = key_range<kN, kSplit>(p, b, split);
  const int num_stages = key_group_walk_stages(keys.num_tiles, kgs);
  const int head = warp % hpc, kg = warp / hpc;
  const int hk = hk0 + head;
  const int g = lane / 4, t = lane % 4;
  const T* q_row[2];
  const RowBounds rows = setup_rows<T>(p, b, hk, keys.seqlen, 0, p.rows, g, q_row);
  uint32_t qa[kKSteps][4];
  load_q_fragments(q_row, t, qa);

  float o[kDTiles][4];
#pragma unroll
  for (int dt = 0; dt < kDTiles; ++dt) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.f;
  float row_max[2] = {-INFINITY, -INFINITY};
  float row_sum[2] = {0.f, 0.f};

  // This lane's ldmatrix rows in a stage (128-byte lines, cache_box_line): K (non-transposed, keys
  // lane % 8 + 8 (lane / 16), chunk parity (lane / 8) % 2) and V (transposed, keys
  // lane % 8 + 8 ((lane / 8) % 2)).
  const int k_line = cache_box_line<kHeadMajor>(kg, lane % 8 + (lane / 16) * 8, head, hpc, kBoxColBlocks, box_subs);
  const int k_hi = (lane / 8) % 2;
  const int v_line =
      cache_box_line<kHeadMajor>(kg, lane % 8 + ((lane / 8) % 2) * 8, head, hpc, kBoxColBlocks, box_subs);

  // Every issued stage is waited for (speculative ones past a short sequence too: no copy may
  // still be writing shared memory when the buffers are reused for the merge or the CTA exits).
  const int total_stages = max(num_stages, spec_stages);
  for (int it = 0; it < total_stages; ++it) {
    const int s = it % stages;
    mbar_wait(&full_bar[s], (it / stages) & 1);
    FLARE_DECODE_MARK(it == 0 && threadIdx.x == 0, kDecodeMarkLanded);
    const T* const k_stage = kv_smem + s * lay.stage_elems;
    const T* const v_stage = k_stage + kv_elems;
    const int key0 = key_group_sub_tile_key0(keys.tile_begin, it, SK, kg);
    const bool visible = !FLARE_DECODE_EXPERIMENT_SKIP_MATH &&
        it < num_stages && key0 < keys.kv_end && key0 <= rows.last_max && key0 + kN - 1 >= rows.lo_min;
    if (visible) {
      zero_v_lines_past_end<kHeadDim, kN, kHeadMajor>(v_stage, block_elems, box_subs, kg, hpc, head, key0,
                                                      keys.kv_end, lane);
      const bool full = key0 >= rows.lo_max && key0 + kN - 1 <= rows.last_min;
      // S = Q K^T: keys 0-7 and 8-15 (j), head-dim halves a and b: four independent chains.
      float sc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
      float sd[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
      const T* const k_row = k_stage + k_line * kCacheBoxCols;
#pragma unroll
      for (int ks = 0; ks < kHalf; ++ks) {
        uint32_t ba[4], bb[4];
        ldmatrix_x4(ba, k_row + swizzled_chunk(2 * ks + k_hi, k_line, block_elems));
        ldmatrix_x4(bb, k_row + swizzled_chunk(2 * (ks + kHalf) + k_hi, k_line, block_elems));
        mma_16x8x16<T>(sc[0], qa[ks], ba[0], ba[1]);
        mma_16x8x16<T>(sc[1], qa[ks], ba[2], ba[3]);
        mma_16x8x16<T>(sd[0], qa[ks + kHalf], bb[0], bb[1]);
        mma_16x8x16<T>(sd[1], qa[ks + kHalf], bb[2], bb[3]);
      }
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) sc[j][e] += sd[j][e];
      const T* const v_row = v_stage + v_line * kCacheBoxCols;
      softmax_pv_step<kDTiles, T>(sc, full, key0, t, rows, p.scale_log2, row_max, row_sum, o, [&](int dp) {
        return v_row + swizzled_chunk(2 * dp + lane / 16, v_line, block_elems);
      });
    }
    __syncwarp();
    if (lane == 0) mbar_arrive(&empty_bar[s]);  // this warp is done with the stage
  }

  FLARE_DECODE_MARK(threadIdx.x == 0, kDecodeMarkLoopDone);
  // ---- merge the key groups of each head: per row, M = the max over its key groups; each warp
  // writes O x exp2(m - M) of its real rows over the (now idle) stage buffers
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    row_sum[i] += __shfl_xor_sync(0xffffffffu, row_sum[i], 1);
    row_sum[i] += __shfl_xor_sync(0xffffffffu, row_sum[i], 2);
    if (t == 0) {
      warp_max[warp][g + 8 * i] = row_max[i];
      warp_sum[warp][g + 8 * i] = row_sum[i];
    }
  }
  consumer_sync(kConsumerThreads);  // every warp is done with the stages, and its statistics are in
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int r = g + 8 * i;
    if (r >= p.rows) continue;
    float head_max = -INFINITY;
    for (int k = 0; k < kgs; ++k) head_max = fmaxf(head_max, warp_max[k * hpc + head][r]);
    const float f = row_max[i] == -INFINITY ? 0.f : fast_exp2(row_max[i] - head_max);
    float* dst = merge_smem + (warp * 16 + r) * kMergeStride + 2 * t;
#pragma unroll
    for (int dt = 0; dt < kDTiles; ++dt)
      *reinterpret_cast<float2*>(dst + 8 * dt) = make_float2(o[dt][2 * i] * f, o[dt][2 * i + 1] * f);
  }
  consumer_sync(kConsumerThreads);
  FLARE_DECODE_MARK(threadIdx.x == 0, kDecodeMarkMerged);

  // ---- epilogue: all consumer threads, one (head, row, 8 columns) piece at a time; rows with no
  // visible key get O = 0 and LSE +inf (standard, as the oracle) or -inf (a partial state that
  // weighs nothing)
  constexpr float kLn2 = 0.69314718055994530942f;
  constexpr int kPieces = kHeadDim / 8;
  for (int idx = threadIdx.x; idx < hpc * p.rows * kPieces; idx += kConsumerThreads) {
    const int col = (idx % kPieces) * 8, head_row = idx / kPieces;
    const int r = head_row % p.rows, h_local = head_row / p.rows;
    float m = -INFINITY;
    for (int k = 0; k < kgs; ++k) m = fmaxf(m, warp_max[k * hpc + h_local][r]);
    float sum = 0.f, acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int k = 0; k < kgs; ++k) {
      const int w = k * hpc + h_local;
      const float mk = warp_max[w][r];
      if (mk != -INFINITY) sum += warp_sum[w][r] * fast_exp2(mk - m);
      const float* src = merge_smem + (w * 16 + r) * kMergeStride + col;
      const float4 lo4 = *reinterpret_cast<const float4*>(src), hi4 = *reinterpret_cast<const float4*>(src + 4);
      acc[0] += lo4.x, acc[1] += lo4.y, acc[2] += lo4.z, acc[3] += lo4.w;
      acc[4] += hi4.x, acc[5] += hi4.y, acc[6] += hi4.z, acc[7] += hi4.w;
    }
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
    const int tq = r / p.group, h = (hk0 + h_local) * p.group + r % p.group;
    const int64_t qrow = (int64_t{b} * p.heads_q + h) * p.q_len + tq;  // (b, h, t): LSE / partial order
    if (kSplit && p.cluster_combine) {
      // The state stays here for the cluster merge: over key group 0's slot of this (head, row,
      // columns), which only this thread reads (above).
      float* dst = merge_smem + (h_local * 16 + r) * kMergeStride + col;
      *reinterpret_cast<float4*>(dst) = make_float4(acc[0] * inv, acc[1] * inv, acc[2] * inv, acc[3] * inv);
      *reinterpret_cast<float4*>(dst + 4) = make_float4(acc[4] * inv, acc[5] * inv, acc[6] * inv, acc[7] * inv);
      if (col == 0) state_lse[h_local * 16 + r] = sum > 0.f ? (m + log2f(sum)) * kLn2 : -INFINITY;
    } else if constexpr (kSplit) {
      const int64_t part = qrow * p.num_splits + split;
      float* dst = p.partial_out + part * kHeadDim + col;
      *reinterpret_cast<float4*>(dst) = make_float4(acc[0] * inv, acc[1] * inv, acc[2] * inv, acc[3] * inv);
      *reinterpret_cast<float4*>(dst + 4) = make_float4(acc[4] * inv, acc[5] * inv, acc[6] * inv, acc[7] * inv);
      if (col == 0) p.partial_lse[part] = sum > 0.f ? (m + log2f(sum)) * kLn2 : -INFINITY;
    } else {
      uint4 packed;
      packed.x = ElemTraits<T>::pack(acc[0] * inv, acc[1] * inv);
      packed.y = ElemTraits<T>::pack(acc[2] * inv, acc[3] * inv);
      packed.z = ElemTraits<T>::pack(acc[4] * inv, acc[5] * inv);
      packed.w = ElemTraits<T>::pack(acc[6] * inv, acc[7] * inv);
      T* dst = static_cast<T*>(p.out) + b * p.out_stride_b + tq * p.out_stride_t + h * p.out_stride_h + col;
      *reinterpret_cast<uint4*>(dst) = packed;
      if (col == 0 && p.lse != nullptr) p.lse[qrow] = sum > 0.f ? (m + log2f(sum)) * kLn2 : INFINITY;
    }
  }

  // ---- cluster combine: every CTA of the cluster merges a slice of the rows
  if (kSplit && p.cluster_combine) {
    FLARE_DECODE_MARK(threadIdx.x == 0, kDecodeMarkEpilogueDone);
    cluster_merge<kHeadDim, T>(p, b, hk0, hpc, merge_smem, kMergeStride, state_lse, kConsumerThreads);
    FLARE_DECODE_MARK(threadIdx.x == 0, kDecodeMarkEnd);
    FLARE_DECODE_MARK(threadIdx.x == 0, kDecodeMarkEndNs);
    return;
  }

  // ---- in-kernel combine: the last CTA of (b, hb) to arrive merges every split of its rows
  if constexpr (kSplit) {
    if (in_kernel_combine) {
      __threadfence();  // this thread's partial states are visible device-wide before the arrival
      consumer_sync(kConsumerThreads);
      if (threadIdx.x == 0) {
        wait_for_prerequisite_grids();  // the counters' zeroing kernel (a no-op without one)
        int* const counter = p.counters + key_group_counter_index(b, p.heads_kv, hb);
        __threadfence();
        const bool last = atomicAdd(counter, 1) == p.num_splits - 1;
        if (last) {
          atomicExch(counter, 0);  // every split has arrived: ready for the next call
          __threadfence();         // the other CTAs' states, published before their arrivals, are visible
        }
        is_last_split = last;
      }
      consumer_sync(kConsumerThreads);
      if (is_last_split) combine_splits<kHeadDim, T, kWarps>(p, b, hk0, hpc, merge_smem);
    }
  }
  FLARE_DECODE_MARK(threadIdx.x == 0, kDecodeMarkEnd);
  FLARE_DECODE_MARK(threadIdx.x == 0, kDecodeMarkEndNs);
#endif
}

}  // namespace flare::decode
