// The key tiles a Hopper forward CTA visits, in visiting order; the producer (TMA loads) and the
// consumers (GEMMs, masks) walk the same sequence with their own cursor.
//
//   DenseKvWalk        the band's key blocks [first, last), from the last to the first (the
//                      masked blocks at the diagonal come first)
//   SparseKvWalk<kN>   a block mask's list row (sparse_block_walk.h): the q block's PARTIAL key
//                      blocks, then its FULL ones, each cut in kernel tiles of kN keys; the
//                      partial blocks' tiles carry the element predicate
//
// A walk answers: begin(), more(c), advance(c), tile(c) (the kernel tile: keys [kN tile, kN
// (tile + 1))), element_masked(c) (the element predicate applies) and empty().
#pragma once

#include "src/attention/portable/sparse_block_walk.h"
#include "src/scheduling/mask_math.h"

namespace flare::hopper {

struct DenseKvWalk {
  static constexpr bool kSparse = false;
  sched::BlockRange range;

  struct Cursor {
    int n = 0;
  };
  __device__ __forceinline__ Cursor begin() const { return {range.last - 1}; }
  __device__ __forceinline__ bool more(const Cursor& c) const { return c.n >= range.first; }
  __device__ __forceinline__ void advance(Cursor& c) const { --c.n; }
  __device__ __forceinline__ int tile(const Cursor& c) const { return c.n; }
  __device__ __forceinline__ bool element_masked(const Cursor&) const { return false; }
  __device__ __forceinline__ bool empty() const { return range.first >= range.last; }
};

// The mask's kv block size must be a multiple of kBlockN (the launcher checks), so kernel tiles
// start at multiples of kBlockN and TMA loads them by tile index.
template <int kBlockN>
struct SparseKvWalk {
  static constexpr bool kSparse = true;
  portable::SparseBlockWalk list;

  using Cursor = portable::SparseTileCursor;
  __device__ __forceinline__ Cursor begin() const { return list.begin(); }
  __device__ __forceinline__ bool more(const Cursor& c) const { return c.block >= 0; }
  __device__ __forceinline__ void advance(Cursor& c) const { list.template advance<kBlockN>(c); }
  __device__ __forceinline__ int tile(const Cursor& c) const { return list.template tile_start<kBlockN>(c) / kBlockN; }
  __device__ __forceinline__ bool element_masked(const Cursor& c) const { return list.in_partial(c); }
  __device__ __forceinline__ bool empty() const { return !more(begin()); }
};

}  // namespace flare::hopper
