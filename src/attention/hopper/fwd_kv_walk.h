// The key tiles a Hopper forward CTA visits, in visiting order; the producer (TMA loads) and the
// consumers (GEMMs, masks) walk the same sequence with their own cursor.
//
//   DenseKvWalk        the band's key blocks [first, last), from the last to the first (the
//                      masked blocks at the diagonal come first)
//   SparseKvWalk       a block mask's list row, expanded in shared memory (sparse_tile_list.h):
//                      the kernel tiles of the q block's PARTIAL key blocks, then of its FULL
//                      ones; the partial blocks' tiles carry the element predicate
//
// A walk answers: begin(), more(c), advance(c), tile(c) (the kernel tile: keys [kN tile, kN
// (tile + 1))), element_masked(c) (the element predicate applies) and empty().
#pragma once

#include "src/attention/hopper/sparse_tile_list.h"
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

// A block mask's list row expanded into shared memory (sparse_tile_list.h): the cursor is the
// position in it. The mask's kv block size must be a multiple of kBlockN (the launcher checks), so
// kernel tiles start at multiples of kBlockN and TMA loads them by tile index.
template <typename List>
struct SparseKvWalkOf {
  static constexpr bool kSparse = true;
  const List* list = nullptr;  // shared memory
  int count = 0;

  struct Cursor {
    int i = 0;
  };
  __device__ __forceinline__ Cursor begin() const { return {0}; }
  __device__ __forceinline__ bool more(const Cursor& c) const { return c.i < count; }
  __device__ __forceinline__ void advance(Cursor& c) const { ++c.i; }
  __device__ __forceinline__ int tile(const Cursor& c) const { return list->tiles[c.i] & kSparseTileIndex; }
  __device__ __forceinline__ bool element_masked(const Cursor& c) const {
    return (list->tiles[c.i] & kSparseTileMasked) != 0;
  }
  __device__ __forceinline__ bool empty() const { return count == 0; }
  // The document span of the CTA's row r (doc_spans.h), where has_doc_spans().
  __device__ __forceinline__ bool has_doc_spans() const { return list->doc_spans_ok != 0; }
  __device__ __forceinline__ int2 doc_span(int r) const { return list->doc_spans[r]; }
};
using SparseKvWalk = SparseKvWalkOf<SparseTileList>;

}  // namespace flare::hopper
