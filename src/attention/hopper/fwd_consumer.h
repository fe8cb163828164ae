// The Hopper forward's consumer warpgroups (fwd_kernel.h): each owns 64 rows of the tile and runs
// the main loop (S = Q K^T, the masks on the partial tiles, the online softmax, O += P V, its GEMMs
// in turns with the other warpgroups) and the epilogue (O and the LSE, or a split tile's part).
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cmath>

#include <cute/tensor.hpp>

#include "src/attention/hopper/element_lookups.h"
#include "src/attention/hopper/fwd_tile.h"
#include "src/attention/hopper/gemm_turns.h"
#include "src/attention/hopper/online_softmax.h"
#include "src/attention/hopper/wg_gemm.h"
#include "src/common/quad_transpose.h"

namespace flare::hopper {

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

}  // namespace flare::hopper
