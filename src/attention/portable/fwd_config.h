// Tile configuration of the portable forward, one constexpr specialization point per head dim.
#pragma once

// A/B switch for kLazyRescale (below); on unless a build turns it off.
#ifndef FLARE_PORTABLE_FWD_LAZY_RESCALE
#define FLARE_PORTABLE_FWD_LAZY_RESCALE 1
#endif

namespace flare::portable {

// A tile shape: kWarps warps each owning 16 * kMTiles query rows, kBlockN keys per step,
// kStages shared-memory K/V buffers. Two m-tiles per warp let each K/V fragment feed two MMAs,
// at the price of registers (S: kMTiles * kBlockN / 2, O: kMTiles * kHeadDim / 2 per thread).
// kStages = 1 is FlashAttention-2's split pipeline: one K and one V buffer, the next K loaded
// under the softmax and PV, the next V under the next S (half the shared memory of 2 stages, so
// at d256 two CTAs of 64 rows fit an SM where one of 128 did).
template <int kHeadDim_, int kWarps_, int kMTiles_, int kBlockN_, int kStages_ = 2>
struct FwdTileConfig {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kMTiles = kMTiles_;
  static constexpr int kWarps = kWarps_;
  static constexpr int kBlockM = 16 * kMTiles * kWarps;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kThreads = 32 * kWarps;
  // Shared-memory rows are padded by 16 bytes: rows then start in distinct 16-byte bank groups
  // for every head dim that is a multiple of 8, so ldmatrix reads are conflict-free.
  static constexpr int kRowStride = kHeadDim + 8;
  static constexpr int kStages = kStages_;
  // Skip O's rescale in blocks where no row of a warp finds a new max (fwd_attend_block). On for
  // the split shapes; the two-stage shapes spill with it (ptxas: d128 0 -> 112 bytes).
  static constexpr bool kLazyRescale = FLARE_PORTABLE_FWD_LAZY_RESCALE && kStages == 1;

  static_assert(kStages >= 1, "one K and one V buffer at least");
  static_assert(kHeadDim % 16 == 0 && kHeadDim <= 256, "head dim: a multiple of 16 up to 256");
  static_assert(kBlockN % 16 == 0, "kv block: whole 16-key MMA steps");
};

// The two-stage tile shapes measured best on the H100 (bench/RESULTS.md, tune_portable_fwd).
template <int kHeadDim>
using FwdTwoStageShape = FwdTileConfig<kHeadDim, /*warps=*/kHeadDim <= 128 ? 4 : 8, /*m_tiles=*/kHeadDim <= 128 ? 2 : 1,
                                       /*block_n=*/kHeadDim <= 64 ? 64 : (kHeadDim <= 128 ? 32 : 64)>;

// The tile shape each instantiated head dim uses in the dense forward (bench/tuning/
// tune_portable_fwd.cu measures the shapes). Head dims 64, 128 and 256 take FlashAttention-2's split
// pipeline, measured faster on the H100 than the two-stage shapes by 6-12 % (bench/RESULTS.md,
// session 15); 96 and 192 (not measured split yet) keep the two-stage shapes.
template <int kHeadDim>
struct FwdConfigFor {
  using type = FwdTwoStageShape<kHeadDim>;
};
template <>
struct FwdConfigFor<64> {
  using type = FwdTileConfig<64, /*warps=*/4, /*m_tiles=*/2, /*block_n=*/128, /*stages=*/1>;
};
template <>
struct FwdConfigFor<128> {
  using type = FwdTileConfig<128, 4, 2, 64, 1>;
};
template <>
struct FwdConfigFor<256> {
  using type = FwdTileConfig<256, 4, 1, 64, 1>;
};

// Whether uniform work (no mask) runs a shape on the persistent L2-grouped grid: the two-stage
// shapes do (1-4 % faster); every split shape measured 3-13 % slower persistent than one CTA per
// tile (bench/RESULTS.md, session 15).
template <typename Cfg>
constexpr bool fwd_persistent_when_uniform() {
  return Cfg::kStages > 1;
}

// The block-sparse forward's (fwd_sparse_kernel.h): its walk prefetches whole tiles, two stages
// at least, so it keeps the two-stage shapes whatever the dense forward takes.
template <int kHeadDim>
struct FwdSparseConfigFor {
  using type = FwdTwoStageShape<kHeadDim>;
};

template <typename Cfg, typename T>
constexpr int fwd_smem_bytes() {
  return (Cfg::kBlockM + 2 * Cfg::kStages * Cfg::kBlockN) * Cfg::kRowStride * static_cast<int>(sizeof(T));
}

}  // namespace flare::portable
