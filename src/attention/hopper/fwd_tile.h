// The Hopper forward kernel's data (fwd_kernel.h): its parameters, its shared memory (Q, K and V
// stages, their barriers, a block mask's expanded list rows), where each role stands in the
// pipelines, and the tile a CTA (or, persistent, each of its turns) works on.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "src/attention/fwd_params.h"
#include "src/attention/hopper/fwd_config.h"
#include "src/attention/hopper/fwd_grid.h"
#include "src/attention/hopper/fwd_kv_walk.h"
#include "src/attention/hopper/fwd_layouts.h"
#include "src/attention/hopper/fwd_timeline.h"
#include "src/attention/hopper/stage_ring.h"
#include "src/block_sparse/block_sparse_params.h"
#include "src/scheduling/mask_math.h"

// Causal tiles shifted so that the ragged one comes first (sched::row_tile_shift); 0 for A/B builds.
#ifndef FLARE_HOPPER_FWD_ROW_SHIFT
#define FLARE_HOPPER_FWD_ROW_SHIFT 1
#endif

namespace flare::hopper {

template <typename Cfg, typename T>
struct HopperFwdParams {
  using L = FwdLayouts<Cfg, T>;
  detail::FwdKernelParams p;
  typename L::TmaQ tma_q;
  typename L::TmaKV tma_k, tma_v;
  GShape shape_q, shape_k;  // (rows, head dim, heads, batch) as the tensor maps were made
  block_sparse::BlockSparseParams bs;  // the block mask (the sparse kernel only)
  // The sparse kernel's CTA order (sched::SparseOrder: record i is the encoded tile
  // sparse_order[i].x, (batch x heads + head) x q tiles + q tile, whose list row's first key tile is
  // sparse_order[i].y: first_sparse_tile), which a 1-D grid of one CTA per tile runs CTA i for
  // record i and the persistent grid claims from next_tile; or null: the grid's (q tile descending,
  // head, batch).
  const int2* sparse_order = nullptr;
  // The sparse kernel's document spans (block_sparse/doc_spans.h: int2 [batch, seqlen_q]), or null:
  // partial tiles look the document ids up.
  const int2* doc_spans = nullptr;
  // The persistent grid's tile counter (dense: its launch's slot); the sparse grid's is two words,
  // tiles claimed and tiles done (the order kernel zeroes them).
  int* next_tile = nullptr;
  // One CTA per tile, dense: the last tiles split into key ranges (fwd_grid.h; inactive: none), a 1D
  // grid of the whole tiles in (m block, head, sequence) order, then the parts; each part's O and
  // LSE go to its slot of `partial` (FwdPartSlot, [split tile, part]).
  sched::TailSplit tail;
  float* partial = nullptr;
#if FLARE_HOPPER_FWD_TIMELINE
  unsigned long long* timeline = nullptr;  // fwd_timeline.h
#endif
};

// The timeline buffer (fwd_timeline.h), null (every mark compiled away) in default builds.
template <typename Cfg, typename T>
__device__ __forceinline__ unsigned long long* timeline_of(const HopperFwdParams<Cfg, T>& hp) {
#if FLARE_HOPPER_FWD_TIMELINE
  return hp.timeline;
#else
  (void)hp;
  return nullptr;
#endif
}

// The block-sparse kernel's expanded list row (sparse_tile_list.h); nothing in the dense kernel.
// The persistent sparse grid holds a list a Q stage and the tile the producer announced for the
// stage to the list writer (sparse_list_writer): {order index, encoded tile, first key tile}.
template <bool kSparse, bool kPersistent>
struct FwdListSmem {
  using List = void;
};
template <>
struct FwdListSmem<true, false> {
  using List = SparseTileList;
  SparseTileList list;
};
template <>
struct FwdListSmem<true, true> {
  using List = SparseTileListOf<kMaxPersistentSparseTiles>;
  List lists[2];
  int4 announced[2];     // read by the writer on `announce`, by the consumers once the stage's Q landed
  uint64_t announce[2];  // mbarriers: the producer has announced the stage's next tile (one arrival)
};

// kQStages: Q's stages. One CTA per tile loads Q once; a persistent CTA takes two where they fit,
// so that the next tile's Q lands while the current tile still uses its own.
template <typename Cfg, typename T, int kQStages_ = 1, bool kSparse = false, bool kPersistent = false>
struct FwdSmem : FwdListSmem<kSparse, kPersistent> {
  using L = FwdLayouts<Cfg, T>;
  using Config = Cfg;
  static constexpr int kQStages = kQStages_;
  static constexpr int kQElems = cute::cosize_v<typename L::SmemQ>;
  cute::array_aligned<typename L::Elem, kQElems * kQStages, 1024> q;
  cute::array_aligned<typename L::Elem, cute::cosize_v<typename L::SmemKV>, 1024> k;
  cute::array_aligned<typename L::Elem, cute::cosize_v<typename L::SmemKV>, 1024> v;
  StageBarriers<kQStages> q_ring;  // a Q stage is free again once every consumer thread is done with it
  StageBarriers<Cfg::kStages> k_ring, v_ring;
  int tile_of_q[kQStages];  // dense persistent: the tile whose Q a stage holds (-1: no tiles left)
};

template <typename Cfg, typename T, int kQStages = 1, bool kSparse = false, bool kPersistent = false>
constexpr int hopper_fwd_smem_bytes() {
  return static_cast<int>(sizeof(FwdSmem<Cfg, T, kQStages, kSparse, kPersistent>)) + 1024;  // + the alignment slack of the base
}

// Q stages of the one-CTA-per-tile (1) and persistent (2 where they fit) grids.
template <typename Cfg, typename T, bool kPersistent>
constexpr int hopper_fwd_q_stages() {
  return kPersistent && hopper_fwd_smem_bytes<Cfg, T, 2>() <= 227 * 1024 ? 2 : 1;
}

// Whether the block-sparse forward of Cfg has its persistent form: two Q stages and two lists of
// kMaxPersistentSparseTiles beside the K/V stages in 227 KB (d64-d192; not d256).
template <typename Cfg, typename T>
constexpr bool hopper_sparse_persistent_fits() {
  return hopper_fwd_smem_bytes<Cfg, T, 2, true, true>() <= 227 * 1024;
}

// The Q stages and the shared memory of hopper_fwd_kernel<Cfg, T, kPersistent, kSparse> (the
// persistent sparse grid always takes two: its lists follow them).
template <typename Cfg, typename T, bool kPersistent, bool kSparse>
constexpr int hopper_fwd_kernel_q_stages() {
  return kSparse && kPersistent ? 2 : hopper_fwd_q_stages<Cfg, T, kPersistent>();
}
template <typename Cfg, typename T, bool kPersistent, bool kSparse>
constexpr int hopper_fwd_kernel_smem() {
  return hopper_fwd_smem_bytes<Cfg, T, hopper_fwd_kernel_q_stages<Cfg, T, kPersistent, kSparse>(), kSparse, kPersistent>();
}

// Where a role stands in the pipelines; carried from tile to tile by persistent CTAs.
struct PipePos {
  RingPos q, k, v;
};

// The persistent grid's tile counters: each launch takes the next slot of the ring (host side,
// fwd_launch_impl.h) and zeroes it on its stream before the kernel, so launches on different
// streams count in different words (one per translation unit: 1024 launches of one head dim and
// dtype would have to be in flight at once to meet again).
inline constexpr int kHopperFwdCounterSlots = 1024;
static __device__ int hopper_fwd_tile_counters[kHopperFwdCounterSlots];

// The work of one CTA: rows [row0, row0 + rows) of head h of sequence b (rows up to kBlockM, cut
// at the sequence's end), the key tiles of `kv`. row0 may be negative: a causal sequence's tiles
// are shifted so that its ragged tile comes first (sched::row_tile_shift); its rows before the
// sequence load Q as zeros or another sequence's rows and are never written out.
template <typename Walk>
struct FwdTile {
  detail::SeqInfo seq;
  sched::Band band;
  int m_block = 0, h = 0, b = 0, row0 = 0, rows = 0;
  int id = 0;  // the CTA's (or, persistent, the tile's) index: its row of the timeline
  Walk kv;
};

template <typename Cfg, typename Walk, typename T>
__device__ __forceinline__ FwdTile<Walk> fwd_tile_of(const HopperFwdParams<Cfg, T>& hp, int m_block, int h, int b) {
  const detail::FwdKernelParams& p = hp.p;
  FwdTile<Walk> t;
  t.seq = detail::seq_info(p, b);
  t.band = detail::band_of(p, t.seq);
  t.m_block = m_block;
  t.h = h;
  t.b = b;
  // A block mask's CTAs are its q blocks: never shifted.
  const int shift = Walk::kSparse || !FLARE_HOPPER_FWD_ROW_SHIFT
                        ? 0
                        : sched::row_tile_shift(t.band, t.seq.seqlen_q, Cfg::kBlockM);
  t.row0 = m_block * Cfg::kBlockM - shift;
  t.rows = t.seq.seqlen_q - t.row0 < Cfg::kBlockM ? t.seq.seqlen_q - t.row0 : Cfg::kBlockM;
  if (t.rows <= 0) return t;
  if constexpr (!Walk::kSparse)  // a block mask's walk is its expanded list row (the kernel attaches it)
    t.kv.range = sched::kv_block_range(t.band, t.row0 > 0 ? t.row0 : 0, t.row0 + t.rows, t.seq.seqlen_k, Cfg::kBlockN);
  return t;
}

// An expanded list row, once its writer has arrived (sparse_tile_list.h) for the `phase`-th time.
template <typename List>
__device__ __forceinline__ SparseKvWalkOf<List> sparse_walk(List& list, uint32_t phase = 0) {
  cutlass::arch::ClusterBarrier::wait(&list.full, phase);
  SparseKvWalkOf<List> w;
  w.list = &list;
  w.count = list.count;
  return w;
}

// The tile of a block-sparse order record (sched::SparseOrder::encode: (batch x heads + head) x q
// tiles + q tile).
template <typename Cfg, typename Walk, typename T>
__device__ __forceinline__ FwdTile<Walk> ordered_sparse_tile(const HopperFwdParams<Cfg, T>& hp, int encoded) {
  const int m_tiles = (hp.p.seqlen_q + Cfg::kBlockM - 1) / Cfg::kBlockM, flat = encoded / m_tiles;
  return fwd_tile_of<Cfg, Walk>(hp, encoded - flat * m_tiles, flat % hp.p.heads, flat / hp.p.heads);
}

}  // namespace flare::hopper
