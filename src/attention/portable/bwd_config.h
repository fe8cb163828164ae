// Tile configuration of the portable backward.
#pragma once

namespace flare::portable {

// A CTA owns kBlockN = 16 * kRowWarps keys of one (sequence, head) and walks query blocks of
// kBlockM rows. kColSplit warps share each 16 key rows: each computes S^T and dP^T for them and
// keeps the dK/dV columns [part * kDkvCols, (part + 1) * kDkvCols) in registers (the split keeps
// head dim 256 within the register file). The dQ product of a query block is split over all warps
// as kDqMTiles row tiles x kDqColParts column parts.
template <int kHeadDim_, int kRowWarps_, int kColSplit_, int kBlockM_>
struct BwdTileConfig {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kRowWarps = kRowWarps_;
  static constexpr int kColSplit = kColSplit_;
  static constexpr int kWarps = kRowWarps * kColSplit;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kBlockN = 16 * kRowWarps;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kDkvCols = kHeadDim / kColSplit;
  static constexpr int kDqMTiles = kBlockM / 16;
  static constexpr int kDqColParts = kWarps / kDqMTiles;
  static constexpr int kDqCols = kHeadDim / kDqColParts;
  static constexpr int kRowStride = kHeadDim + 8;  // padded rows: conflict-free ldmatrix
  static constexpr int kDsStride = kBlockM + 8;

  static_assert(kHeadDim % 16 == 0 && kHeadDim <= 256, "head dim: a multiple of 16 up to 256");
  static_assert(kBlockM % 16 == 0 && kDkvCols % 16 == 0, "whole 16-wide MMA steps");
  static_assert(kWarps % kDqMTiles == 0 && kDqCols % 16 == 0 && kDqCols * kDqColParts == kHeadDim,
                "the dQ product splits evenly over the warps");
};

template <int kHeadDim>
struct BwdConfigFor {
  // Measured on the H100 (tune_portable_bwd, bench/RESULTS.md).
  // 8 x 16 keys for 64 and 128; 96 keeps 4 (its dQ columns must split in 16s); 192 and 256
  // split each key row's dK/dV columns over two warps.
  using type = BwdTileConfig<kHeadDim, /*row_warps=*/(kHeadDim == 64 || kHeadDim == 128) ? 8 : 4,
                             /*col_split=*/kHeadDim <= 128 ? 1 : 2, /*block_m=*/32>;
};

template <typename Cfg, typename T>
constexpr int bwd_smem_bytes() {
  return (2 * Cfg::kBlockN + 4 * Cfg::kBlockM) * Cfg::kRowStride * static_cast<int>(sizeof(T)) +
         Cfg::kBlockN * Cfg::kDsStride * static_cast<int>(sizeof(T)) + 4 * Cfg::kBlockM * static_cast<int>(sizeof(float));
}

}  // namespace flare::portable
