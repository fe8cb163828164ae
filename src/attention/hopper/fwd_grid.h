// Which grid the Hopper dense forward takes: the persistent grid, or one CTA per tile with the
// ragged last round split into key ranges (sched::tail_split) whose partial outputs are merged by
// their LSE. The choice is hopper_fwd_grid, which the launcher (fwd_launch_impl.h) and the
// workspace size (fwd_dispatch.sm90.cu) both take; FwdPartSlot is the slots' layout (device too).
#pragma once

#include <cstddef>
#include <cstdlib>

#include "src/attention/fwd_params.h"
#include "src/attention/hopper/fwd_config.h"
#include "src/common/device_facts.h"
#include "src/scheduling/tail_split.h"

namespace flare::hopper {

// Head dims with a persistent form in the library (HopperFwdPersistentConfigFor).
constexpr bool hopper_fwd_has_persistent(int head_dim) { return head_dim == 64 || head_dim == 128 || head_dim == 256; }

// Whether a dense forward takes the persistent grid (batched, no window: varlen and windows are not
// measured there, so they keep one CTA per tile). There the one-CTA-per-tile grid's start (first
// loads) and end (epilogue) are a large part of a short tile's time, and the persistent producer
// loads the next tile under the current one. Measured on the H100 (bench/RESULTS.md):
//   d128, causal: the two-P persistent configuration against one CTA per tile, +1 to +6 % at 1k-16k
//     (bench_attention, five alternating rounds, session 22); non-causal -1.4 to -3.6 %.
//   d64, causal at every length and non-causal up to 8k keys: the default configuration (three
//     consumer warpgroups, no spills since session 19's changes) persistent, 4-7 % faster at 1k-8k
//     and causal 16k, 4 % slower non-causal at 16k (tune_hopper_fwd, session 23); in the library,
//     three alternating bench_attention rounds: causal 3-9 %, non-causal 1-6 % faster.
//   d256, causal. On the H100 the persistent grid lost
//     0-12 % (session 23's sweep). On the H200 (session 37; the tiles kernel spills 60 bytes, at a
//     tile's start and end and in the producer's waits, the persistent one none), three alternating
//     rounds of bench_attention, persistent / one CTA per tile: causal 1k, 2k, 4k 0.944, 0.947,
//     0.948; 8k 1.017, 16k 0.989; non-causal 1k-16k 0.98-1.003.
//   d128 (both grids on the two-P configuration since session 37), H200, three alternating rounds
//   of bench_attention (bench/RESULTS.md, session 37), one CTA per tile / persistent:
//   - causal: 1k-8k 1.10, 1.08, 1.04, 1.06; 16k 0.969.
//   - non-causal: 1k 1.044 (tiles of 8 key blocks: the prologue and epilogue the persistent
//     producer hides are a large part of them); at 4k and 16k tune_hopper_fwd (no tail split) put
//     one CTA per tile 3 % and 1 % ahead. Persistent up to
//     kFwdD128PersistentMaxKeys keys, or where the tiles of 128 rows compute many padded rows
//     (sched::padded_share above kFwdPersistentPaddedShare; session 36 measured 192-row tiles).
//   Neither where the one-CTA-per-tile grid splits its last round (`tail_splits`,
//   hopper_fwd_tail_split below): a few query rows against many keys (100 rows, 8 heads, 32k keys:
//   8 tiles) pad most of a tile, but their parts fill the SMs where the persistent grid would run
//   8 CTAs.
// These were measured while the one-CTA-per-tile grid ran causal tiles reversed inside each head.
// Session 52 (H200): that grid takes the L2-grouped tile order and the persistent grid's order puts
// its partial L2 group first; then persistent / one CTA per tile, causal, 3 alternating rounds:
// d128 1k 0.84, 8k 0.98, 16k 0.99; d256 4k 0.96, 8k 0.98, 16k 0.98. So causal runs take the
// persistent grid at every length (the limits kFwdD128/D256CausalPersistentMaxKeys are gone).
// FLARE_HOPPER_FWD_PERSISTENT=0|1 forces either where the head dim has a persistent form (tests,
// A/B); other head dims run one CTA per tile whatever it says.
inline constexpr double kFwdPersistentPaddedShare = 0.06;
inline constexpr int kFwdD128PersistentMaxKeys = 1024;
template <int kHeadDim>
inline bool hopper_fwd_persistent(const detail::FwdKernelParams& p, bool tail_splits) {
  if constexpr (!hopper_fwd_has_persistent(kHeadDim)) {
    (void)p, (void)tail_splits;
    return false;
  } else {
    static const int forced = [] {
      const char* e = std::getenv("FLARE_HOPPER_FWD_PERSISTENT");
      return e == nullptr ? -1 : (e[0] == '1' ? 1 : 0);
    }();
    if (forced >= 0) return forced == 1;
    if (p.cu_seqlens_q != nullptr || p.window_left >= 0 || p.window_right >= 0) return false;
    if constexpr (kHeadDim == 64) return p.causal || p.seqlen_k <= 8192;
    if constexpr (kHeadDim == 256) return p.causal;
    if (p.causal) return true;
    return !tail_splits && (p.seqlen_k <= kFwdD128PersistentMaxKeys ||
                            sched::padded_share(p.seqlen_q, HopperFwdConfigFor<kHeadDim>::type::kBlockM) >
                                kFwdPersistentPaddedShare);
  }
}

// The one-CTA-per-tile grid of uniform tiles (batched, no causal mask, no window): tiles of
// block_m query rows visit every key block, so the grid's last round of tiles % SMs tiles leaves
// the other SMs idle (d128, 16k tokens: 1,376 tiles of 192 rows on 132 SMs, 10.4 waves; the
// timeline measured 4.4-5.6 % of SM time idle after each SM's last CTA, bench/RESULTS.md session
// 35). Those tiles are split into key ranges; each part stores its O (normalized, fp32) and LSE in
// its own workspace slot and a kernel merges them by LSE. A part costs about its prologue and
// epilogue and the merge, counted as kFwdPartCost key blocks; parts only as many as fit the idle
// SMs at once (the first version, up to 7 parts in 3 rounds of parts and a merge of one CTA a
// tile, was 6-11 % slower: session 35). FLARE_HOPPER_FWD_TAIL_SPLIT=0 turns it off, =2 allows
// rounds of parts (A/B).
inline constexpr int kFwdPartCost = 8;
inline sched::TailSplit hopper_fwd_tail_split(const detail::FwdKernelParams& p, int block_m, int block_n, int slots) {
  static const int mode = [] {  // 0 off, 1 one round of parts, 2 rounds of parts allowed (A/B)
    const char* e = std::getenv("FLARE_HOPPER_FWD_TAIL_SPLIT");
    return e == nullptr ? 1 : (e[0] == '0' ? 0 : e[0] == '2' ? 2 : 1);
  }();
  if (mode == 0 || p.cu_seqlens_q != nullptr || p.causal || p.window_left >= 0 || p.window_right >= 0 ||
      p.seqlen_q <= 0 || p.seqlen_k <= 0)
    return {};
  const int64_t tiles = int64_t{(p.seqlen_q + block_m - 1) / block_m} * p.heads * p.batch;
  return sched::tail_split(tiles, (p.seqlen_k + block_n - 1) / block_n, slots, kFwdPartCost, /*min_part_steps=*/4,
                           /*one_round=*/mode == 1);
}

// A part's slot in the workspace, fp32: O [kBlockM rows, kHeadDim] (normalized), then the LSE
// [kBlockM]; slots [split tile, part].
template <typename Cfg>
struct FwdPartSlot {
  static constexpr int64_t kLse = int64_t{Cfg::kBlockM} * Cfg::kHeadDim;  // the LSE's offset
  static constexpr int64_t kFloats = kLse + Cfg::kBlockM;
};

// The dense forward's grid at head dim kHeadDim (what launch_hopper_fwd launches and what the
// workspace size counts): persistent, or one CTA per tile of HopperFwdConfigFor with `tail` split.
struct HopperFwdGrid {
  bool persistent = false;
  sched::TailSplit tail;
};
template <int kHeadDim>
inline HopperFwdGrid hopper_fwd_grid(const detail::FwdKernelParams& p) {
  using Cfg = typename HopperFwdConfigFor<kHeadDim>::type;
  HopperFwdGrid g;
  const sched::TailSplit tail = hopper_fwd_tail_split(p, Cfg::kBlockM, Cfg::kBlockN, detail::current_device_facts().num_sms);
  g.persistent = hopper_fwd_persistent<kHeadDim>(p, tail.active());
  if (!g.persistent) g.tail = tail;
  return g;
}
template <typename Cfg>
inline std::size_t hopper_fwd_tail_bytes(const sched::TailSplit& s) {
  return s.active() ? static_cast<std::size_t>(s.tiles * s.parts * FwdPartSlot<Cfg>::kFloats) * sizeof(float) : 0;
}

}  // namespace flare::hopper
