// wgmma tilings of the split-head-dim Hopper backward (HopperBwdSplitConfig: 64 keys per CTA, the
// head dim split between two consumer warpgroups; see bwd_split_kernel.h). K, V, dS and the tensor
// maps are the base layouts' (BwdLayouts) at kBlockN = 64; Q rides a ring of half-tiles.
#pragma once

#include <type_traits>

#include "src/attention/hopper/bwd_layouts.h"

namespace flare::hopper {

template <typename Cfg, typename T>
struct BwdSplitLayouts : BwdLayouts<Cfg, T> {
  using Base = BwdLayouts<Cfg, T>;
  using typename Base::BM;
  using typename Base::BN;
  using typename Base::Elem;
  using typename Base::HD;
  using typename Base::HalfHD;
  static_assert(Cfg::kBlockN == 64 && Cfg::kConsumerWGs == 2, "one warpgroup's keys, two warpgroups");

  using SmemAtom = typename Base::SmemAtom;
  using QSlots = cute::Int<Cfg::kQHalves>;
  // Q: a ring of half-tiles (q rows, half the head dim, slot); the transposes feed dK.
  using SmemQ = decltype(cute::tile_to_shape(SmemAtom{}, cute::Shape<BM, HalfHD, QSlots>{}));
  using SmemQt = decltype(cute::composition(
      SmemQ{}, cute::make_ordered_layout(cute::Shape<HalfHD, BM, QSlots>{}, cute::Step<cute::_2, cute::_1, cute::_3>{})));
  static constexpr uint32_t kQHalfBytes = Base::kQBytes / 2;
  // dO has one stage: (q rows, head dim) and its transpose (head dim, q rows) for dV; loaded as two
  // halves (SmemDOHalves, the same bytes: the swizzle atoms tile the rows first, then the columns).
  using SmemDO = typename Base::SmemQStage;
  using SmemDOHalves = decltype(cute::tile_to_shape(SmemAtom{}, cute::Shape<BM, HalfHD, cute::_2>{}));
  using SmemDOt = decltype(cute::composition(
      SmemDO{}, cute::make_ordered_layout(cute::Shape<HD, BM>{}, cute::Step<cute::_2, cute::_1>{})));
  // K as its two halves of the head dim (the same bytes), the k halves of S^T = K Q^T.
  using SmemKHalves = decltype(cute::tile_to_shape(SmemAtom{}, cute::Shape<BN, HalfHD, cute::_2>{}));
  static_assert(cute::cosize_v<SmemDOHalves> == cute::cosize_v<SmemDO>, "dO's halves tile its stage");

  using OneWG = cute::Layout<cute::Shape<cute::_1, cute::_1, cute::_1>>;
  using ColsSplit = typename Base::ColsSplit;  // warpgroup w: the head dim's half w
  // dP^T = V dO^T (warpgroup 1): (keys, q), k = the whole head dim.
  using MmaSdP = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<Elem, Elem, float, cute::Shape<cute::_64, BM, HD>>(), OneWG{}));
  // S^T = K Q^T (warpgroup 0) in two k halves, one per Q half-tile: the second may still be landing
  // while the first is multiplied.
  using MmaSHalf = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<Elem, Elem, float, cute::Shape<cute::_64, BM, HalfHD>>(), OneWG{}));
  // dV[:, half w] += P^T dO[:, half w]: P^T from registers (both warpgroups hold it).
  using MmaDV = decltype(cute::make_tiled_mma(
      cute::GMMA::rs_op_selector<Elem, Elem, float, cute::Shape<cute::_64, HalfHD, BM>, cute::GMMA::Major::K,
                                 cute::GMMA::Major::MN>(),
      ColsSplit{}));
  // dK[:, half w] += dS^T Q[:, half w], dS^T from shared memory, Q from half w's slot: each
  // warpgroup one product (its accumulator is laid out as the ColsSplit dV's).
  using MmaDK = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<Elem, Elem, float, cute::Shape<cute::_64, HalfHD, BM>, cute::GMMA::Major::K,
                                 cute::GMMA::Major::MN>(),
      OneWG{}));
  // dQ[:, half w] = dS K[:, half w]: (q rows, head dim), k = keys.
  using MmaDQ = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<Elem, Elem, float, cute::Shape<cute::_64, HalfHD, BN>,
                                 cute::GMMA::Major::MN, cute::GMMA::Major::MN>(),
      ColsSplit{}));
};

}  // namespace flare::hopper

namespace flare::hopper {

// The layouts of a backward configuration: split or not.
template <typename Cfg, typename T>
using BwdLayoutsFor = std::conditional_t<Cfg::kSplitHeadDim, BwdSplitLayouts<Cfg, T>, BwdLayouts<Cfg, T>>;

}  // namespace flare::hopper
