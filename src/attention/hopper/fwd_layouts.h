// Shared-memory layouts, wgmma tilings and TMA copy types of the Hopper forward.
//
// Q, K and V live in shared memory in the GMMA K-major swizzled layout (head dim contiguous, the
// widest swizzle the head dim allows). V is read by the PV GEMM through a transposed view of the
// same bytes (head dim as the GEMM's N, contiguous: the MN-major operand), so it needs no copy.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cute/tensor.hpp>
#include <cute/atom/copy_traits_sm90_tma.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cute/arch/mma_sm90.hpp>
#include <cutlass/numeric_types.h>

namespace flare::hopper {

template <typename T> struct CuteElem;
template <> struct CuteElem<__nv_bfloat16> { using type = cutlass::bfloat16_t; };
template <> struct CuteElem<__half> { using type = cutlass::half_t; };

// Global tensors as TMA sees them: (rows, head dim, heads, batch); varlen packs every sequence
// into the rows with batch extent 1.
using GShape = cute::Shape<int32_t, int32_t, int32_t, int32_t>;
using GStride = cute::Stride<int64_t, cute::_1, int64_t, int64_t>;
template <typename Elem>
__host__ __device__ auto make_gtensor(const void* ptr, GShape shape, GStride stride) {
  return cute::make_tensor(cute::make_gmem_ptr(static_cast<const Elem*>(ptr)), shape, stride);
}

// The widest K-major swizzle atom whose row (64, 32 or 16 elements) divides the head dim.
template <typename Elem, int kHeadDim>
using KMajorAtom = cute::conditional_t<
    kHeadDim % 64 == 0, cute::GMMA::Layout_K_SW128_Atom<Elem>,
    cute::conditional_t<kHeadDim % 32 == 0, cute::GMMA::Layout_K_SW64_Atom<Elem>, cute::GMMA::Layout_K_SW32_Atom<Elem>>>;

template <typename Cfg, typename T>
struct FwdLayouts {
  using Elem = typename CuteElem<T>::type;
  static constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN, kHeadDim = Cfg::kHeadDim;
  static constexpr int kStages = Cfg::kStages;
  using BM = cute::Int<kBlockM>;
  using BN = cute::Int<kBlockN>;
  using HD = cute::Int<kHeadDim>;

  using SmemAtom = KMajorAtom<Elem, kHeadDim>;
  using SmemQ = decltype(cute::tile_to_shape(SmemAtom{}, cute::Shape<BM, HD>{}));
  using SmemKV = decltype(cute::tile_to_shape(SmemAtom{}, cute::Shape<BN, HD, cute::Int<kStages>>{}));
  using SmemKVStage = decltype(cute::tile_to_shape(SmemAtom{}, cute::Shape<BN, HD>{}));
  // V^T: (head dim, keys, stage) over V's bytes.
  using SmemVt = decltype(cute::composition(
      SmemKV{}, cute::make_ordered_layout(cute::Shape<HD, BN, cute::Int<kStages>>{}, cute::Step<cute::_2, cute::_1, cute::_3>{})));

  // S = Q K^T and O += P V, each consumer warpgroup a 64-row slice (the atoms tile M).
  using AtomLayout = cute::Layout<cute::Shape<cute::Int<Cfg::kConsumerWGs>, cute::_1, cute::_1>>;
  using MmaQK = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<Elem, Elem, float, cute::Shape<cute::_64, BN, HD>>(), AtomLayout{}));
  using MmaPV = decltype(cute::make_tiled_mma(
      cute::GMMA::rs_op_selector<Elem, Elem, float, cute::Shape<cute::_64, HD, BN>, cute::GMMA::Major::K,
                                 cute::GMMA::Major::MN>(),
      AtomLayout{}));

  using GShape = hopper::GShape;
  using GStride = hopper::GStride;
  using TmaQ = decltype(cute::make_tma_copy(cute::SM90_TMA_LOAD{}, make_gtensor<Elem>(nullptr, GShape{}, GStride{}), SmemQ{}, cute::Shape<BM, HD>{}, cute::_1{}));
  using TmaKV = decltype(cute::make_tma_copy(cute::SM90_TMA_LOAD{}, make_gtensor<Elem>(nullptr, GShape{}, GStride{}), SmemKVStage{}, cute::Shape<BN, HD>{}, cute::_1{}));

  static constexpr uint32_t kQBytes = kBlockM * kHeadDim * sizeof(Elem);
  static constexpr uint32_t kKVBytes = kBlockN * kHeadDim * sizeof(Elem);
};

}  // namespace flare::hopper
