// The walk of one block-sparse list row in kernel tiles, shared by the portable block-sparse
// forward (a q block's kv blocks, fwd_sparse_kernel.h) and backward (a kv block's q blocks,
// bwd_sparse_kernel.h): the row's PARTIAL blocks first, then its FULL ones, each listed block
// ceil(block_size / kTile) kernel tiles, the last one cut at the block's end (or the sequence's).
#pragma once

#include <cstdint>

#include "src/block_sparse/block_sparse_params.h"

namespace flare::portable {

// Where a walk is: list position (partial blocks first, then full), the listed block there, and
// the kernel tile inside it.
struct SparseTileCursor {
  int pos = 0;
  int block = -1;  // -1: past the end
  int sub = 0;
};

struct SparseBlockWalk {
  const int32_t* partial;
  const int32_t* full;
  int num_partial, num_total;
  int block_size, num_blocks, seqlen;  // of the listed side
  // A planned walk (the deterministic backward's, dq_write_order.h): `partial` holds the blocks in
  // walk order and this flags the full ones; null for a list walk.
  const int32_t* full_flags = nullptr;

  // The steps of a planned walk: blocks[i], full when is_full[i] != 0.
  static __device__ __forceinline__ SparseBlockWalk planned(const int32_t* blocks, const int32_t* is_full, int steps,
                                                            int block_size, int num_blocks, int seqlen) {
    SparseBlockWalk w;
    w.partial = blocks;
    w.full = nullptr;
    w.full_flags = is_full;
    w.num_partial = w.num_total = steps;
    w.block_size = block_size;
    w.num_blocks = num_blocks;
    w.seqlen = seqlen;
    return w;
  }

  // Row `row` of the lists (partial, full) of (b, h).
  static __device__ __forceinline__ SparseBlockWalk of(const block_sparse::BlockListParams& partial,
                                                       const block_sparse::BlockListParams& full, int b, int h,
                                                       int row, int block_size, int num_blocks, int seqlen) {
    SparseBlockWalk w;
    w.num_partial = partial.count(b, h, row, num_blocks);
    w.num_total = w.num_partial + full.count(b, h, row, num_blocks);
    w.partial = partial.counts ? partial.row(b, h, row) : nullptr;
    w.full = full.counts ? full.row(b, h, row) : nullptr;
    w.block_size = block_size;
    w.num_blocks = num_blocks;
    w.seqlen = seqlen;
    return w;
  }

  __device__ __forceinline__ int block_at(int pos) const {
    return pos < num_partial ? partial[pos] : full[pos - num_partial];
  }
  __device__ __forceinline__ bool in_partial(const SparseTileCursor& c) const {
    return full_flags != nullptr ? full_flags[c.pos] == 0 : c.pos < num_partial;
  }
  // The first listed block at or after `pos` that is in range (device lists are not validated).
  __device__ __forceinline__ void settle(SparseTileCursor& c) const {
    for (; c.pos < num_total; ++c.pos) {
      const int n = block_at(c.pos);
      if (n >= 0 && n < num_blocks) {
        c.block = n;
        return;
      }
    }
    c.block = -1;
  }
  __device__ __forceinline__ SparseTileCursor begin() const {
    SparseTileCursor c;
    settle(c);
    return c;
  }
  __device__ __forceinline__ int block_end(int n) const { return min((n + 1) * block_size, seqlen); }
  // The first position of the cursor's kernel tile.
  template <int kTile>
  __device__ __forceinline__ int tile_start(const SparseTileCursor& c) const {
    return c.block * block_size + c.sub * kTile;
  }
  // The next kernel tile (only while c.block >= 0).
  template <int kTile>
  __device__ __forceinline__ void advance(SparseTileCursor& c) const {
    ++c.sub;
    if (tile_start<kTile>(c) >= block_end(c.block)) {
      c.sub = 0;
      ++c.pos;
      settle(c);
    }
  }
};

}  // namespace flare::portable
