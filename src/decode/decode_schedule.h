// Scheduling math of the key-group decode kernel (decode_key_groups_kernel.h): CTA layout, which
// keys a stage and a warp's sub-tile hold, heads per CTA, arrival counters, and the in-kernel
// combine's warps per row. Pure __host__ __device__ code: the kernel and its launcher call these
// functions, and tests/cpu/test_decode_schedule.cpp checks them against brute force.
//
// The CTA. heads_per_cta KV heads of one sequence and one key range (split), consumer_warps warps
// of compute plus one producer warp. The consumer warps are heads x key groups: warp w computes
// head w % heads_per_cta over key group w / heads_per_cta. A pipeline stage holds stage_keys =
// 16 x key_groups consecutive keys (K and V rows of all the CTA's heads); key group g takes the
// stage's keys [16 g, 16 g + 16), its sub-tile. So whatever heads_per_cta is, every stage feeds
// every consumer warp 16 keys of one head, and a stage is about the same number of bytes (16 keys
// x 8 heads x head dim 128 x 2 bytes x K and V = 64 KB + padding): a narrow CTA no longer leaves
// warps idle or walks its keys with one warp.
#pragma once

#include <cstdint>

#ifndef FLARE_HD
#ifdef __CUDACC__
#define FLARE_HD __host__ __device__ __forceinline__
#else
#define FLARE_HD inline
#endif
#endif

namespace flare::decode {

inline constexpr int kSubTileKeys = 16;          // keys per warp step: one k-step of P V
inline constexpr int kKeyGroupMaxStages = 8;
// Dynamic shared memory for the stages: an H100 block may take 227 KB, the rest is static
// (barriers, per-warp row statistics). Three stages of the widest rows fit.
inline constexpr int kKeyGroupSmemBudget = 224 * 1024;
// No row padding: the stages are TMA boxes in 128-byte swizzled lines (decode_tensor_maps.h), which
// is what keeps ldmatrix's rows on distinct banks.
inline constexpr int kKeyGroupRowPad = 0;
// The stages' alignment (the 128-byte swizzle repeats every 1024 bytes): the dynamic shared
// memory holds this much slack in front of them.
inline constexpr int kKeyGroupSmemAlign = 1024;
inline constexpr int kKeyGroupMergePad = 8;      // floats per merge row: float2 stores at most 2-way conflicted
// The in-kernel combine's most states per row (kMaxDecodeSplits: checked where both are seen).
inline constexpr int kCombineMaxStates = 128;

FLARE_HD constexpr int key_group_consumer_warps(int head_dim) { return head_dim > 128 ? 4 : 8; }

struct KeyGroupLayout {
  int heads_per_cta = 0;
  int key_groups = 0;      // consumer warps per head
  int consumer_warps = 0;  // heads_per_cta x key_groups
  int row_elems = 0;       // one key's K (or V) row of the CTA's heads, in elements: heads_per_cta x head_dim
  int stage_keys = 0;      // kSubTileKeys x key_groups
  int stages = 0;
  int stage_elems = 0;     // 2 x stage_keys x row_elems (K, then V; each in 64-column blocks of 128-byte lines)
  int smem_bytes = 0;      // dynamic shared memory: the stages, or the merge buffer where larger, + kKeyGroupSmemAlign
};

// Bytes of the buffer the key groups merge through after the walk: fp32 [consumer_warps][16][head_dim + pad].
// The in-kernel combine reuses it: fp32 [consumer_warps][head_dim + kCombineMaxStates].
FLARE_HD constexpr int key_group_merge_bytes(int head_dim) {
  return key_group_consumer_warps(head_dim) * 16 * (head_dim + kKeyGroupMergePad) * 4;
}
FLARE_HD constexpr int key_group_combine_bytes(int head_dim) {
  return key_group_consumer_warps(head_dim) * (head_dim + kCombineMaxStates) * 4;
}
static_assert(key_group_combine_bytes(64) <= key_group_merge_bytes(64) &&
                  key_group_combine_bytes(128) <= key_group_merge_bytes(128) &&
                  key_group_combine_bytes(256) <= key_group_merge_bytes(256),
              "the combine's scratch fits in the merge buffer");

// heads_per_cta divides consumer_warps (a power of two up to it). max_keys: the most keys one CTA
// walks (kv_chunk for a split, the cache capacity otherwise): a short walk needs fewer stages,
// and less shared memory lets more CTAs share an SM.
FLARE_HD KeyGroupLayout key_group_layout(int head_dim, int elem_bytes, int heads_per_cta, int64_t max_keys) {
  KeyGroupLayout l;
  l.consumer_warps = key_group_consumer_warps(head_dim);
  l.heads_per_cta = heads_per_cta;
  l.key_groups = l.consumer_warps / heads_per_cta;
  l.row_elems = heads_per_cta * head_dim + kKeyGroupRowPad;
  l.stage_keys = kSubTileKeys * l.key_groups;
  l.stage_elems = 2 * l.stage_keys * l.row_elems;
  const int stage_bytes = l.stage_elems * elem_bytes;
  const int64_t tiles = (max_keys + kSubTileKeys - 1) / kSubTileKeys;
  const int64_t needed = (tiles + l.key_groups - 1) / l.key_groups;
  int stages = (kKeyGroupSmemBudget - kKeyGroupSmemAlign) / stage_bytes;
  if (stages > kKeyGroupMaxStages) stages = kKeyGroupMaxStages;
  if (stages > needed) stages = static_cast<int>(needed);
  l.stages = stages < 1 ? 1 : stages;
  const int merge = key_group_merge_bytes(head_dim);
  l.smem_bytes = (l.stages * stage_bytes > merge ? l.stages * stage_bytes : merge) + kKeyGroupSmemAlign;
  return l;
}

// The most KV heads per CTA: the largest power of two up to the consumer warps that divides heads_kv.
FLARE_HD int key_group_max_heads_per_cta(int head_dim, int heads_kv) {
  int h = key_group_consumer_warps(head_dim);
  while (h > 1 && heads_kv % h != 0) h /= 2;
  return h;
}

// Heads per CTA of a launch. A plan's explicit value (validated by the planner: a power of two
// dividing heads_kv within the head dim's cap) is used as is, capped at the maximum. Otherwise
// the widest CTA (fewest, longest copies), halved while the grid would fill fewer than half the
// SMs: small batches with few splits then still stream on most SMs, each CTA with all its warps.
FLARE_HD int key_group_heads_per_cta(int requested, int max_heads, int64_t batch, int heads_kv, int num_splits,
                                     int num_sms) {
  if (requested > 0) return requested < max_heads ? requested : max_heads;
  int h = max_heads;
  while (h > 1 && batch * (heads_kv / h) * num_splits < num_sms / 2) h /= 2;
  return h;
}

// Stages a walk of num_tiles 16-key tiles takes (the last may be partly filled).
FLARE_HD int key_group_walk_stages(int num_tiles, int key_groups) { return (num_tiles + key_groups - 1) / key_groups; }

// The first key of stage `stage` of a walk from walk_begin, and of key group g's sub-tile in it.
FLARE_HD int key_group_stage_key0(int walk_begin, int stage, int stage_keys) { return walk_begin + stage * stage_keys; }
FLARE_HD int key_group_sub_tile_key0(int walk_begin, int stage, int stage_keys, int key_group) {
  return walk_begin + stage * stage_keys + kSubTileKeys * key_group;
}

// Speculative stages: on a contiguous cache without a window a split's keys start at split_begin
// whatever the sequence's length, so the producer issues up to `stages` stages of keys
// [split_begin, cap) before reading the length, cap = min(split end, max_cache_len) (inside the
// cache). 0 when not speculating or the split starts past the cache.
FLARE_HD int key_group_speculative_stages(bool speculate, int64_t split_begin, int64_t split_end, int64_t max_cache_len,
                                          int stage_keys, int stages) {
  if (!speculate || split_begin >= max_cache_len) return 0;
  const int64_t cap = split_end < max_cache_len ? split_end : max_cache_len;
  const int64_t n = (cap - split_begin + stage_keys - 1) / stage_keys;
  return n < stages ? static_cast<int>(n) : stages;
}

// The in-kernel combine's arrival counter of (sequence b, head block hb): one int32 per
// (sequence, KV head) in the workspace covers every heads_per_cta (head blocks <= heads_kv).
FLARE_HD int64_t key_group_counter_index(int b, int heads_kv, int head_block) {
  return int64_t{b} * heads_kv + head_block;
}

// In-kernel combine: warps sharing one row's states (a power of two; every row of the CTA at
// once when they fit, else one warp per row, in passes).
FLARE_HD int combine_warps_per_row(int consumer_warps, int rows) {
  int w = 1;
  while (2 * w * rows <= consumer_warps) w *= 2;
  return w;
}

}  // namespace flare::decode
