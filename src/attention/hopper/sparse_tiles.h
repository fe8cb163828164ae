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
inline constexpr uint16_t kSparseTileMasked = 0x8000;  // the tile's block is PARTIAL (element predicate)
inline constexpr uint16_t kSparseTileIndex = 0x7fff;

// The kernel tiles of listed block n (block_size keys) that start inside the sequence.
FLARE_HD int tiles_of_block(int n, int block_size, int tile, int seqlen) {
  const int start = n * block_size;
  const int end = start + block_size < seqlen ? start + block_size : seqlen;
  return end > start ? (end - start + tile - 1) / tile : 0;
}

// The first kernel tile of row `row`'s expansion below (its tiles[0], the PARTIAL flag included), or
// -1 where the row expands into none. The CTA order's kernel (sparse_fwd_order.cu) writes it beside
// each CTA's tile, so that the producer issues the first K and V as soon as Q, not after the list's
// counts and entries have come from memory one after the other and the list is written.
FLARE_HD int first_sparse_tile(const block_sparse::BlockSparseParams& bs, int b, int h, int row, int seqlen_k,
                               int tile) {
  const int num_partial = bs.partial_kv.count(b, h, row, bs.num_kv_blocks);
  const int num_listed = num_partial + bs.full_kv.count(b, h, row, bs.num_kv_blocks);
  for (int e = 0; e < num_listed; ++e) {
    const int n = block_sparse::list_entry(e < num_partial ? bs.partial_kv.row(b, h, row) + e
                                                           : bs.full_kv.row(b, h, row) + e - num_partial);
    if (n >= 0 && n < bs.num_kv_blocks && tiles_of_block(n, bs.kv_block_size, tile, seqlen_k) > 0)
      return (n * (bs.kv_block_size / tile)) | (e < num_partial ? kSparseTileMasked : 0);
  }
  return -1;
}

}  // namespace flare::hopper
