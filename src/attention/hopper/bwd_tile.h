// The Hopper backward's kernel parameters and a CTA's tile of work: the kv block it owns, the
// sequence's band, and the query steps it walks (a dense walk from src/scheduling/dq_turns.h, a
// block mask's transposed lists, or a deterministic plan's walk), with the dQ tile of a query
// block in dq_accum. Shared by both tilings (bwd_kernel.h, bwd_split_kernel.h).
#pragma once

#include <cute/tensor.hpp>

#include "src/attention/bwd_params.h"
#include "src/attention/hopper/bwd_config.h"
#include "src/attention/hopper/bwd_layouts.h"
#include "src/block_sparse/block_sparse_params.h"
#include "src/block_sparse/dq_write_order.h"
#include "src/block_sparse/list_steps.h"
#include "src/scheduling/dq_turns.h"

namespace flare::hopper {

template <typename Cfg, typename T>
struct HopperBwdParams {
  using L = BwdLayouts<Cfg, T>;
  detail::BwdKernelParams p;
  typename L::TmaQ tma_q, tma_do;
  typename L::TmaK tma_k, tma_v;
  typename L::TmaStats tma_stats;
  GShape shape_q, shape_k;
  typename L::StatsShape shape_stats;
  // Query-block walks and dQ turns (src/scheduling/dq_turns.h) with this kernel's 64 x 128 tiles;
  // in deterministic mode also the tile order of the 1D grid (head-major, kv blocks descending).
  sched::DqPlan plan;
  block_sparse::BlockSparseParams bs;  // the block mask (the sparse kernel only)
  block_sparse::DqPlanView dq_plan;    // its deterministic plan (the sparse kernel, deterministic)
};

// A query step of a CTA's walk: the 64-row query block m; `valid` false: computed fully masked
// and its dQ not added (a block mask's bad index, or a step past the sequence); `element`: the
// block mask's element predicate applies (a partial block). Dense walks' steps are all valid.
using QStep = block_sparse::ListStep;

// What only a block-sparse tile carries: the mask's transposed lists (or the plan's walk); in
// deterministic mode the plan's tile, the CTA's key slice of its kv block and, under GQA, the dK/dV
// semaphore (null: none) and turn. (A dense tile goes without.)
template <bool kSparse>
struct BwdTileSparse {};
template <>
struct BwdTileSparse<true> {
  block_sparse::ListSteps sparse;
  block_sparse::DqTile plan_tile;
  int slice = 0, key_slices = 1;
  int* dkv_sem = nullptr;
  int dkv_turn = 0;
};

template <bool kSparse_>
struct BwdTileT : BwdTileSparse<kSparse_> {
  static constexpr bool kSparse = kSparse_;
  detail::SeqInfo seq;
  sched::Band band;
  int n = 0, h = 0, b = 0, col0 = 0, keys = 0;
  sched::RowSpan full_rows;  // the query steps whose tile is FULL (no mask): by first row
  sched::DqWalk walk;  // dense: the query blocks that see any of the keys, in visiting order
  // The walk's steps [step0, step0 + walk_steps) (dense: a split tile's part, sched::tail_work;
  // kSparse, deterministic: the walk's first step in the plan); dkv_part: where a dense part adds
  // its dK and dV without GQA (null otherwise).
  int step0 = 0;
  int walk_steps = 0;
  float* dkv_part = nullptr;
  __device__ __forceinline__ int steps() const {
    if constexpr (kSparse) {
      return this->sparse.count();
    } else {
      return walk_steps;
    }
  }
  __device__ __forceinline__ QStep step_at(int step) const {
    if constexpr (kSparse) {
      return this->sparse.at(step);
    } else {
      QStep s;
      s.m = sched::q_block_at(walk, step0 + step);
      return s;
    }
  }
  __device__ __forceinline__ int m_at(int step) const { return step_at(step).m; }
};
using BwdTile = BwdTileT<false>;

// Tile `tile` of the ordinary grid's order: kv block fastest, then head, then sequence (its 3D grid's
// blockIdx order; the 1D grid of a tail split numbers its tiles so too).
__device__ __forceinline__ sched::TileCoord ordinary_bwd_tile(const detail::BwdKernelParams& P, int64_t tile) {
  sched::TileCoord c;
  c.block = static_cast<int>(tile % P.num_n_blocks);
  c.head = static_cast<int>(tile / P.num_n_blocks % P.fwd.heads);
  c.batch = static_cast<int>(tile / P.num_n_blocks / P.fwd.heads);
  return c;
}

// Ordinary mode: the 3D grid (kv block, head, sequence), for masked work a 1D grid over the tile
// order (detail::dense_bwd_grid), or with a tail split a 1D grid of whole tiles and parts
// (sched::tail_work). Deterministic: a 1D grid in the plan's
// tile order, which CTAs start in, as the turn order's deadlock freedom assumes. kSparse: the 3D
// grid over the kernel's 128-key blocks, the steps from the block mask's lists.
template <typename Cfg, bool kSparse = false, typename Params>
__device__ __forceinline__ BwdTileT<kSparse> bwd_tile_of(const Params& hp) {
  const detail::BwdKernelParams& P = hp.p;
  const detail::FwdKernelParams& p = P.fwd;
  BwdTileT<kSparse> t;
  if (kSparse && P.deterministic) {
    if constexpr (kSparse) {
      t.key_slices = hp.bs.kv_block_size / Cfg::kBlockN;
      t.slice = blockIdx.x % t.key_slices;
      t.plan_tile = hp.dq_plan.tile_at(blockIdx.x / t.key_slices);
      t.n = t.plan_tile.kv_block * t.key_slices + t.slice;
      t.h = t.plan_tile.head, t.b = t.plan_tile.batch;
    }
  } else if (P.deterministic) {
    const sched::TileCoord c = sched::tile_at(hp.plan.order, blockIdx.x);
    t.n = c.block, t.h = c.head, t.b = c.batch;
  } else if (!kSparse && P.tail.active()) {  // a 1D grid: whole tiles in (n, h, b) order, then parts
    const sched::TileCoord c = ordinary_bwd_tile(P, sched::tail_work(P.tail, blockIdx.x, 0).tile);
    t.n = c.block, t.h = c.head, t.b = c.batch;
  } else if (!kSparse && p.order.num_tiles > 0) {  // masked work: a 1D grid over the tile order (dense_bwd_grid)
    const sched::TileCoord c = sched::tile_at(p.order, blockIdx.x);
    t.n = c.block, t.h = c.head, t.b = c.batch;
  } else {
    t.n = blockIdx.x, t.h = blockIdx.y, t.b = blockIdx.z;
  }
  t.seq = detail::seq_info(p, t.b);
  t.band = detail::band_of(p, t.seq);
  t.col0 = t.n * Cfg::kBlockN;
  t.keys = t.seq.seqlen_k - t.col0 < Cfg::kBlockN ? t.seq.seqlen_k - t.col0 : Cfg::kBlockN;
  t.full_rows = sched::full_row_tiles(t.band, t.col0, t.col0 + Cfg::kBlockN, t.seq.seqlen_k, Cfg::kBlockM);
  if constexpr (kSparse) {
    // The kernel's key block lies in one mask kv block (kv_block_size % kBlockN == 0: the launcher checks).
    if (t.keys <= 0 && !P.deterministic) return t;
    const block_sparse::BlockSparseParams& bs = hp.bs;
    if (P.deterministic) {  // the plan's walk (a CTA without keys still walks it: its turns)
      const block_sparse::DqPlanView& plan = hp.dq_plan;
      t.step0 = plan.walk_begin(t.plan_tile);
      t.sparse = block_sparse::planned_list_steps(plan.data + plan.layout.walk_q_blocks + t.step0,
                                                  plan.data + plan.layout.walk_is_full + t.step0,
                                                  plan.walk_end(t.plan_tile) - t.step0, bs.q_block_size,
                                                  bs.num_q_blocks, t.seq.seqlen_q, Cfg::kBlockM);
      if (p.group > 1) {
        t.dkv_sem = P.dkv_semaphore + plan.dkv_slice_semaphore(t.b, t.h / p.group, t.plan_tile.kv_block, t.slice,
                                                               t.key_slices);
        t.dkv_turn = plan.dkv_turn(t.plan_tile);
      }
    } else {
      t.sparse = block_sparse::list_steps(bs.partial_q, bs.full_q, t.b, t.h, t.col0 / bs.kv_block_size,
                                          bs.q_block_size, bs.num_q_blocks, t.seq.seqlen_q, Cfg::kBlockM);
    }
  } else {
    if (t.keys > 0)
      t.walk = sched::dq_walk(hp.plan, sched::dq_sequence(hp.plan, t.seq.seqlen_q, t.seq.seqlen_k, t.b, t.h), t.n);
    t.walk_steps = t.walk.count;
    if (!P.deterministic && P.tail.active()) {
      const sched::TailWork w = sched::tail_work(P.tail, blockIdx.x, t.walk.count);
      t.step0 = w.begin;
      t.walk_steps = w.end - w.begin;
      if (w.part >= 0 && P.dkv_tail != nullptr)
        t.dkv_part = P.dkv_tail + (w.tile - P.tail.whole) * Cfg::kBlockN * p.head_dim;
    }
  }
  return t;
}

// The dQ tile of 64-row query block m64 in dq_accum, in thread order (detail::hopper_dq_tile_offset):
// threads write it with conflict-free 16-byte stores and the block is one contiguous bulk add (the
// tiles of consecutive blocks are consecutive); hopper_dq_convert_kernel maps it back to (row,
// column). Null when a malformed cu_seqlens list (device values, not validated) would place it outside.
template <typename Cfg>
__device__ __forceinline__ float* hopper_dq_tile(const detail::BwdKernelParams& P, int64_t q_start, int b, int h,
                                                 int m64) {
  constexpr int kRows = detail::kRowStatsBlockM;
  const int64_t first_row = detail::accum_row(P.fwd, b, q_start, 0, P.fwd.seqlen_q);
  const int64_t row0 = detail::hopper_dq_padded_start(first_row, b) + int64_t{m64} * kRows;
  if (row0 < 0 || row0 + kRows > P.dq_padded_rows) return nullptr;
  return P.dq_accum + (int64_t{h} * P.dq_padded_rows + row0) * Cfg::kHeadDim;
}

}  // namespace flare::hopper
