// A block mask's list row as the Hopper forward walks it: the kernel tiles of the q block's
// PARTIAL kv blocks, then of its FULL ones, expanded once per CTA into shared memory by one warp.
// The walk's cursor is then an index into that array (fwd_kv_walk.h), as small as the dense
// walk's, and no list entry is loaded inside the main loop: reading the lists from global memory
// tile by tile held about 11 more registers in the consumers (the row pointers, counts and sizes)
// and put spill reloads and 8 % more cycles into each key step (bench/RESULTS.md, session 26).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include <cutlass/arch/barrier.h>

#include "src/attention/hopper/sparse_tiles.h"
#include "src/block_sparse/block_sparse_params.h"

namespace flare::hopper {

// The CTA's rows (the forward's q tile: kHopperSparseBlockM).
inline constexpr int kSparseListRows = 128;

// kCapacity tiles: kMaxSparseTiles where a CTA holds one list (one CTA per tile); the persistent
// grid holds two (one a Q stage) of kMaxPersistentSparseTiles, which fit its shared memory beside
// two Q stages.
template <int kCapacity_>
struct SparseTileListOf {
  static constexpr int kCapacity = kCapacity_;
  uint16_t tiles[kCapacity];  // key tile index (kTile keys), | kSparseTileMasked for a PARTIAL block's
  int count;
  // Documents masks with sorted key ids (block_sparse/doc_spans.h): row r's keys [lo, hi) of its
  // document, valid where doc_spans_ok (else the kernel looks the ids up).
  int doc_spans_ok;
  int2 doc_spans[kSparseListRows];
  uint64_t full;  // mbarrier: the list is written (an arrival from each lane of the writing warp)
};
using SparseTileList = SparseTileListOf<kMaxSparseTiles>;

// The document spans of the CTA's rows row0.. (rows past the sequence take its last row's) from
// `spans` (doc_spans.h: [batch, seqlen_q], or null: none), written by one warp; doc_spans_ok where
// every row has one.
// They are loaded by the writing warp before the list's entries (the loads in flight together) and
// stored after them.
struct DocSpanLoads {
  static constexpr int kPerLane = kSparseListRows / 32;
  int2 span[kPerLane];
  bool any = false;
};
__device__ __forceinline__ DocSpanLoads load_sparse_doc_spans(const int2* spans, int b, int row0, int seqlen_q,
                                                              int lane) {
  DocSpanLoads l;
  l.any = spans != nullptr;
  if (l.any) {
    const int2* first = spans + int64_t{b} * seqlen_q;
#pragma unroll
    for (int k = 0; k < DocSpanLoads::kPerLane; ++k) {
      const int r = lane + 32 * k, row = row0 + r < seqlen_q ? row0 + r : seqlen_q - 1;
      l.span[k] = first[row];
    }
  }
  return l;
}
template <typename List>
__device__ __forceinline__ void store_sparse_doc_spans(List& list, const DocSpanLoads& l, int lane) {
  bool ok = l.any;
  if (ok) {
#pragma unroll
    for (int k = 0; k < DocSpanLoads::kPerLane; ++k) {
      list.doc_spans[lane + 32 * k] = l.span[k];
      ok = ok && l.span[k].x >= 0;
    }
    ok = __all_sync(0xffffffffu, ok);
  }
  if (lane == 0) list.doc_spans_ok = ok ? 1 : 0;
}

// One warp writes row `row` of the mask's kv lists for (b, h) into `list`, each lane arriving on
// its barrier (initialized for 32 arrivals) after its own writes. Entries are read 32 at a time;
// each lane expands its entry into its tiles at the position a warp scan of the tile counts gives
// it. Entries outside [0, num_kv_blocks) are
// skipped (device lists are not validated); a list longer than the list's capacity (repeated
// entries; the launcher admits no sequence of more key tiles) is cut there. The rows' document spans (doc_spans.h, or none where `doc_spans` is null) come with it.
template <int kTile, typename List>
__device__ __forceinline__ void fill_sparse_tile_list(List& list, const block_sparse::BlockSparseParams& bs,
                                                      int b, int h, int row, int seqlen_k, int lane,
                                                      const int2* doc_spans, int row0, int seqlen_q) {
  const DocSpanLoads spans = load_sparse_doc_spans(doc_spans, b, row0, seqlen_q, lane);
  const SparseListRow r = sparse_list_row(bs, b, h, row);
  const int subs = bs.kv_block_size / kTile;
  int written = 0;
  for (int e0 = 0; e0 < r.num_listed; e0 += 32) {
    const int e = e0 + lane;
    const int n = e < r.num_listed ? r.entry(e) : -1;
    const int count = listed_block_tiles(bs, n, kTile, seqlen_k);
    int end = count;  // inclusive scan: this lane's tiles end at written + end
#pragma unroll
    for (int d = 1; d < 32; d *= 2) {
      const int v = __shfl_up_sync(0xffffffffu, end, d);
      if (lane >= d) end += v;
    }
    const uint16_t flag = r.flag(e);
    for (int s = 0, at = written + end - count; s < count && at < List::kCapacity; ++s, ++at)
      list.tiles[at] = static_cast<uint16_t>(n * subs + s) | flag;
    written += __shfl_sync(0xffffffffu, end, 31);
  }
  if (lane == 0) list.count = written < List::kCapacity ? written : List::kCapacity;
  store_sparse_doc_spans(list, spans, lane);
  cutlass::arch::ClusterBarrier::arrive(&list.full);  // releases this lane's writes to the walks
}

}  // namespace flare::hopper
