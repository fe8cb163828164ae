// Host side of the key-group decode kernel's cache loads: TMA tensor maps of the K and V caches.
//
// A cache, contiguous [batch, max_cache_len, heads_kv, d] or paged [num_pages, page_size,
// heads_kv, d], is a 5-D tensor to the TMA unit: (64 columns, token, head, column block, batch or
// page) where a CTA has 2+ heads (head-major, below), (64 columns, head, token, column block, ...)
// at one. One load is a box of 64 columns x 16 tokens x heads_per_cta heads x every column block
// (d / 64) of one sequence or page: a sub-tile's whole rows, written to shared memory as
// column-block-major 128-byte lines, 128-byte swizzled (the 16-byte chunk j of line r lands at
// chunk j ^ (r % 8), so ldmatrix's eight rows of one column chunk, eight keys of a head, hit eight
// bank groups). One such load replaces 16 x heads_per_cta x d / 64 row pieces: the TMA unit took
// about 30 ns per bulk copy of a 256-512 byte row, which capped a CTA of one or two heads at about
// 17 GB/s and made its first stage land 5 us after its start (bench/RESULTS.md, session 18).
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <cstdint>
#include <mutex>

namespace flare::decode {

inline constexpr int kCacheBoxCols = 64;   // columns per load: 128 bytes, the swizzle's span
inline constexpr int kCacheBoxTokens = 16; // tokens per load: one sub-tile (cache_box_tokens)

// Head-major boxes: the map's dimensions are (64 columns, token, head, column block, batch or
// page), so a box's column block lands as heads_per_cta x 16 lines of 128 bytes, head-major, and
// the 8 keys of an ldmatrix (consecutive lines) take 8 distinct swizzle phases whatever
// heads_per_cta is. Token-major boxes (64 columns, head, token, ...) put one head's keys
// heads_per_cta lines apart: with 8 heads a CTA all 8 keys of an ldmatrix share a swizzle phase
// (8-way bank conflicts), with 4 heads 4-way, with 2 heads 2-way. With one head a CTA both orders
// give the same lines, and the token-major map and kernel (the kernel's kHeadMajor = false
// instantiation) are kept: at batch 1 up to 4096 keys, all plans of one head a CTA, the head-major
// map ran 3-6 % slower (bench/RESULTS.md, session 43; a kernel choosing the order at run time
// measured 0-5 % slower there and level in session 44). FLARE_DECODE_HEAD_MAJOR_BOXES=0 keeps
// token-major boxes throughout (an A/B switch).
#ifndef FLARE_DECODE_HEAD_MAJOR_BOXES
#define FLARE_DECODE_HEAD_MAJOR_BOXES 1
#endif
__host__ __device__ constexpr bool cache_boxes_head_major(int heads_per_cta) {
  return FLARE_DECODE_HEAD_MAJOR_BOXES && heads_per_cta > 1;
}

// The L2 promotion of a CTA's cache boxes, in bytes, from the most keys it walks. 256-byte
// promotion cost long walks 5-7 %: at batch 8, 32768-65536 keys (4 splits of 4 heads a CTA) 128
// bytes ran 0.94-0.96 of its time, and a probe streaming 2 GiB through these boxes read at 0.94 of
// the copy with 256 bytes and 1.01 with 128 or none. Short walks (one head a CTA and 512 keys or
// fewer: batch 1 up to 4096 keys, batch 8 at 256-512) ran 1-3 % faster with 256, which brings a
// box line's 256-byte neighbour into L2 with it (bench/RESULTS.md, session 44).
// FLARE_DECODE_MAP_L2_PROMOTION_BYTES (0, 64, 128 or 256) forces one (an A/B switch).
#ifndef FLARE_DECODE_MAP_L2_PROMOTION_BYTES
#define FLARE_DECODE_MAP_L2_PROMOTION_BYTES -1
#endif
inline constexpr int64_t kCacheMapShortWalkKeys = 1024;
__host__ __device__ constexpr int cache_map_l2_promotion_bytes(int64_t max_keys) {
  return FLARE_DECODE_MAP_L2_PROMOTION_BYTES >= 0 ? FLARE_DECODE_MAP_L2_PROMOTION_BYTES
         : max_keys <= kCacheMapShortWalkKeys     ? 256
                                                  : 128;
}
inline CUtensorMapL2promotion cache_map_l2_promotion(int bytes) {
  return bytes == 256 ? CU_TENSOR_MAP_L2_PROMOTION_L2_256B
         : bytes == 128 ? CU_TENSOR_MAP_L2_PROMOTION_L2_128B
         : bytes == 64  ? CU_TENSOR_MAP_L2_PROMOTION_L2_64B
                        : CU_TENSOR_MAP_L2_PROMOTION_NONE;
}

// Row boxes: a box holds every column block of its sub-tile's rows (the column block is the map's
// fourth dimension), so a stage takes one load of K and one of V per sub-tile where it took one per
// 64 columns: 16 KB boxes instead of 8 KB at 4 heads a CTA and head dim 128. A probe streaming
// 2 GiB through the kernel's boxes at 8 heads a CTA read at 1.05 of the copy with row boxes (the
// speed of 2 KB bulk copies) against 1.01-1.03 per column block, and the kernel ran 0.976 of its
// time (geometric mean over batch 1 and 8, 256-65536 keys; 0.90-0.97 at batch 1 up to 4096 keys)
// (bench/RESULTS.md, session 44). FLARE_DECODE_ROW_BOXES=0 loads a box per column block, each
// column block of the stage a region of its own (an A/B switch).
#ifndef FLARE_DECODE_ROW_BOXES
#define FLARE_DECODE_ROW_BOXES 1
#endif
inline constexpr bool kCacheRowBoxes = FLARE_DECODE_ROW_BOXES != 0;

// Tokens per box on a contiguous cache: a sub-tile's 16, or with FLARE_DECODE_STAGE_BOXES=1 the
// whole stage's (at one head a CTA, one box of K and one of V a stage where there were 8 each). At
// batch 8 with 256-512 keys a contiguous cache's speculative stages (32-48 boxes) were all issued
// 2.2-3.4 us after the setup, about 70 ns a box, and the first stage landed 3.5-5.3 us into the CTA
// (bench/RESULTS.md, session 44). A paged cache's boxes stay one sub-tile (16 tokens, never across
// a page). Measured against sub-tile boxes (H200, 3 alternating rounds): contiguous batch 1 256 keys
// 0.94, 8192 and 32768 keys 0.96, batch 8 1024 keys 0.97, but batch 1 2048-4096 keys 1.02-1.03 and
// batch 8 512 keys 1.03; geometric mean 0.999 (bench/RESULTS.md, session 45). Off: a plan choice the
// tuner could make, not a rule.
#ifndef FLARE_DECODE_STAGE_BOXES
#define FLARE_DECODE_STAGE_BOXES 0
#endif
__host__ __device__ constexpr int cache_box_tokens(bool contiguous, int stage_keys) {
  return FLARE_DECODE_STAGE_BOXES && contiguous ? stage_keys : kCacheBoxTokens;
}

// The shared-memory line (128 bytes) of key `key` of head `head` in sub-tile `sub` of a stage's K
// (or V), column block 0; column block c lies cache_col_block_lines(...) x c lines further. A box
// holds box_subs sub-tiles (box_subs x 16 tokens) x heads_per_cta x col_blocks lines (row boxes:
// col_blocks = d / 64; per column block boxes: 1, the column blocks then a stage apart), head-major
// or token-major inside; the stage's boxes follow one another.
template <bool kHeadMajor>
__host__ __device__ constexpr int cache_box_line(int sub, int key, int head, int heads_per_cta, int col_blocks,
                                                 int box_subs = 1) {
  const int box_tokens = box_subs * kCacheBoxTokens, t = sub % box_subs * kCacheBoxTokens + key;
  return sub / box_subs * col_blocks * box_tokens * heads_per_cta +
         (kHeadMajor ? head * box_tokens + t : t * heads_per_cta + head);
}
// Lines between column blocks: a box's column block (row boxes) or a stage's.
__host__ __device__ constexpr int cache_col_block_lines(int heads_per_cta, int stage_keys, int box_subs = 1) {
  return kCacheRowBoxes ? box_subs * kCacheBoxTokens * heads_per_cta : stage_keys * heads_per_cta;
}
// Column blocks in one box.
__host__ __device__ constexpr int cache_box_col_blocks(int head_dim) {
  return kCacheRowBoxes ? head_dim / kCacheBoxCols : 1;
}

// The driver's encoder (through the runtime: no -lcuda), or null.
inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();
      return static_cast<PFN_cuTensorMapEncodeTiled_v12000>(nullptr);
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }();
  return fn;
}

// What a cache's map depends on (strides in elements).
struct CacheMapKey {
  const void* base = nullptr;
  int64_t head_dim = 0, heads = 0, extent_1 = 0, extent_0 = 0;
  int64_t stride_h = 0, stride_tok = 0, stride_0 = 0;
  int box_heads = 0, box_tokens = kCacheBoxTokens, elem_bytes = 0;
  bool head_major = false;  // the dimension order (the launcher's: cache_boxes_head_major(box_heads))
  int l2_promotion_bytes = 256;  // the launcher's: cache_map_l2_promotion_bytes(the CTA's walk)
  bool bf16 = false;
  bool operator==(const CacheMapKey&) const = default;
};

// Encodes the map of `key` into *map (false where the driver refuses it). The last few maps are
// kept, so a decode loop over a few layers' caches encodes each once.
inline bool cache_tensor_map(const CacheMapKey& key, CUtensorMap* map) {
  constexpr int kKept = 8;
  static std::mutex mutex;
  static CacheMapKey keys[kKept];
  static CUtensorMap maps[kKept];
  static int next = 0;
  std::lock_guard<std::mutex> lock(mutex);
  for (int i = 0; i < kKept; ++i)
    if (keys[i].base != nullptr && keys[i] == key) {
      *map = maps[i];
      return true;
    }
  const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  if (encode == nullptr) return false;
  const int64_t eb = key.elem_bytes;
  const cuuint64_t heads = static_cast<cuuint64_t>(key.heads), tokens = static_cast<cuuint64_t>(key.extent_1);
  const cuuint64_t head_stride = static_cast<cuuint64_t>(key.stride_h * eb);
  const cuuint64_t tok_stride = static_cast<cuuint64_t>(key.stride_tok * eb);
  const cuuint32_t box_heads = static_cast<cuuint32_t>(key.box_heads);
  const bool head_major = key.head_major;
  // (64 columns, token and head in the box's order, column block, batch or page); the column block
  // has one box row (a box per column block) unless kCacheRowBoxes
  const cuuint64_t col_blocks = static_cast<cuuint64_t>(key.head_dim / kCacheBoxCols);
  const cuuint64_t dims[5] = {static_cast<cuuint64_t>(kCacheBoxCols), head_major ? tokens : heads,
                              head_major ? heads : tokens, col_blocks, static_cast<cuuint64_t>(key.extent_0)};
  const cuuint64_t strides[4] = {head_major ? tok_stride : head_stride, head_major ? head_stride : tok_stride,
                                 static_cast<cuuint64_t>(kCacheBoxCols * eb),
                                 static_cast<cuuint64_t>(key.stride_0 * eb)};
  const cuuint32_t box_tokens = static_cast<cuuint32_t>(key.box_tokens);
  const cuuint32_t box[5] = {kCacheBoxCols, head_major ? box_tokens : box_heads, head_major ? box_heads : box_tokens,
                             static_cast<cuuint32_t>(cache_box_col_blocks(static_cast<int>(key.head_dim))), 1};
  const cuuint32_t unit[5] = {1, 1, 1, 1, 1};
  CUtensorMap m;
  const CUresult r = encode(&m, key.bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 5,
                            const_cast<void*>(key.base), dims, strides, box, unit, CU_TENSOR_MAP_INTERLEAVE_NONE,
                            CU_TENSOR_MAP_SWIZZLE_128B, cache_map_l2_promotion(key.l2_promotion_bytes),
                            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) return false;
  keys[next] = key;
  maps[next] = m;
  next = (next + 1) % kKept;
  *map = m;
  return true;
}

}  // namespace flare::decode
