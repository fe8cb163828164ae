// A block mask's list row as kernel tiles: how many a listed block expands into, the encoding of
// an expanded tile (index and PARTIAL flag), and the row's first tile. Pure (no CUDA headers): the
// forward's list writer (sparse_tile_list.h) and the CTA order's kernel
// (block_sparse/sparse_fwd_order.cu) share it, and the CPU tests call it.
#pragma once

#include <cstdint>

#include "src/block_sparse/block_sparse_params.h"
#include "src/block_sparse/list_steps.h"  // list_entry: the read-only path
#include "src/scheduling/mask_math.h"  // FLARE_HD

namespace flare::hopper {

// Kernel tiles a row may expand into: 16 KB of shared memory. The launcher admits sequences of at
// most kMaxSparseTiles key tiles, which bounds any list without repeated entries.
inline constexpr int kMaxSparseTiles = 8192;
// The persistent forward's lists (two a CTA, beside two Q stages): sequences of at most this many.
inline constexpr int kMaxPersistentSparseTiles = 4096;
inline constexpr uint16_t kSparseTileMasked = 0x8000;  // the tile's block is PARTIAL (element predicate)
inline constexpr uint16_t kSparseTileIndex = 0x7fff;

// Row `row` of (b, h)'s kv lists as one run of entries: the PARTIAL blocks, then the FULL ones.
struct SparseListRow {
  const int32_t* partial = nullptr;
  const int32_t* full = nullptr;
  int num_partial = 0, num_listed = 0;

  FLARE_HD int entry(int e) const {
    return block_sparse::list_entry(e < num_partial ? partial + e : full + e - num_partial);
  }
  FLARE_HD uint16_t flag(int e) const { return e < num_partial ? kSparseTileMasked : 0; }
};
FLARE_HD SparseListRow sparse_list_row(const block_sparse::BlockSparseParams& bs, int b, int h, int row) {
  SparseListRow r;
  r.num_partial = bs.partial_kv.count(b, h, row, bs.num_kv_blocks);
  r.num_listed = r.num_partial + bs.full_kv.count(b, h, row, bs.num_kv_blocks);
  if (bs.partial_kv.counts != nullptr) r.partial = bs.partial_kv.row(b, h, row);
  if (bs.full_kv.counts != nullptr) r.full = bs.full_kv.row(b, h, row);
  return r;
}

// The kernel tiles (`tile` keys) of listed block n that start inside the sequence; none for an
// entry outside [0, num_kv_blocks) (device lists are not validated).
FLARE_HD int listed_block_tiles(const block_sparse::BlockSparseParams& bs, int n, int tile, int seqlen_k) {
  if (n < 0 || n >= bs.num_kv_blocks) return 0;
  const int start = n * bs.kv_block_size;
  const int end = start + bs.kv_block_size < seqlen_k ? start + bs.kv_block_size : seqlen_k;
  return end > start ? (end - start + tile - 1) / tile : 0;
}

// The first kernel tile of a row's expansion (fill_sparse_tile_list's tiles[0], the PARTIAL flag
// included), or -1 where the row expands into none. The CTA order's kernel (sparse_fwd_order.cu)
// writes it beside each CTA's tile, so that the producer issues the first K as soon as Q, not after
// the list's counts and entries have come from memory one after the other and the list is written.
FLARE_HD int first_sparse_tile(const block_sparse::BlockSparseParams& bs, const SparseListRow& r, int seqlen_k,
                               int tile) {
  for (int e = 0; e < r.num_listed; ++e) {
    const int n = r.entry(e);
    if (listed_block_tiles(bs, n, tile, seqlen_k) > 0) return (n * (bs.kv_block_size / tile)) | r.flag(e);
  }
  return -1;
}

}  // namespace flare::hopper
