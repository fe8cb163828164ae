// Hopper attention forward (sm_90a): warp-specialized, TMA-fed, wgmma-computed.
//
// A CTA owns kBlockM = 64 x kConsumerWGs query rows of one (sequence, head). Warpgroup 0 is the
// producer: one thread issues the TMA loads of Q and of the visible K/V blocks, last block first
// (the masked blocks at the diagonal come first), into rings of kStages stages. Each consumer
// warpgroup owns 64 rows and runs, per key block n (from the last to the first):
//
//     S_n = Q K_n^T                       (wgmma, issued before the softmax of the previous block)
//     O  += P_{n+1} V_{n+1}              (wgmma, P from registers, overlapping S_n's softmax)
//     P_n = exp2(S_n * scale - m_n)      (online softmax; O rescaled by exp2(m_{n+1} - m_n))
//
// Masks apply on the partial tiles only. The epilogue normalizes O and writes it and the LSE.
//
// With a block mask (kSparse, fwd_kv_walk.h) the CTA's rows lie in one mask q block and the key
// tiles come from its lists instead of the band: partial blocks first (the element predicate on
// top of the band's), then full ones.
//
// The tail split's parts are merged after the grid by fwd_tail_merge.h's kernel.
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cmath>
#include <type_traits>

#include <cute/tensor.hpp>
#include <cutlass/arch/reg_reconfig.h>

#include "src/attention/fwd_params.h"
#include "src/attention/hopper/fwd_config.h"
#include "src/attention/hopper/element_lookups.h"
#include "src/attention/hopper/fwd_kv_walk.h"
#include "src/attention/hopper/fwd_layouts.h"
#include "src/attention/hopper/fwd_timeline.h"
#include "src/attention/hopper/gemm_turns.h"
#include "src/attention/hopper/online_softmax.h"
#include "src/attention/hopper/fwd_grid.h"
#include "src/attention/hopper/fwd_tail_merge.h"
#include "src/attention/hopper/smem_struct.h"
#include "src/attention/hopper/stage_ring.h"
#include "src/attention/hopper/wg_gemm.h"
#include "src/block_sparse/block_sparse_params.h"
#include "src/common/grid_dependency.h"
#include "src/common/quad_transpose.h"

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
  int4 announced[2];
  int ordered_tile_of_q[2];  // the encoded tile of a Q stage's order index (tile_of_q)
  uint64_t announce[2];      // mbarriers: the producer has announced the stage's next tile (one arrival)
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
  int tile_of_q[kQStages];  // persistent: the tile whose Q a stage holds (-1: no tiles left)
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

// The producer thread's Q load of the tile. q_stage_free: the caller has already waited for Q's
// stage to be empty (the persistent grid).
template <typename Cfg, typename T, typename Walk, typename Smem>
__device__ __forceinline__ void produce_q(const HopperFwdParams<Cfg, T>& hp, Smem& sm, const FwdTile<Walk>& t,
                                          PipePos& pos, bool q_stage_free) {
  using namespace cute;
  using L = FwdLayouts<Cfg, T>;
  const bool varlen = hp.p.cu_seqlens_q != nullptr;
  // From the tile's first row, which may lie before the sequence (zeros out of the tensor's bounds).
  Tensor mQ = domain_offset(make_coord(int32_t(t.seq.q_start + t.row0), _0{}),
                            hp.tma_q.get_tma_tensor(hp.shape_q)(_, _, t.h, varlen ? 0 : t.b));
  Tensor gQ = local_tile(mQ, Shape<typename L::BM, typename L::HD>{}, make_coord(_0{}, _0{}));
  Tensor sQ = make_tensor(make_smem_ptr(sm.q.data() + pos.q.index * sm.kQElems), typename L::SmemQ{});
  auto q_part = hp.tma_q.get_slice(_0{});
  if (!q_stage_free) cutlass::arch::ClusterBarrier::wait(&sm.q_ring.empty[pos.q.index], pos.q.phase ^ 1u);
  cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&sm.q_ring.full[pos.q.index], L::kQBytes);
  copy(hp.tma_q.with(sm.q_ring.full[pos.q.index]), q_part.partition_S(gQ), q_part.partition_D(sQ));
  pos.q.template advance<Smem::kQStages>();
  timeline_mark(timeline_of(hp), t.id, kMarkQIssued);
}

// The producer thread's loads of the tile's key tiles: K_n and V_{n+1} in the order the consumers
// read them. A block mask's walk comes from `walk_of` (it waits for the list row), after the K of
// `early_first` where that is >= 0: the walk's first tile, known before the list (first_sparse_tile).
template <typename Cfg, typename T, typename Walk, typename Smem, typename WalkOf>
__device__ __forceinline__ void produce_kv(const HopperFwdParams<Cfg, T>& hp, Smem& sm, FwdTile<Walk>& t, PipePos& pos,
                                           int early_first, WalkOf&& walk_of) {
  using namespace cute;
  using L = FwdLayouts<Cfg, T>;
  const detail::FwdKernelParams& p = hp.p;
  const bool varlen = p.cu_seqlens_q != nullptr;
  const int hk = t.h / p.group, bt = varlen ? 0 : t.b;
  Tensor mK = domain_offset(make_coord(int32_t(t.seq.k_start), _0{}), hp.tma_k.get_tma_tensor(hp.shape_k)(_, _, hk, bt));
  Tensor mV = domain_offset(make_coord(int32_t(t.seq.k_start), _0{}), hp.tma_v.get_tma_tensor(hp.shape_k)(_, _, hk, bt));
  Tensor gK = local_tile(mK, Shape<typename L::BN, typename L::HD>{}, make_coord(_, _0{}));  // (BN, HD, n)
  Tensor gV = local_tile(mV, Shape<typename L::BN, typename L::HD>{}, make_coord(_, _0{}));
  Tensor sK = make_tensor(make_smem_ptr(sm.k.data()), typename L::SmemKV{});
  Tensor sV = make_tensor(make_smem_ptr(sm.v.data()), typename L::SmemKV{});
  auto k_part = hp.tma_k.get_slice(_0{});
  auto v_part = hp.tma_v.get_slice(_0{});
  Tensor k_src = k_part.partition_S(gK);  // (TMA, .., n)
  Tensor k_dst = k_part.partition_D(sK);  // (TMA, .., stage)
  Tensor v_src = v_part.partition_S(gV);
  Tensor v_dst = v_part.partition_D(sV);
  unsigned long long* tl = timeline_of(hp);

  RingPos& kpos = pos.k;
  RingPos& vpos = pos.v;
  auto load_k = [&](int n) {
    uint64_t& bar = sm.k_ring.acquire(kpos, L::kKVBytes);
    copy(hp.tma_k.with(bar), k_src(_, _, _, n), k_dst(_, _, _, kpos.index));
    kpos.template advance<Cfg::kStages>();
  };
  auto load_v = [&](int n) {
    uint64_t& bar = sm.v_ring.acquire(vpos, L::kKVBytes);
    copy(hp.tma_v.with(bar), v_src(_, _, _, n), v_dst(_, _, _, vpos.index));
    vpos.template advance<Cfg::kStages>();
  };
  if (early_first >= 0) {
    load_k(early_first);
    timeline_mark(tl, t.id, kMarkKIssued);
  }
  t.kv = walk_of();
  typename Walk::Cursor c = t.kv.begin();
  if (!t.kv.more(c)) return;  // a block mask's empty row: Q alone (the consumers wait for it)
  int prev = t.kv.tile(c);  // == early_first where that was given
  if (early_first < 0) {
    load_k(prev);
    timeline_mark(tl, t.id, kMarkKIssued);
  }
  for (t.kv.advance(c); t.kv.more(c); t.kv.advance(c)) {
    const int n = t.kv.tile(c);
    load_k(n);
    load_v(prev);
    prev = n;
  }
  load_v(prev);
}

// The producer thread: Q once, then the walk's K and V.
template <typename Cfg, typename T, typename Walk, typename Smem>
__device__ __forceinline__ void produce(const HopperFwdParams<Cfg, T>& hp, Smem& sm, FwdTile<Walk> t,
                                        PipePos& pos, bool q_stage_free = false) {
  produce_q<Cfg, T>(hp, sm, t, pos, q_stage_free);
  const Walk walk = t.kv;
  produce_kv<Cfg, T>(hp, sm, t, pos, -1, [&] { return walk; });
}

// Row `row`'s visible columns of the tile from col0, [lo, hi) relative to `base` (col0 + the
// thread's first column), narrowed to the element predicate's interval.
__device__ __forceinline__ void narrow_to_interval(const block_sparse::ColumnInterval& iv, int64_t base, int limit,
                                                   int& lo, int& hi) {
  const int64_t l = iv.lo - base, h = iv.hi + 1 - base;  // clamped into [-1, limit]: no overflow
  const int lc = static_cast<int>(l < -1 ? -1 : (l > limit ? limit : l));
  const int hc = static_cast<int>(h < -1 ? -1 : (h > limit ? limit : h));
  lo = lc > lo ? lc : lo;
  hi = hc < hi ? hc : hi;
}

// Soft-cap and mask one S tile of this warpgroup's 64 rows (scores stay raw when not capped): the
// band (with the sequence's end) on its partial tiles, those outside `full` (the warpgroup's FULL
// key tiles, sched::full_kv_blocks: two compares a tile instead of classifying each on the path
// from S to the next GEMMs), and where `element_masked` (a block mask's partial block) the element
// predicate `el` too. `el` is the kernel parameter itself (read through the constant bank: a
// pointer chosen at run time would make every field a generic load).
template <typename Cfg, typename FragS, typename Walk>
__device__ __forceinline__ void prepare_scores(FragS& s, const detail::FwdKernelParams& p,
                                               const block_sparse::ElementMaskParams& el, bool element_masked,
                                               const FwdTile<Walk>& t, const sched::BlockRange& full, bool softcap,
                                               int wg_row0, int n, int quad_row, int quad_col) {
  if (softcap) {
    const float pre = p.scale / p.softcap, post = p.softcap * static_cast<float>(M_LOG2E);
    CUTE_UNROLL
    for (int i = 0; i < cute::size(s); ++i) s(i) = post * fast_tanh(s(i) * pre);
  }
  if (!element_masked && n >= full.first && n < full.last) return;
  const int col0 = n * Cfg::kBlockN;
  // Accumulator element i = 4 j + 2 r + c sits at row quad_row + 8 r, column 8 j + quad_col + c;
  // row r sees the columns [lo_r, hi_r) (the band clipped to the sequence).
  int lo[2], hi[2];
  CUTE_UNROLL
  for (int r = 0; r < 2; ++r) {
    const int row = wg_row0 + quad_row + 8 * r;
    lo[r] = t.band.row_lo(row) - col0 - quad_col;
    hi[r] = t.band.row_hi(row, t.seq.seqlen_k) - col0 - quad_col;
  }
  if constexpr (Walk::kSparse) {
    if (element_masked) {
      // Rows past the sequence (never written out) read the last row's predicate.
      int64_t rows[2];
      CUTE_UNROLL
      for (int r = 0; r < 2; ++r) {
        const int row = wg_row0 + quad_row + 8 * r;
        rows[r] = row < t.seq.seqlen_q ? row : t.seq.seqlen_q - 1;
        narrow_to_interval(el.row_interval(rows[r]), int64_t{col0} + quad_col, Cfg::kBlockN, lo[r], hi[r]);
      }
      // Sorted document ids: each row's document is one span of keys (doc_spans.h), an interval
      // like the structural predicates' instead of a lookup a key.
      const bool doc_spans = el.doc_q != nullptr && t.kv.has_doc_spans();
      if (doc_spans) {
        CUTE_UNROLL
        for (int r = 0; r < 2; ++r) {
          const int2 span = t.kv.doc_span(wg_row0 + quad_row + 8 * r - t.row0);
          narrow_to_interval(block_sparse::ColumnInterval{span.x, int64_t{span.y} - 1}, int64_t{col0} + quad_col,
                             Cfg::kBlockN, lo[r], hi[r]);
        }
      }
      if (el.bits != nullptr || (el.doc_q != nullptr && !doc_spans)) {
        uint32_t seen[2];
        element_lookup_bits<Cfg::kBlockN / 8, true>(el, t.b, t.h, rows, int64_t{col0} + quad_col, t.seq.seqlen_k,
                                                    seen, /*docs=*/!doc_spans);
        CUTE_UNROLL
        for (int i = 0; i < cute::size(s); ++i) {
          const int r = (i / 2) % 2, c = 8 * (i / 4) + (i % 2), k = 2 * (i / 4) + (i % 2);
          s(i) = ((seen[r] >> k) & 1u) && c >= lo[r] && c < hi[r] ? s(i) : -INFINITY;
        }
        return;
      }
    }
  }
  CUTE_UNROLL
  for (int i = 0; i < cute::size(s); ++i) {
    const int r = (i / 2) % 2, c = 8 * (i / 4) + (i % 2);
    s(i) = (c >= lo[r] && c < hi[r]) ? s(i) : -INFINITY;
  }
}

// Steps through the walk's next `count` key tiles (or to its end, if sooner) without computing,
// keeping the pipelines' protocol: each K stage waited for and released with the step's GEMM turn
// taken and passed, and the V stages of all but the last tile (a step reads the V of the tile
// before it). The caller still owes the last tile's V stage.
template <typename Smem, typename Walk>
__device__ __forceinline__ void pass_tiles(Smem& sm, const FwdTile<Walk>& t,
                                           typename Walk::Cursor& c, PipePos& pos, int wg, int lane, int count) {
  using Cfg = typename Smem::Config;
  using Turns = GemmTurns<Cfg::kConsumerWGs, Cfg::kPingPong>;
  RingPos& kpos = pos.k;
  RingPos& vpos = pos.v;
  for (int i = 0; i < count && t.kv.more(c); ++i) {
    t.kv.advance(c);
    sm.k_ring.wait_full(kpos);
    Turns::wait(wg);
    if (i > 0) sm.v_ring.wait_full(vpos);
    Turns::pass(wg);
    if (lane == 0) {
      sm.k_ring.release(kpos);
      if (i > 0) sm.v_ring.release(vpos);
    }
    kpos.template advance<Cfg::kStages>();
    if (i > 0) vpos.template advance<Cfg::kStages>();
  }
}

// A consumer warpgroup whose 64 rows all lie outside the sequence (the ragged tile of a sequence
// that is not a multiple of kBlockM, e.g. 1024 rows in tiles of 192: the last tile, or the first
// where causal tiles are shifted, sched::row_tile_shift): it computes nothing, but keeps
// the pipelines' protocol through every tile and the last P V's turn, so the warpgroups that have
// rows run without it on the tensor cores.
template <typename Smem, typename Walk>
__device__ __forceinline__ void pass_tile_without_rows(Smem& sm, const FwdTile<Walk>& t,
                                                       PipePos& pos, int wg, int lane) {
  using Cfg = typename Smem::Config;
  using Turns = GemmTurns<Cfg::kConsumerWGs, Cfg::kPingPong>;
  typename Walk::Cursor c = t.kv.begin();
  pass_tiles(sm, t, c, pos, wg, lane, INT_MAX);  // every tile
  sm.q_ring.release(pos.q);  // every thread: its own reads of the stage's tile index
  pos.q.template advance<Smem::kQStages>();
  RingPos& vpos = pos.v;
  sm.v_ring.wait_full(vpos);  // P_last V_last
  Turns::wait(wg);
  Turns::pass(wg);
  if (lane == 0) sm.v_ring.release(vpos);
  vpos.template advance<Cfg::kStages>();
}

// The walk's first tiles that are masked for all of this warpgroup's rows (dense walks: the
// diagonal's, visited first, above the last key its last row sees; sched::leading_empty_blocks).
// The warpgroup passes them (pass_tiles) and starts its softmax at the first tile it sees.
template <typename Cfg, typename Walk>
__device__ __forceinline__ int leading_masked_tiles(const FwdTile<Walk>& t, int wg_row0) {
  if constexpr (Walk::kSparse || !Cfg::kSkipMaskedTiles) {
    return 0;
  } else {
    const int row_end = t.row0 + t.rows < wg_row0 + 64 ? t.row0 + t.rows : wg_row0 + 64;
    return sched::leading_empty_blocks(t.band, t.kv.range, wg_row0, row_end, t.seq.seqlen_k, Cfg::kBlockN);
  }
}

// A CTA's part of a split tile (HopperFwdParams::tail): its index (-1: a whole tile) and slot.
struct FwdTailPart {
  int index = -1;
  float* slot = nullptr;
};
template <typename Cfg, typename T>
__device__ __forceinline__ FwdTailPart fwd_tail_part(const HopperFwdParams<Cfg, T>& hp) {
  FwdTailPart part;
  if (hp.tail.active() && blockIdx.x >= hp.tail.whole) {
    const sched::TailWork w = sched::tail_work(hp.tail, blockIdx.x, 0);
    part.index = w.part;
    part.slot = hp.partial + ((w.tile - hp.tail.whole) * hp.tail.parts + w.part) * FwdPartSlot<Cfg>::kFloats;
  }
  return part;
}

// One consumer warpgroup's 64 rows of the tile. q_waited: the caller has already waited for the
// tile's Q stage to fill (the persistent grid, where every tile has one).
template <typename Cfg, typename T, typename Walk, typename Smem>
__device__ __forceinline__ void consume(const HopperFwdParams<Cfg, T>& hp, Smem& sm,
                                        const FwdTile<Walk>& t, int consumer_thread, PipePos& pos,
                                        bool q_waited = false) {
  using namespace cute;
  using L = FwdLayouts<Cfg, T>;
  const detail::FwdKernelParams& p = hp.p;
  const int wg = warpgroup_leader(consumer_thread) / 128;  // warp-uniform to the compiler (wg_gemm.h)
  const int lane = consumer_thread % 32, warp_in_wg = (consumer_thread % 128) / 32;
  const int quad_row = 16 * warp_in_wg + lane / 4, quad_col = 2 * (lane % 4);
  const int wg_row0 = t.row0 + 64 * wg;

  typename L::MmaQK mma_qk;
  typename L::MmaPV mma_pv;
  auto thr_qk = mma_qk.get_thread_slice(128 * wg);  // descriptors only: the warpgroup's (wg_gemm.h)
  auto thr_pv = mma_pv.get_thread_slice(128 * wg);
  Tensor sQ = make_tensor(make_smem_ptr(sm.q.data() + pos.q.index * sm.kQElems), typename L::SmemQ{});
  Tensor sK = make_tensor(make_smem_ptr(sm.k.data()), typename L::SmemKV{});
  Tensor sVt = make_tensor(make_smem_ptr(sm.v.data()), typename L::SmemVt{});
  Tensor q_frag = thr_qk.partition_fragment_A(sQ);   // descriptors
  Tensor k_frag = thr_qk.partition_fragment_B(sK);   // (.., stage)
  Tensor vt_frag = thr_pv.partition_fragment_B(sVt);  // (.., stage)
  Tensor s_acc = partition_fragment_C(mma_qk, Shape<typename L::BM, typename L::BN>{});
  Tensor o_acc = partition_fragment_C(mma_pv, Shape<typename L::BM, typename L::HD>{});
  // P's registers, one set or two alternating by key tile (Cfg::kTwoP: P_n is written while the PV
  // GEMM of P_{n-1} still reads the other set; with one set, ptxas packs each exponential into P as
  // it comes out, so the whole softmax of S_n waits for that GEMM to complete).
  Tensor p_even = make_tensor<typename L::Elem>(partition_shape_A(mma_pv, Shape<typename L::BM, typename L::BN>{}));
  Tensor p_odd = make_tensor<typename L::Elem>(partition_shape_A(mma_pv, Shape<typename L::BM, typename L::BN>{}));
  static_assert(decltype(size(s_acc))::value == decltype(size(p_even))::value, "P mirrors S element for element");

  const bool softcap = p.softcap > 0.f;  // once: a per-step read of the parameter waited on the constant cache
  const float score_scale = softcap ? 1.f : p.scale_log2;
  const sched::BlockRange full =
      sched::full_kv_blocks(t.band, wg_row0 > 0 ? wg_row0 : 0, wg_row0 + 64, t.seq.seqlen_k, Cfg::kBlockN);
  OnlineSoftmax softmax;
  // A split tile's sink joins the softmax of its first part only (fwd_tail_part).
  const bool sink = p.sinks != nullptr && fwd_tail_part(hp).index <= 0;
  softmax.init(sink ? p.sinks[t.h] * static_cast<float>(M_LOG2E) : -INFINITY, sink && lane % 4 == 0);
  clear(o_acc);

  auto to_p = [&](auto& p_out) {
    CUTE_UNROLL
    for (int i = 0; i < size(s_acc); ++i) p_out(i) = static_cast<typename L::Elem>(s_acc(i));
  };
  using Turns = GemmTurns<Cfg::kConsumerWGs, Cfg::kPingPong>;
  // The tile has a Q stage when the producer loaded one: always in the persistent grid, else
  // where it has keys to visit, or a block mask (its Q is issued before the list is read).
  const bool has_q = q_waited || Walk::kSparse || !t.kv.empty();
  if (has_q && !q_waited) sm.q_ring.wait_full(pos.q);
  unsigned long long* tl = timeline_of(hp);
  const bool marks = consumer_thread == 0;  // warpgroup 0's stamps (fwd_timeline.h)
  if (t.kv.empty() && has_q) {  // nothing to compute: hand the stage back at once
    sm.q_ring.release(pos.q);  // every thread: its own reads of the stage's tile index
    pos.q.template advance<Smem::kQStages>();
  }
  // No rows here: nothing to compute or write. (Dense tiles only: in the block-sparse kernel,
  // whose q blocks are whole CTAs, the extra path spilled inside the main loop.)
  if constexpr (Cfg::kSkipIdleWGs && !Walk::kSparse) {
    if (wg_row0 >= t.seq.seqlen_q || wg_row0 + 64 <= 0) {
      if (!t.kv.empty()) pass_tile_without_rows(sm, t, pos, wg, lane);
      return;
    }
  }
  if (!t.kv.empty()) {
    RingPos& kpos = pos.k;
    RingPos& vpos = pos.v;
    if (marks) timeline_mark(tl, t.id, kMarkQLanded);
    int tiles = 1;
    // The walk runs one tile ahead: the next tile is looked up (a block mask's list entry) while
    // this one computes, not after it.
    typename Walk::Cursor c = t.kv.begin();
    const int passed = leading_masked_tiles<Cfg>(t, wg_row0);
    if (passed > 0) pass_tiles(sm, t, c, pos, wg, lane, passed);
    int n = t.kv.tile(c);
    bool masked = t.kv.element_masked(c);
    t.kv.advance(c);
    sm.k_ring.wait_full(kpos);
    if (marks) timeline_mark(tl, t.id, kMarkKLanded);
    Turns::wait(wg);
    if (marks) timeline_mark(tl, t.id, kMarkFirstGemm);
    wg_gemm<true>(mma_qk, q_frag, k_frag(_, _, _, kpos.index), s_acc);
    Turns::pass(wg);
    if (passed > 0) {  // the last passed tile's V, which this step would have multiplied
      sm.v_ring.wait_full(vpos);
      if (lane == 0) sm.v_ring.release(vpos);
      vpos.template advance<Cfg::kStages>();
    }
    wg_wait<0>(s_acc);
    if (lane == 0) sm.k_ring.release(kpos);
    kpos.template advance<Cfg::kStages>();
    prepare_scores<Cfg>(s_acc, p, hp.bs.element, masked, t, full, softcap, wg_row0, n, quad_row, quad_col);
    RowScale alpha = softmax.template update_scores<Cfg::kExp2PolyEvery, Cfg::kLazyRescale>(s_acc, score_scale);
    to_p(p_even);
    // A PV GEMM issued whose V stage is not yet released: retired after the wait for it, at the
    // step's end with one P set, after the next S GEMM's issue with two (where O is rescaled).
    bool pv_pending = false;
    auto retire_pv = [&] {
      if (!pv_pending) return;  // warp-uniform
      pv_pending = false;
      if (lane == 0) sm.v_ring.release(vpos);
      vpos.template advance<Cfg::kStages>();
    };
    // Step n: S_n with P_{n-1} V_{n-1}; p_use holds P_{n-1}, p_fill receives P_n.
    auto step = [&](auto& p_use, auto& p_fill) {
      ++tiles;
      n = t.kv.tile(c);
      masked = t.kv.element_masked(c);
      t.kv.advance(c);
      sm.k_ring.wait_full(kpos);
      Turns::wait(wg);
      const bool step_marks = marks && tiles >= kTimelineStep && tiles <= kTimelineStep + 1;  // timeline builds only
      if (step_marks) timeline_mark(tl, t.id, tiles == kTimelineStep ? kMarkStepTurn : kMarkStepNext);
      wg_gemm<true>(mma_qk, q_frag, k_frag(_, _, _, kpos.index), s_acc);
      if constexpr (Cfg::kTwoP) {
        wg_wait<1>(o_acc);  // P_{n-2} V done (S_n runs on)
        retire_pv();
      }
      softmax.rescale(o_acc, alpha);  // while S_n is on the tensor cores
      sm.v_ring.wait_full(vpos);
      wg_gemm<false>(mma_pv, p_use, vt_frag(_, _, _, vpos.index), o_acc);
      pv_pending = true;
      Turns::pass(wg);
      const bool stamp = marks && tiles == kTimelineStep;
      if (stamp) timeline_mark(tl, t.id, kMarkStepIssued);
      wg_wait<1>(s_acc);
      if (stamp) timeline_mark(tl, t.id, kMarkStepSDone);
      if (lane == 0) sm.k_ring.release(kpos);
      kpos.template advance<Cfg::kStages>();
#if FLARE_HOPPER_SKIP_SOFTMAX  // experiment: the pipeline and GEMMs alone (wrong results)
      alpha = RowScale{{1.f, 1.f}};
#else
      prepare_scores<Cfg>(s_acc, p, hp.bs.element, masked, t, full, softcap, wg_row0, n, quad_row, quad_col);
      alpha = softmax.template update_scores<Cfg::kExp2PolyEvery, Cfg::kLazyRescale>(s_acc, score_scale);
#endif
      if (stamp) timeline_mark(tl, t.id, kMarkStepSoftmax);
      if constexpr (!Cfg::kTwoP) {
        wg_wait<0>(o_acc);
        retire_pv();
      }
      if (stamp) timeline_mark(tl, t.id, kMarkStepPVDone);
      to_p(p_fill);
    };
    // The last P V, once every S GEMM has completed.
    auto last_pv = [&](auto& p_last) {
      sm.q_ring.release(pos.q);  // every thread: its own reads of the stage's tile index
      pos.q.template advance<Smem::kQStages>();
      if constexpr (Cfg::kTwoP) {  // one P set: the step already waited for its PV GEMM
        wg_wait<0>(o_acc);
        retire_pv();
      }
      softmax.rescale(o_acc, alpha);
      sm.v_ring.wait_full(vpos);
      Turns::wait(wg);
      wg_gemm<false>(mma_pv, p_last, vt_frag(_, _, _, vpos.index), o_acc);
      Turns::pass(wg);
      wg_wait<0>(o_acc);
      if (lane == 0) sm.v_ring.release(vpos);
      vpos.template advance<Cfg::kStages>();
    };
    if constexpr (Cfg::kTwoP) {
      for (;;) {  // two steps a turn of the loop: each P set keeps its registers
        if (!t.kv.more(c)) {
          last_pv(p_even);
          break;
        }
        step(p_even, p_odd);
        if (!t.kv.more(c)) {
          last_pv(p_odd);
          break;
        }
        step(p_odd, p_even);
      }
    } else {
      while (t.kv.more(c)) step(p_even, p_even);
      last_pv(p_even);
    }
    if (marks) {
      timeline_mark(tl, t.id, kMarkLoopDone);
      timeline_set(tl, t.id, kMarkTiles, static_cast<unsigned long long>(tiles));
    }
  }

  // Epilogue: O / sum and the LSE from the accumulator layout (element i = 4 j + 2 r + c at row
  // quad_row + 8 r, column 8 j + quad_col + c). Where the tile's rows are 16-byte aligned, each
  // 16 x 16 block of a warp goes through the quad transpose (quad_transpose16): one 16-byte store
  // a lane, whole 32-byte sectors, instead of four 4-byte stores filling half of each (the store
  // phase took about 1.6 us of a 15 us CTA at d128 s1024: bench/RESULTS.md, session 17).
  const RowScale inv = softmax.finish();
  if (const FwdTailPart part = fwd_tail_part(hp); part.slot != nullptr) {  // a split tile's part: O (normalized) and the LSE to its slot, fp32
    CUTE_UNROLL
    for (int r = 0; r < 2; ++r) {
      const int local = 64 * wg + quad_row + 8 * r;
      if (t.row0 + local >= t.seq.seqlen_q) continue;
      float* row = part.slot + local * Cfg::kHeadDim;
      CUTE_UNROLL
      for (int j = 0; j < size(o_acc) / 4; ++j)
        *reinterpret_cast<float2*>(row + 8 * j + quad_col) =
            make_float2(o_acc(4 * j + 2 * r) * inv.v[r], o_acc(4 * j + 2 * r + 1) * inv.v[r]);
      if (lane % 4 == 0) part.slot[FwdPartSlot<Cfg>::kLse + local] = softmax.lse(r);
    }
    if (consumer_thread % 128 == 0) {
      timeline_mark_latest(tl, t.id, kMarkEnd);
      timeline_mark_global_latest(tl, t.id, kMarkGlobalEnd);
    }
    return;
  }
  const bool varlen = p.cu_seqlens_q != nullptr;
  T* out = static_cast<T*>(p.out) + detail::row_offset(p.out_str, varlen ? 0 : t.b, t.seq.q_start, t.h);
  float* lse = p.lse ? p.lse + t.b * p.lse_batch_stride + t.h * p.lse_head_stride + t.seq.q_start : nullptr;
  const bool rows16 = rows_16b_aligned(out, p.out_str.row);
  if (rows16) {
    const int t4 = lane % 4, my_row = wg_row0 + quad_row + 8 * (t4 / 2), my_col = 8 * (t4 % 2);
    T* out_row = out + static_cast<int64_t>(my_row) * p.out_str.row + my_col;
    const bool row_ok = my_row >= 0 && my_row < t.seq.seqlen_q;
    CUTE_UNROLL
    for (int b = 0; b < size(o_acc) / 8; ++b) {  // 16-column blocks
      const uint4 v = accumulator_piece<T>([&](int i) { return o_acc(i); }, b, inv.v[0], inv.v[1], t4);
      if (row_ok && 16 * b + my_col < p.head_dim) *reinterpret_cast<uint4*>(out_row + 16 * b) = v;
    }
  }
  CUTE_UNROLL
  for (int r = 0; r < 2; ++r) {
    const int row = wg_row0 + quad_row + 8 * r;
    if (row < 0 || row >= t.seq.seqlen_q) continue;
    if (!rows16) {
      T* out_row = out + row * p.out_str.row;
      CUTE_UNROLL
      for (int j = 0; j < size(o_acc) / 4; ++j) {
        const int col = 8 * j + quad_col;
        if (col < p.head_dim)
          *reinterpret_cast<uint32_t*>(out_row + col) = portable::ElemTraits<T>::pack(o_acc(4 * j + 2 * r) * inv.v[r], o_acc(4 * j + 2 * r + 1) * inv.v[r]);
      }
    }
    if (lse != nullptr && lane % 4 == 0) lse[row] = softmax.lse(r);
  }
  if (marks) timeline_mark(tl, t.id, kMarkEpilogue0);
  if (consumer_thread % 128 == 0) {
    timeline_mark_latest(tl, t.id, kMarkEnd);
    timeline_mark_global_latest(tl, t.id, kMarkGlobalEnd);
  }
}

// The persistent block-sparse grid's list writer: warp 1 of the producer warpgroup. It writes the
// list row of each tile the producer announces into the tile's Q stage's buffer (the producer
// announces a tile once the stage is free: the consumers are done with the tile two before, whose
// list the buffer held, and so is the producer).
template <typename Cfg, typename T, typename Smem>
__device__ __forceinline__ void sparse_list_writer(const HopperFwdParams<Cfg, T>& hp, Smem& sm, int lane) {
  using Walk = SparseKvWalkOf<typename Smem::List>;
  RingPos q;
  for (;;) {
    cutlass::arch::ClusterBarrier::wait(&sm.announce[q.index], q.phase);
    const int4 a = sm.announced[q.index];
    if (a.x < 0) return;
    const FwdTile<Walk> t = ordered_sparse_tile<Cfg, Walk>(hp, a.y);
    fill_sparse_tile_list<Cfg::kBlockN>(sm.lists[q.index], hp.bs, t.b, t.h, t.row0 / hp.bs.q_block_size,
                                        t.seq.seqlen_k, lane, hp.doc_spans, t.row0, t.seq.seqlen_q);
    q.template advance<Smem::kQStages>();
  }
}

// The persistent block-sparse grid's producer thread. Once it has issued a tile's loads it claims
// the CTA's next tile in the sorted order (hp.sparse_order: blockIdx.x first, then from the
// counter), waits for a Q stage to be free, announces the tile to the list writer ({order index,
// encoded tile, first key tile}) and to the consumers (tile_of_q), and issues its Q, its first K
// and, once the list is written, the walk's K and V; an empty stage (tile -1) ends the consumers and
// the writer. Claimed a tile earlier (by the writer, as soon as a Q stage was free), long tiles went
// to CTAs that stayed busy longer than others: causal 1.012-1.017 and documents 1.007-1.018 of one
// CTA per tile's time, against 0.992 and 0.995 with the claim here (bench/RESULTS.md, session 47).
template <typename Cfg, typename T, typename Smem>
__device__ __forceinline__ void produce_sparse_persistent(const HopperFwdParams<Cfg, T>& hp, Smem& sm) {
  using Walk = SparseKvWalkOf<typename Smem::List>;
  const detail::FwdKernelParams& p = hp.p;
  const int num_tiles = (p.seqlen_q + Cfg::kBlockM - 1) / Cfg::kBlockM * p.heads * p.batch;
  unsigned long long* tl = timeline_of(hp);
  PipePos pos;
  int i = blockIdx.x;
  for (bool first = true;; first = false) {
    const int s = pos.q.index;
    const uint32_t phase = pos.q.phase;
    if (!first) i = static_cast<int>(gridDim.x) + atomicAdd(hp.next_tile, 1);
    const int2 record = i < num_tiles ? hp.sparse_order[i] : make_int2(-1, -1);
    cutlass::arch::ClusterBarrier::wait(&sm.q_ring.empty[s], phase ^ 1u);
    sm.announced[s] = i < num_tiles ? make_int4(i, record.x, record.y, 0) : make_int4(-1, -1, -1, 0);
    cutlass::arch::ClusterBarrier::arrive(&sm.announce[s]);
    if (i >= num_tiles) {
      sm.tile_of_q[s] = -1;
      cutlass::arch::ClusterBarrier::arrive(&sm.q_ring.full[s]);
      return;
    }
    sm.tile_of_q[s] = i;
    sm.ordered_tile_of_q[s] = record.x;
    FwdTile<Walk> tile = ordered_sparse_tile<Cfg, Walk>(hp, record.x);
    tile.id = i;
    timeline_mark(tl, tile.id, kMarkStart);
    timeline_mark_global(tl, tile.id, kMarkGlobalStart);
    timeline_set(tl, tile.id, kMarkSm, sm_id());
    produce_q<Cfg, T>(hp, sm, tile, pos, /*q_stage_free=*/true);
    produce_kv<Cfg, T>(hp, sm, tile, pos, record.y >= 0 ? record.y & kSparseTileIndex : -1,
                       [&] { return sparse_walk(sm.lists[s], phase); });
  }
}

// kPersistent: one CTA per SM; its producer thread takes the next tile of the L2-grouped order
// from a counter (hp.next_tile: dynamic, so uneven tiles balance), writes it beside the
// tile's Q stage and loads Q and K/V while the consumers finish the current tile (two Q stages
// where they fit); the consumers learn the tile from the stage once its Q has landed (the
// barrier's arrival publishes the producer's write), and stop at the -1 of an empty one.
// Otherwise one CTA per tile, launched longest first when rows see different numbers of keys.
// kSparse: the key tiles of hp.bs's lists. One CTA per tile: in hp.sparse_order's order where
// given, else the last q blocks first (the longest lists of causal-like masks); the first consumer
// warp expands the CTA's list row into shared memory while the producer issues Q; the producer's K/V
// loads and the consumers' walks wait for it. Persistent (hp.sparse_order given): the tiles of the
// order from a counter (produce_sparse_persistent), each list written by a warp of the producer's
// warpgroup into its Q stage's buffer (sparse_list_writer).
template <typename Cfg, typename T, bool kPersistent, bool kSparse = false>
__global__ void __launch_bounds__(Cfg::kThreads, 1) hopper_fwd_kernel(const __grid_constant__ HopperFwdParams<Cfg, T> hp) {
  using Smem = FwdSmem<Cfg, T, hopper_fwd_kernel_q_stages<Cfg, T, kPersistent, kSparse>(), kSparse, kPersistent>;
  using Walk = std::conditional_t<kSparse, SparseKvWalkOf<typename FwdListSmem<kSparse, kPersistent>::List>, DenseKvWalk>;
  static_assert(!(kSparse && kPersistent) || hopper_sparse_persistent_fits<Cfg, T>(), "no persistent sparse form");
  extern __shared__ unsigned char smem_raw[];
  auto& sm = smem_struct<Smem>(smem_raw);
  const detail::FwdKernelParams& p = hp.p;
  const int warp = threadIdx.x / 32, wg = warp / 4;
  unsigned long long* tl = timeline_of(hp);
  const int cta = static_cast<int>(blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z));
  // An ordered sparse grid's tile (and its first key tile), loaded before the barriers' setup so
  // that its latency passes there. The grid is the programmatic dependent of the kernel that writes
  // the order or the document spans: it may start under that kernel and waits for it here.
  int ordered = -1, first_tile = -1;
  if constexpr (kSparse) {
    if (kPersistent || hp.sparse_order != nullptr || hp.doc_spans != nullptr) device::wait_for_prerequisite_grids();
    if (!kPersistent && hp.sparse_order != nullptr) {
      const int2 record = hp.sparse_order[blockIdx.x];
      ordered = record.x, first_tile = record.y;
    }
  }
  if (!kPersistent && threadIdx.x == 0) {
    timeline_mark(tl, cta, kMarkStart);
    timeline_mark_global(tl, cta, kMarkGlobalStart);
    timeline_set(tl, cta, kMarkSm, sm_id());
  }
  if (threadIdx.x == 32) {  // the tensor maps fetched while the barriers are set up (the producer's first loads need them)
    cute::prefetch_tma_descriptor(hp.tma_q.get_tma_descriptor());
    cute::prefetch_tma_descriptor(hp.tma_k.get_tma_descriptor());
    cute::prefetch_tma_descriptor(hp.tma_v.get_tma_descriptor());
  }
  if (threadIdx.x == 0) {
    // Every consumer thread releases a Q stage.
    sm.q_ring.init(128 * Cfg::kConsumerWGs);
    sm.k_ring.init(4 * Cfg::kConsumerWGs);
    sm.v_ring.init(4 * Cfg::kConsumerWGs);
    if constexpr (kSparse && kPersistent) {
      for (int st = 0; st < 2; ++st) {
        cutlass::arch::ClusterBarrier::init(&sm.lists[st].full, 32);  // the writing warp's lanes
        cutlass::arch::ClusterBarrier::init(&sm.announce[st], 1);
      }
    } else if constexpr (kSparse) {
      cutlass::arch::ClusterBarrier::init(&sm.list.full, 32);  // the writing warp's lanes
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();

  auto tile_at_order = [&](int i) {
    const sched::TileCoord c = sched::tile_at(p.order, i);
    FwdTile<Walk> tile = fwd_tile_of<Cfg, Walk>(hp, c.block, c.head, c.batch);
    tile.id = i;
    return tile;
  };
  auto this_ctas_tile = [&] {  // one CTA per tile: longest first where rows see different key counts
    if constexpr (!kSparse) {
      if (hp.tail.active()) {  // a 1D grid: whole tiles, then the split ones' parts
        const sched::TileCoord c = split_fwd_tile<Cfg>(p, sched::tail_work(hp.tail, blockIdx.x, 0).tile);
        FwdTile<Walk> tile = fwd_tile_of<Cfg, Walk>(hp, c.block, c.head, c.batch);
        const sched::BlockRange r = tile.kv.range;  // every block unmasked: any range of them is a part
        const sched::TailWork w = sched::tail_work(hp.tail, blockIdx.x, r.last - r.first);
        tile.kv.range = sched::BlockRange{r.first + w.begin, r.first + w.end};
        tile.id = cta;
        return tile;
      }
    }
    if constexpr (kSparse) {
      if (ordered >= 0) {
        const int m_tiles = (p.seqlen_q + Cfg::kBlockM - 1) / Cfg::kBlockM, flat = ordered / m_tiles;
        FwdTile<Walk> tile = fwd_tile_of<Cfg, Walk>(hp, ordered - flat * m_tiles, flat % p.heads, flat / p.heads);
        tile.id = cta;
        return tile;
      }
    }
    const bool longest_first = kSparse || p.causal || p.window_left >= 0;
    FwdTile<Walk> tile =
        fwd_tile_of<Cfg, Walk>(hp, longest_first ? gridDim.x - 1 - blockIdx.x : blockIdx.x, blockIdx.y, blockIdx.z);
    tile.id = cta;
    return tile;
  };
  PipePos pos;
  if constexpr (kSparse && kPersistent) {
    if (wg == 0) {
      cutlass::arch::warpgroup_reg_dealloc<Cfg::kProducerRegs>();
      if (warp == 1) sparse_list_writer<Cfg, T>(hp, sm, threadIdx.x % 32);
      if (warp == 0 && cute::elect_one_sync()) produce_sparse_persistent<Cfg, T>(hp, sm);
    } else {
      cutlass::arch::warpgroup_reg_alloc<Cfg::kConsumerRegs>();
      GemmTurns<Cfg::kConsumerWGs, Cfg::kPingPong>::start(wg - 1);
      for (;;) {
        sm.q_ring.wait_full(pos.q);
        // Read before the consumers release the stage (consume), as the dense grid's tile_of_q.
        const int i = sm.tile_of_q[pos.q.index];
        if (i < 0) return;
        FwdTile<Walk> tile = ordered_sparse_tile<Cfg, Walk>(hp, sm.ordered_tile_of_q[pos.q.index]);
        tile.id = i;
        tile.kv = sparse_walk(sm.lists[pos.q.index], pos.q.phase);
        consume<Cfg, T>(hp, sm, tile, threadIdx.x - 128, pos, /*q_waited=*/true);
        if (threadIdx.x == 128) atomicAdd(hp.next_tile + 1, 1);  // tiles done (a test checks: each once)
      }
    }
  } else {
    if (wg == 0) {
      cutlass::arch::warpgroup_reg_dealloc<Cfg::kProducerRegs>();
      if (warp != 0 || !cute::elect_one_sync()) return;
      if constexpr (kPersistent) {
        for (;;) {
          cutlass::arch::ClusterBarrier::wait(&sm.q_ring.empty[pos.q.index], pos.q.phase ^ 1u);
          int i = atomicAdd(hp.next_tile, 1);
          FwdTile<Walk> tile;
          for (; i < p.order.num_tiles; i = atomicAdd(hp.next_tile, 1)) {  // tiles of no rows skipped
            tile = tile_at_order(i);
            if (tile.rows > 0) break;
          }
          if (i >= p.order.num_tiles) {  // the consumers' signal to stop: an empty stage
            sm.tile_of_q[pos.q.index] = -1;
            cutlass::arch::ClusterBarrier::arrive(&sm.q_ring.full[pos.q.index]);
            return;
          }
          sm.tile_of_q[pos.q.index] = i;
          timeline_mark(tl, tile.id, kMarkStart);
          timeline_mark_global(tl, tile.id, kMarkGlobalStart);
          timeline_set(tl, tile.id, kMarkSm, sm_id());
          produce<Cfg, T>(hp, sm, tile, pos, /*q_stage_free=*/true);  // Q even where no key is visible
        }
      } else if constexpr (kSparse) {  // Q first: it needs no list
        FwdTile<Walk> tile = this_ctas_tile();
        if (tile.rows <= 0) return;
        produce_q<Cfg, T>(hp, sm, tile, pos, /*q_stage_free=*/false);
        // The first K from the order's record, while the list row is still being written.
        produce_kv<Cfg, T>(hp, sm, tile, pos, first_tile >= 0 ? first_tile & kSparseTileIndex : -1,
                           [&] { return sparse_walk(sm.list); });
      } else {
        const FwdTile<Walk> tile = this_ctas_tile();
        if (tile.rows > 0 && !tile.kv.empty()) produce<Cfg, T>(hp, sm, tile, pos);
      }
    } else {
      cutlass::arch::warpgroup_reg_alloc<Cfg::kConsumerRegs>();
      GemmTurns<Cfg::kConsumerWGs, Cfg::kPingPong>::start(wg - 1);
      if constexpr (kPersistent) {
        for (;;) {
          sm.q_ring.wait_full(pos.q);
          // Every consumer thread releases the Q stage (consume) after this read: the producer, which
          // rewrites the slot after the release, is ordered after each reader by that reader's own
          // arrive (a lane-0 arrive after __syncwarp left racecheck hazards at d64).
          const int i = sm.tile_of_q[pos.q.index];
          if (i < 0) return;
          consume<Cfg, T>(hp, sm, tile_at_order(i), threadIdx.x - 128, pos, /*q_waited=*/true);
        }
      } else {
        FwdTile<Walk> tile = this_ctas_tile();
        if (tile.rows <= 0) return;
        if constexpr (kSparse) {
          if (warp == 4)  // the first consumer warp writes the list row (its loads overlap Q's)
            fill_sparse_tile_list<Cfg::kBlockN>(sm.list, hp.bs, tile.b, tile.h, tile.row0 / hp.bs.q_block_size,
                                                tile.seq.seqlen_k, threadIdx.x % 32, hp.doc_spans, tile.row0,
                                                tile.seq.seqlen_q);
          tile.kv = sparse_walk(sm.list);
        }
        consume<Cfg, T>(hp, sm, tile, threadIdx.x - 128, pos);
      }
    }
  }
}

}  // namespace flare::hopper
