// Tile configuration of the Hopper forward, one constexpr choice per head dim.
//
// A CTA is one producer warpgroup (TMA loads) and kConsumerWGs consumer warpgroups, each owning 64
// query rows (one wgmma M tile): kBlockM = 64 * kConsumerWGs rows share every K/V block loaded.
// Registers move from the producer to the consumers with setmaxnreg; the budget is the SM's 64K
// registers for one CTA.
#pragma once

#include "src/attention/hopper/register_split.h"

// A build switch for measuring the ping-pong's worth (-DFLARE_HOPPER_PINGPONG=0).
#ifndef FLARE_HOPPER_PINGPONG
#define FLARE_HOPPER_PINGPONG 1
#endif

namespace flare::hopper {

// Whether a consumer warpgroup passes the leading key tiles masked for all its rows (fwd_consumer.h,
// leading_masked_tiles) at this head dim. Measured on the H100 (bench/RESULTS.md, session 24): d64
// causal 1k-2k 2-4 % faster (non-causal 1k 1-2 % slower); d128 causal within 1 % and non-causal 1k
// 4 % slower; d256 within noise: on at d64 only. -DFLARE_HOPPER_FWD_SKIP_MASKED=0 or 1 sets it for
// every head dim (A/B builds).
constexpr bool hopper_fwd_skip_masked(int head_dim) {
#ifdef FLARE_HOPPER_FWD_SKIP_MASKED
  (void)head_dim;
  return FLARE_HOPPER_FWD_SKIP_MASKED != 0;
#else
  return head_dim == 64;
#endif
}

template <int kHeadDim_, int kBlockN_, int kConsumerWGs_, int kStages_ = 2, bool kPingPong_ = FLARE_HOPPER_PINGPONG != 0,
          int kExp2PolyEvery_ = 0, bool kLazyRescale_ = (kHeadDim_ > 64), bool kSkipIdleWGs_ = true, bool kTwoP_ = false>
struct HopperFwdConfig {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockN = kBlockN_;  // keys per block: a multiple of 16 (the PV GEMM's k step)
  static constexpr int kConsumerWGs = kConsumerWGs_;
  static constexpr int kBlockM = 64 * kConsumerWGs;
  static constexpr int kStages = kStages_;  // K and V stages, each
  static constexpr bool kPingPong = kPingPong_;  // consumer warpgroups take turns issuing GEMMs
  // Every kExp2PolyEvery-th group of 8 score columns is exponentiated on the FMA pipe (0: none).
  static constexpr int kExp2PolyEvery = kExp2PolyEvery_;
  // Keep a stale running max until a row outgrows it by 2^8 (the rescale of O is skipped meanwhile).
  static constexpr bool kLazyRescale = kLazyRescale_;
  // A consumer warpgroup whose rows all lie past the sequence only keeps the pipelines' protocol
  // (fwd_consumer.h, pass_tile_without_rows): 1024 rows in tiles of 192 leave two of the last tile's
  // three warpgroups idle. Costs the d64 kernel one more in-loop spill reload (tune_hopper_fwd
  // measures both).
  static constexpr bool kSkipIdleWGs = kSkipIdleWGs_;
  // A consumer warpgroup passes the leading key tiles of a dense walk that are masked for all its
  // rows (the diagonal's, above its last row's keys) instead of computing them (fwd_consumer.h,
  // leading_masked_tiles): with causal masks the tile's first warpgroups see fewer keys than its last.
  static constexpr bool kSkipMaskedTiles = hopper_fwd_skip_masked(kHeadDim_);
  // P in two register sets alternating by key tile, the wait for a PV GEMM moved from after the
  // next softmax to after the next S GEMM's issue (fwd_consumer.h, consume): the softmax then runs
  // under the previous PV GEMM instead of after it. Costs kBlockN / 4 registers a thread.
  static constexpr bool kTwoP = kTwoP_;
  static constexpr int kThreads = 128 * (kConsumerWGs + 1);
  // 2 consumers: 24 x 128 + 240 x 256 = 64512; 3 consumers: 32 x 128 + 160 x 384 = 65536.
  static constexpr int kProducerRegs = kConsumerWGs == 2 ? 24 : 32;
  static constexpr int kConsumerRegs = kConsumerWGs == 2 ? 240 : 160;
  static_assert(fits_register_file(kThreads, kProducerRegs, kConsumerRegs), "setmaxnreg would wait forever");
  static_assert(kBlockN % 16 == 0 && kBlockN <= 256, "kBlockN: a multiple of 16, at most 256");
  static_assert(kHeadDim % 16 == 0 && kHeadDim <= 256, "head dim: a multiple of 16, at most 256");
  static_assert(kConsumerWGs == 2 || kConsumerWGs == 3, "two or three consumer warpgroups");
};

// Per head dim: the S accumulator (kBlockN / 2 floats a thread) and O (kHeadDim / 2) share the
// consumers' registers; K, V stages and Q share 227 KB of shared memory. Measured on the H100
// (bench/tuning/tune_hopper_fwd, bench/RESULTS.md): key blocks of 160 or 176 lost 10-27 % to 128
// at d128, 80 lost 30 % to 64 at d256 (and 48 lost 33 %), 96 beat 64 by 14 % at d192; three
// consumer warpgroups beat two at d64, and at d128 with key blocks of 64 (the softmax of one
// warpgroup under the GEMMs of two: -2 to -5 % non-causal, 0 to -2 % causal one CTA per tile; 96
// and 80 do not fit three warpgroups' registers); on the H200 two warpgroups on 128 keys with two P
// sets win at d128 (below). The exp2 polynomial lost at every head dim (kept
// off). Lazy rescaling won 4-5 % at d256, 0.5 % at d128 and lost 2-4 % at d64 (off there).
template <int kHeadDim>
struct HopperFwdConfigFor;
template <> struct HopperFwdConfigFor<64> { using type = HopperFwdConfig<64, 128, 3>; };
template <> struct HopperFwdConfigFor<96> { using type = HopperFwdConfig<96, 128, 2>; };
// d128: on the H200 (tune_hopper_fwd, bench/RESULTS.md session 37) two warpgroups on key blocks of
// 128 with two P sets (the persistent grid's configuration) beat three warpgroups on 64 by 3-4 % at
// 4k-16k in the sweep, 1-2 % non-causal in the library (whose tail split had helped the three);
// -DFLARE_HOPPER_FWD_D128_TILE=0 restores the three (A/B).
#ifndef FLARE_HOPPER_FWD_D128_TILE
#define FLARE_HOPPER_FWD_D128_TILE 1
#endif
// Two warpgroups, key blocks of 128, two P sets: d128's persistent grid and, by default, its tiles.
using HopperFwdD128TwoP = HopperFwdConfig<128, 128, 2, 2, true, 0, true, true, /*kTwoP=*/true>;
template <> struct HopperFwdConfigFor<128> {
#if FLARE_HOPPER_FWD_D128_TILE
  using type = HopperFwdD128TwoP;
#else
  using type = HopperFwdConfig<128, 64, 3>;
#endif
};
template <> struct HopperFwdConfigFor<192> { using type = HopperFwdConfig<192, 96, 2>; };
// d256 without the ping-pong: on the H200 (bench/RESULTS.md, session 38; 3 alternating rounds)
// 0.7-1 % faster at 2k-16k both ways, 1k within its noise; tune_hopper_fwd had it level or up to
// 4 % ahead (session 37). -DFLARE_HOPPER_FWD_D256_PINGPONG=1 restores it (A/B).
#ifndef FLARE_HOPPER_FWD_D256_PINGPONG
#define FLARE_HOPPER_FWD_D256_PINGPONG 0
#endif
template <> struct HopperFwdConfigFor<256> {
  using type = HopperFwdConfig<256, 64, 2, 2, FLARE_HOPPER_PINGPONG != 0 && FLARE_HOPPER_FWD_D256_PINGPONG != 0>;
};

// The persistent grid's configuration where the launcher takes it (hopper_fwd_persistent,
// fwd_launch_impl.h). d128: two warpgroups, key blocks of 128 and two P sets (the tiles' too since
// session 37; this one stays with -DFLARE_HOPPER_FWD_D128_TILE=0); two P sets won 4-6 % on it and
// lost 2-3 % on three warpgroups, and this grid beat the three-warpgroup tile by 2-6 % causal (ncu,
// H100, bench/RESULTS.md session 20). d64 and d256: the default configuration; at d64 two P sets
// and two warpgroups lost 5-20 % to it (session 23).
template <int kHeadDim>
struct HopperFwdPersistentConfigFor {
  using type = typename HopperFwdConfigFor<kHeadDim>::type;
};
template <> struct HopperFwdPersistentConfigFor<128> {
  using type = HopperFwdD128TwoP;
};

// The block-sparse forward (a block mask's lists, fwd_kv_walk.h): a CTA's 128 rows lie in one mask
// q block and its key tiles divide the mask's kv blocks, so masks of 128 x 128 blocks (Flex's
// default) and their multiples run here; two consumer warpgroups at every head dim, key tiles of
// 128 up to d128 and 64 above (d192's 96 divides no power of two). d128 takes two P sets, as the
// dense persistent grid does: on issue 6's masks (H100, 20 back-to-back calls, two alternating
// rounds, session 26) causal 1.03 -> 0.97 ms, random 0.54 -> 0.51, documents and window 1-3 %
// faster; the persistent sparse grid with them was within 1-2 % either way (per mask).
inline constexpr int kHopperSparseBlockM = 128;
constexpr int hopper_sparse_kv_tile(int head_dim) { return head_dim <= 128 ? 128 : 64; }
template <int kHeadDim>
struct HopperFwdSparseConfigFor {
  using type = HopperFwdConfig<kHeadDim, hopper_sparse_kv_tile(kHeadDim), 2, 2, FLARE_HOPPER_PINGPONG != 0, 0,
                               (kHeadDim > 64), true, /*kTwoP=*/kHeadDim == 128>;
  static_assert(type::kBlockM == kHopperSparseBlockM, "the launcher checks q blocks against kHopperSparseBlockM");
};

}  // namespace flare::hopper
