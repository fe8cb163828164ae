// Tile configuration of the portable forward, one constexpr specialization point per head dim.
#pragma once

namespace flare::portable {

template <int kHeadDim_>
struct FwdConfig {
  static constexpr int kHeadDim = kHeadDim_;
  // Rows per warp in units of 16: two m-tiles let each K/V fragment feed two MMAs, at the
  // price of registers (S: 2 * kMTiles * kBlockN / 8, O: kMTiles * kHeadDim / 2 per thread).
  static constexpr int kMTiles = kHeadDim <= 64 ? 2 : 1;
  static constexpr int kWarps = kHeadDim <= 64 ? 4 : 8;
  static constexpr int kBlockM = 16 * kMTiles * kWarps;
  static constexpr int kBlockN = kHeadDim <= 128 ? 64 : 32;
  static constexpr int kThreads = 32 * kWarps;
  // Shared-memory rows are padded by 16 bytes: rows then start in distinct 16-byte bank groups
  // for every head dim that is a multiple of 8, so ldmatrix reads are conflict-free.
  static constexpr int kRowStride = kHeadDim + 8;
  static constexpr int kStages = 2;

  static_assert(kHeadDim % 16 == 0 && kHeadDim <= 256, "head dim: a multiple of 16 up to 256");
  static_assert(kBlockN % 16 == 0, "kv block: whole 16-key MMA steps");
};

template <typename Cfg, typename T>
constexpr int fwd_smem_bytes() {
  return (Cfg::kBlockM + 2 * Cfg::kStages * Cfg::kBlockN) * Cfg::kRowStride * static_cast<int>(sizeof(T));
}

}  // namespace flare::portable
