// Shared-memory layouts and wgmma tilings of the Hopper backward (see bwd_kernel.h for the GEMMs).
#pragma once

#include "src/attention/bwd_params.h"
#include "src/attention/hopper/fwd_layouts.h"

namespace flare::hopper {

template <typename Cfg, typename T>
struct BwdLayouts {
  using Elem = typename CuteElem<T>::type;
  static constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN, kHeadDim = Cfg::kHeadDim;
  static constexpr int kStages = Cfg::kStages;
  using BM = cute::Int<kBlockM>;
  using BN = cute::Int<kBlockN>;
  using HD = cute::Int<kHeadDim>;
  using HalfHD = cute::Int<kHeadDim / 2>;
  using St = cute::Int<kStages>;

  using SmemAtom = KMajorAtom<Elem, kHeadDim>;
  // Q and dO: (q rows, head dim, stage); their transposes (head dim, q rows, stage) feed dK and dV.
  using SmemQ = decltype(cute::tile_to_shape(SmemAtom{}, cute::Shape<BM, HD, St>{}));
  using SmemQStage = decltype(cute::tile_to_shape(SmemAtom{}, cute::Shape<BM, HD>{}));
  using SmemQt = decltype(cute::composition(
      SmemQ{}, cute::make_ordered_layout(cute::Shape<HD, BM, St>{}, cute::Step<cute::_2, cute::_1, cute::_3>{})));
  // K and V: (keys, head dim), loaded once; K^T (head dim, keys) feeds dQ.
  using SmemK = decltype(cute::tile_to_shape(SmemAtom{}, cute::Shape<BN, HD>{}));
  using SmemKt = decltype(cute::composition(
      SmemK{}, cute::make_ordered_layout(cute::Shape<HD, BN>{}, cute::Step<cute::_2, cute::_1>{})));
  // dS (q rows, keys), q contiguous: the A operand of dQ = dS K; written through its (keys, q) view
  // from the dS^T accumulators. Two buffers, alternating by step.
  using SmemDS = decltype(cute::tile_to_shape(cute::GMMA::Layout_MN_SW128_Atom<Elem>{}, cute::Shape<BM, BN>{}));
  using SmemDSt = decltype(cute::composition(
      SmemDS{}, cute::make_ordered_layout(cute::Shape<BN, BM>{}, cute::Step<cute::_2, cute::_1>{})));

  using KeysSplit = cute::Layout<cute::Shape<cute::_2, cute::_1, cute::_1>>;  // warpgroup w: keys 64w..
  using ColsSplit = cute::Layout<cute::Shape<cute::_1, cute::_2, cute::_1>>;  // warpgroup w: dQ's column half w
  // S^T = K Q^T and dP^T = V dO^T: (keys, q), k = head dim.
  using MmaSdP = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<Elem, Elem, float, cute::Shape<cute::_64, BM, HD>>(), KeysSplit{}));
  // dV += P^T dO: (keys, head dim), k = q rows; P^T from registers.
  using MmaDKV = decltype(cute::make_tiled_mma(
      cute::GMMA::rs_op_selector<Elem, Elem, float, cute::Shape<cute::_64, HD, BM>, cute::GMMA::Major::K,
                                 cute::GMMA::Major::MN>(),
      KeysSplit{}));
  // dK += dS^T Q from dS^T in shared memory (written for dQ anyway), so dS^T's registers die early.
  using MmaDK = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<Elem, Elem, float, cute::Shape<cute::_64, HD, BM>, cute::GMMA::Major::K,
                                 cute::GMMA::Major::MN>(),
      KeysSplit{}));
  // dQ = dS K: (q rows, head dim), k = keys; each warpgroup one half of the head dim, or with
  // 128-row steps (Cfg::kDqRowHalves) one 64-row half of the rows.
  using MmaDQ = cute::conditional_t<
      Cfg::kDqRowHalves,
      decltype(cute::make_tiled_mma(cute::GMMA::ss_op_selector<Elem, Elem, float, cute::Shape<cute::_64, HD, BN>,
                                                               cute::GMMA::Major::MN, cute::GMMA::Major::MN>(),
                                    KeysSplit{})),
      decltype(cute::make_tiled_mma(cute::GMMA::ss_op_selector<Elem, Elem, float, cute::Shape<cute::_64, HalfHD, BN>,
                                                               cute::GMMA::Major::MN, cute::GMMA::Major::MN>(),
                                    ColsSplit{}))>;

  // What one Q or dO copy loads: the whole tile, or (the split tiling) one half of the head dim,
  // its 64-column swizzle atoms contiguous in shared memory at the half's offset.
  using QLoadShape = cute::Shape<BM, cute::conditional_t<Cfg::kSplitHeadDim, HalfHD, HD>>;
  using SmemQLoad = decltype(cute::tile_to_shape(SmemAtom{}, QLoadShape{}));
  using TmaQ = decltype(cute::make_tma_copy(cute::SM90_TMA_LOAD{}, make_gtensor<Elem>(nullptr, GShape{}, GStride{}),
                                            SmemQLoad{}, QLoadShape{}, cute::_1{}));
  using TmaK = decltype(cute::make_tma_copy(cute::SM90_TMA_LOAD{}, make_gtensor<Elem>(nullptr, GShape{}, GStride{}),
                                            SmemK{}, cute::Shape<BN, HD>{}, cute::_1{}));

  // A stage's row statistics: the LSE (log2 units) of the step's kBlockM rows, then their dpsum.
  // row_stats holds them per 64-row block (LSE, then dpsum): one copy of the whole block at 64-row
  // steps; with two blocks a step, four copies of a half each (kStatsPieces).
  static constexpr int kRowBlocks = Cfg::kRowBlocks;  // HopperBwdWarps: one or two 64-row blocks
  static constexpr uint32_t kStatsBytes = 2 * kBlockM * sizeof(float);
  static constexpr int kStatsPieces = kRowBlocks == 1 ? 1 : 2;  // copies a 64-row block takes
  // The statistics as a tensor-map load: (floats a piece, piece) over row_stats, one piece a copy.
  using StatsBlock = cute::Int<2 * detail::kRowStatsBlockM / kStatsPieces>;
  using StatsShape = cute::Shape<StatsBlock, int32_t>;
  using StatsStride = cute::Stride<cute::_1, StatsBlock>;
  using SmemStats = cute::Layout<cute::Shape<StatsBlock, cute::_1>>;
  static auto stats_gtensor(const float* ptr, int32_t blocks) {
    return cute::make_tensor(cute::make_gmem_ptr(ptr), StatsShape{StatsBlock{}, blocks}, StatsStride{});
  }
  using TmaStats = decltype(cute::make_tma_copy(cute::SM90_TMA_LOAD{}, stats_gtensor(nullptr, 1), SmemStats{},
                                                cute::Shape<StatsBlock, cute::_1>{}, cute::_1{}));

  static constexpr uint32_t kQBytes = kBlockM * kHeadDim * sizeof(Elem);
  static constexpr uint32_t kKBytes = kBlockN * kHeadDim * sizeof(Elem);
};

}  // namespace flare::hopper
