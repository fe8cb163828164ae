// Tile configuration of the Hopper backward.
//
// A CTA owns kBlockN = 128 keys of one (sequence, q head): a producer warpgroup (TMA) and two
// consumer warpgroups of 64 keys each, which hold their keys' dK and dV in registers while the
// query blocks (kBlockM rows of Q and dO, kStages deep) stream past. dK and dV take
// 2 x head_dim / 2 registers a thread, so this tiling serves head dims up to 128; larger ones take
// HopperBwdSplitConfig below. kBlockM is 64, or 128 at head dims up to 64 (hopper_bwd_block_m).
#pragma once

#include <type_traits>

#include "src/attention/bwd_params.h"
#include "src/attention/hopper/register_split.h"

// Experiments (wrong results; timing only): 1 = no exp2/mask/dpsum in P and dS, 2 = no dQ GEMM
// and no dQ adds, 3 = no dK/dV GEMMs, 4 = the deterministic mode's dQ writers not waiting for their
// turns (its grid, walks and hand-overs otherwise as they are), 5 = nor taking part in them (no
// wait, no hand-over: the ordinary mode's adds on the deterministic grid).
#ifndef FLARE_HOPPER_BWD_EXPERIMENT
#define FLARE_HOPPER_BWD_EXPERIMENT 0
#endif

namespace flare::hopper {

// Deterministic dQ turns: 0 = tile order (every kv block walks its query blocks ascending, turns
// in tile order: deadlock-free on any residency); 1 = rotated walks where every kv block sees every
// query block (dq_turns.h kAuto; needs a round of CTAs resident together).
#ifndef FLARE_HOPPER_BWD_ROTATE
#define FLARE_HOPPER_BWD_ROTATE 1
#endif

// dK (from registers) issued before the step's dS tile is fenced and the warpgroups meet, dQ after,
// and dQ's tile stored once both are done (1); or dQ first and its tile stored while dK runs
// (FLARE_HOPPER_BWD_DQ_FIRST). -1: the tiling's choice, early on 128-row steps (d64: 0.97-0.99 of
// dQ first; d128 level, 0.99-1.01; H200, bench/RESULTS.md, session 41).
#ifndef FLARE_HOPPER_BWD_DK_EARLY
#define FLARE_HOPPER_BWD_DK_EARLY -1
#endif

// dQ tiles in shared memory: 2 keeps two adds (and in deterministic mode two turn handoffs) in
// flight; at most 3.
#ifndef FLARE_HOPPER_BWD_DQ_BUFS
#define FLARE_HOPPER_BWD_DQ_BUFS 2
#endif
// Writer threads of the d <= 128 tiling (producer warps 1..W), taking the steps in turn, in the
// ordinary mode (FLARE_HOPPER_BWD_DQ_WRITERS) and the deterministic one (..._DET_DQ_WRITERS); 0, the
// default, is the tiling's own choice (HopperBwdConfig). More writers than tiles keep more turn
// handoffs in flight; A/B builds: 1-3.
#ifndef FLARE_HOPPER_BWD_DQ_WRITERS
#define FLARE_HOPPER_BWD_DQ_WRITERS 0
#endif
#ifndef FLARE_HOPPER_BWD_DET_DQ_WRITERS
#define FLARE_HOPPER_BWD_DET_DQ_WRITERS 0
#endif

// What both tilings share: query steps of kBlockM rows (a multiple of the row statistics' 64-row
// blocks), a producer warpgroup and two consumer warpgroups, and the register split between them.
template <int kHeadDim_, int kStages_, int kBlockM_ = 64>
struct HopperBwdWarps {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;  // query rows per step
  static_assert(kBlockM == 64 || kBlockM == 128, "one or two 64-row blocks a step");
  static constexpr int kRowBlocks = kBlockM / detail::kRowStatsBlockM;  // 64-row blocks (statistics, dQ tiles) a step
  static constexpr int kConsumerWGs = 2;
  static constexpr int kStages = kStages_;
  static constexpr int kThreads = 128 * (kConsumerWGs + 1);
  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs = 240;
  static_assert(fits_register_file(kThreads, kProducerRegs, kConsumerRegs), "setmaxnreg would wait forever");
};

// kBlockM 64: each consumer warpgroup computes one half of the step's dQ columns; 128: one 64-row
// block of its rows (all columns), so a step's dQ is two consecutive 64-row tiles of dq_accum.
template <int kHeadDim_, int kStages_ = 2, int kBlockM_ = 64>
struct HopperBwdConfig : HopperBwdWarps<kHeadDim_, kStages_, kBlockM_> {
  using Warps = HopperBwdWarps<kHeadDim_, kStages_, kBlockM_>;
  static constexpr bool kSplitHeadDim = false;
  static constexpr int kBlockN = 128;  // keys per CTA, 64 per consumer warpgroup
  static constexpr bool kDqRowHalves = kBlockM_ == 128;  // dQ split by rows between the warpgroups
  static constexpr bool kDkEarly = FLARE_HOPPER_BWD_DK_EARLY < 0 ? kDqRowHalves : FLARE_HOPPER_BWD_DK_EARLY != 0;
  // 128-row steps: their 32 KB dQ tile fits once beside two stages and two dS buffers.
  static constexpr int kDqBufs = kDqRowHalves ? 1 : FLARE_HOPPER_BWD_DQ_BUFS;
  static_assert(kDqBufs >= 1 && kDqBufs <= 3, "one to three dQ tiles");
  // Writer j of W (producer warp 1 + j) adds steps j, j + W, ...; step it's tile is it % kDqBufs.
  // The ordinary mode runs kDqWriters, one per tile; the deterministic mode kDetDqWriters, two on
  // the 128-row tiling (d64: one tile), whose turn chains then keep two handoffs in flight: det /
  // ordinary 0.91-0.94 -> 0.96-0.98 at d64 4k-16k, causal 0.86-0.91 -> 0.96-0.97; a third writer
  // added nothing, nor did one at d128 (H200, bench/RESULTS.md, session 39). W is a template
  // argument of the kernel (one instantiation per mode where the counts differ): a count read at
  // run time, or two writers in the ordinary mode, cost that mode 1 %.
  static constexpr int kDqWriters = FLARE_HOPPER_BWD_DQ_WRITERS > 0 ? FLARE_HOPPER_BWD_DQ_WRITERS : kDqBufs;
  static constexpr int kDetDqWriters =
      FLARE_HOPPER_BWD_DET_DQ_WRITERS > 0 ? FLARE_HOPPER_BWD_DET_DQ_WRITERS : (kDqRowHalves ? 2 : kDqBufs);
  static_assert(kDqWriters >= 1 && kDqWriters <= 3 && kDetDqWriters >= 1 && kDetDqWriters <= 3,
                "writers are producer warps 1-3");
  // A consumer reuses a tile once its previous step's writer has read it; with fewer writers than
  // tiles, a writer's dq_full barrier could then complete two phases before the writer waits on the
  // first, whose parity it would never see again. (Session 41: with the arrives moved to the next
  // step, an A/B build of one ordinary writer and two d128 tiles never finished its benchmark.)
  static_assert(kDqWriters >= kDqBufs && kDetDqWriters >= kDqBufs, "at least one dQ writer per dQ tile");
  // Element i of consumer thread ct's dQ fragment in the step's tile (16-byte groups, thread order;
  // with row halves, warpgroup w's in the tile of 64-row block w).
  static FLARE_HD constexpr int dq_tile_offset(int ct, int i) {
    if constexpr (kDqRowHalves) {
      return (ct / 128) * detail::kRowStatsBlockM * kHeadDim_ + detail::hopper_dq_tile_offset(128, ct % 128, i);
    } else {
      return detail::hopper_dq_tile_offset(Warps::kConsumerWGs * 128, ct, i);
    }
  }
};

// Writer threads of the split tiling, taking the query steps in turn (A/B builds: 1-3). Three
// since session 38: with the deterministic mode's two dQ copies (bwd_dq_replicas.h) three writers
// took det from 0.86-0.96 of two writers' at d256 2k-16k (H200, bench/RESULTS.md); alone, with
// one copy, they had added nothing (sessions 24 and 38). The ordinary mode is level on them.
#ifndef FLARE_HOPPER_BWD_SPLIT_DQ_WRITERS
#define FLARE_HOPPER_BWD_SPLIT_DQ_WRITERS 3
#endif
// Q half-tiles of the split tiling (A/B builds: 2 = one Q tile; 3 is the most that fits).
#ifndef FLARE_HOPPER_BWD_SPLIT_Q_HALVES
#define FLARE_HOPPER_BWD_SPLIT_Q_HALVES 3
#endif

// Head dims above 128 (docs/hopper_bwd_d256.md): a CTA owns 64 keys and its two consumer
// warpgroups split the head dim: warpgroup 0 forms S^T and P^T, warpgroup 1 dP^T and dS^T, and
// each keeps its half of dK, dV and dQ. Q rides a ring of kQHalves half-tiles (64 rows by half the
// head dim, the statistics with each block's first half; kStages counts them), so a block's first
// half loads while the previous block's second is still read; dO a ring of one. Each warpgroup's
// dQ half goes out through its own 32 KB buffer, and kDqWriters writer threads (producer warps
// 1..kDqWriters) take the steps in turn, each adding both halves of its steps; in deterministic
// mode each half has its own turn chain per query block, so kDqWriters handoffs per chain are in
// flight. Both modes run this one tiling (bench/RESULTS.md, session 25: the ordinary mode on it is
// 1-6 % faster than on two Q tiles with one shared dQ buffer and a writer per half).
template <int kHeadDim_, int kQHalves_ = FLARE_HOPPER_BWD_SPLIT_Q_HALVES,
          int kStepWriters_ = FLARE_HOPPER_BWD_SPLIT_DQ_WRITERS>
struct HopperBwdSplitConfig : HopperBwdWarps<kHeadDim_, kQHalves_> {
  using Warps = HopperBwdWarps<kHeadDim_, kQHalves_>;
  static constexpr bool kSplitHeadDim = true;
  static constexpr bool kDqRowHalves = false;
  static constexpr int kBlockN = 64;  // keys per CTA, shared by both consumer warpgroups
  static constexpr int kQHalves = kQHalves_;
  static_assert(kQHalves >= 2, "a query block's two halves");
  static constexpr int kDqWriters = kStepWriters_;
  static_assert(kDqWriters >= 1 && kDqWriters <= 3, "writers are producer warps 1-3");
  // Half w (warpgroup w's columns) of a 64-row tile, each half in its 128 threads' order.
  static FLARE_HD constexpr int dq_tile_offset(int ct, int i) {
    return (ct / 128) * Warps::kBlockM * (kHeadDim_ / 2) + detail::hopper_dq_tile_offset(128, ct % 128, i);
  }
};

// The instantiated head dims it serves: up to 128 (64 keys a warpgroup) and 256 (split; 192 would
// split an MN-major swizzle atom of K^T at column 96).
constexpr bool hopper_bwd_serves(int head_dim) { return head_dim > 0 && (head_dim <= 128 || head_dim == 256); }
// Query rows per step of the dense d <= 128 tiling: 128 at head dims up to 64 (FlashAttention-3's
// d64 tile; bench/RESULTS.md session 33), else 64. -DFLARE_HOPPER_BWD_D64_BLOCK_M=64 restores 64
// there (A/B builds).
#ifndef FLARE_HOPPER_BWD_D64_BLOCK_M
#define FLARE_HOPPER_BWD_D64_BLOCK_M 128
#endif
constexpr int hopper_bwd_block_m(int head_dim) { return head_dim <= 64 ? FLARE_HOPPER_BWD_D64_BLOCK_M : 64; }
// Q/dO stages of the dense d <= 128 tiling. 128-row steps: 2 (their dS and dQ tiles leave no room
// for more). Otherwise d64: 4, 1-3 % faster than 2 in the ordinary mode and
// 0.4-4.6 % in the deterministic one (3 stages: no change; bench_attention, three alternating
// rounds, H100, bench/RESULTS.md session 23). d128 has room for 2 only (3 exceed 227 KB); d96 is not
// measured. -DFLARE_HOPPER_BWD_STAGES=N overrides it for every head dim that fits (A/B builds).
constexpr int hopper_bwd_stages(int head_dim) {
#ifdef FLARE_HOPPER_BWD_STAGES
  (void)head_dim;
  return FLARE_HOPPER_BWD_STAGES;
#else
  return hopper_bwd_block_m(head_dim) == 128 ? 2 : head_dim <= 64 ? 4 : 2;
#endif
}
template <int kHeadDim>
using HopperBwdConfigFor =
    std::conditional_t<(kHeadDim > 128), HopperBwdSplitConfig<kHeadDim>,
                       HopperBwdConfig<kHeadDim, hopper_bwd_stages(kHeadDim), hopper_bwd_block_m(kHeadDim)>>;
// The block-sparse backward (d <= 128) keeps two stages and 64-row steps: its lists and plans are
// in 64-row steps.
template <int kHeadDim>
using HopperBwdSparseConfigFor = HopperBwdConfig<kHeadDim>;

// The block-sparse backward (ordinary mode) has the d <= 128 tiling only: its 128-key CTAs lie in
// one mask kv block (kv_block_size a multiple of 128) and its 64-row steps divide the q blocks.
constexpr bool hopper_bwd_sparse_serves(int head_dim) { return head_dim > 0 && head_dim <= 128; }

// Keys per CTA and dQ turn chains per 64-row query block (the split tiling's halves have one each).
constexpr int hopper_bwd_block_n(int head_dim) { return head_dim > 128 ? 64 : 128; }
constexpr int hopper_bwd_dq_chains(int head_dim) { return head_dim > 128 ? 2 : 1; }

}  // namespace flare::hopper
