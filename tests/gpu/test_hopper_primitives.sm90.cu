// The Hopper forward's tile operations, each on its own: warpgroup GEMMs (A from shared memory and
// from registers, B K-major and MN-major), the TMA stage ring (phases over many laps), and the
// exp2 polynomial. Built for sm_90a; skipped on other devices.
#include <gtest/gtest.h>

#include <cuda_bf16.h>

#include <cmath>
#include <random>
#include <vector>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "src/attention/hopper/fwd_layouts.h"
#include "src/attention/hopper/online_softmax.h"
#include "src/attention/hopper/stage_ring.h"
#include "src/attention/hopper/wg_gemm.h"
#include "tests/gpu/gpu_harness.h"

namespace flare::test {
namespace {

using namespace cute;
using Elem = cutlass::bfloat16_t;
using SmemTile = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Elem>{}, Shape<_64, _64>{}));
// The second operand as V is stored (rows = the GEMM's k, columns = its n), read transposed.
using SmemTileT = decltype(composition(SmemTile{}, make_ordered_layout(Shape<_64, _64>{}, Step<_2, _1>{})));

// C (64 x 64) = A (64 x 64, row-major) times B: B given as (n, k) rows (K-major, like K) or as
// (k, n) rows (MN-major, like V). A from shared memory or, with kARegs, from registers.
template <bool kARegs, bool kBTransposed>
__global__ void wg_gemm_kernel(const Elem* a, const Elem* b, float* c) {
  __shared__ alignas(1024) Elem sa[64 * 64];
  __shared__ alignas(1024) Elem sb[64 * 64];
  Tensor gA = make_tensor(make_gmem_ptr(a), make_layout(Shape<_64, _64>{}, LayoutRight{}));
  Tensor gB = make_tensor(make_gmem_ptr(b), make_layout(Shape<_64, _64>{}, LayoutRight{}));
  Tensor gC = make_tensor(make_gmem_ptr(c), make_layout(Shape<_64, _64>{}, LayoutRight{}));
  Tensor sA = make_tensor(make_smem_ptr(sa), SmemTile{});
  Tensor sBrows = make_tensor(make_smem_ptr(sb), SmemTile{});  // rows as stored in global memory
  for (int i = threadIdx.x; i < 64 * 64; i += 128) {
    sA(i / 64, i % 64) = gA(i / 64, i % 64);
    sBrows(i / 64, i % 64) = gB(i / 64, i % 64);
  }
  cutlass::arch::fence_view_async_shared();
  __syncthreads();
  auto make_mma = [] {
    if constexpr (kARegs)
      return make_tiled_mma(GMMA::rs_op_selector<Elem, Elem, float, Shape<_64, _64, _64>, GMMA::Major::K,
                                                 kBTransposed ? GMMA::Major::MN : GMMA::Major::K>());
    else
      return make_tiled_mma(GMMA::ss_op_selector<Elem, Elem, float, Shape<_64, _64, _64>, GMMA::Major::K,
                                                 kBTransposed ? GMMA::Major::MN : GMMA::Major::K>());
  };
  auto mma = make_mma();
  auto thr = mma.get_thread_slice(threadIdx.x);
  Tensor sB = [&] {
    if constexpr (kBTransposed) return make_tensor(make_smem_ptr(sb), SmemTileT{});  // (n, k) view
    else return sBrows;
  }();
  Tensor tB = thr.partition_fragment_B(sB);
  Tensor tC = partition_fragment_C(mma, Shape<_64, _64>{});
  if constexpr (kARegs) {
    Tensor tA = make_tensor<Elem>(partition_shape_A(mma, Shape<_64, _64>{}));
    copy(thr.partition_A(gA), tA);
    hopper::wg_gemm<true>(mma, tA, tB, tC);
    hopper::wg_wait<0>(tC);
  } else {
    Tensor tA = thr.partition_fragment_A(sA);
    hopper::wg_gemm<true>(mma, tA, tB, tC);
    hopper::wg_wait<0>(tC);
  }
  copy(tC, thr.partition_C(gC));
}

template <bool kARegs, bool kBTransposed>
void check_wg_gemm() {
  std::mt19937 rng(kARegs * 2 + kBTransposed + 7);
  std::normal_distribution<float> nd;
  std::vector<Elem> a(64 * 64), b(64 * 64);
  for (auto& x : a) x = Elem(nd(rng));
  for (auto& x : b) x = Elem(nd(rng));
  Elem *da, *db;
  float* dc;
  FLARE_CUDA_OK(cudaMalloc(&da, a.size() * 2));
  FLARE_CUDA_OK(cudaMalloc(&db, b.size() * 2));
  FLARE_CUDA_OK(cudaMalloc(&dc, 64 * 64 * 4));
  FLARE_CUDA_OK(cudaMemcpy(da, a.data(), a.size() * 2, cudaMemcpyHostToDevice));
  FLARE_CUDA_OK(cudaMemcpy(db, b.data(), b.size() * 2, cudaMemcpyHostToDevice));
  FLARE_CUDA_OK(cudaMemset(dc, 0xFF, 64 * 64 * 4));  // poison
  wg_gemm_kernel<kARegs, kBTransposed><<<1, 128>>>(da, db, dc);
  FLARE_CUDA_OK(cudaGetLastError());
  std::vector<float> c(64 * 64);
  FLARE_CUDA_OK(cudaMemcpy(c.data(), dc, c.size() * 4, cudaMemcpyDeviceToHost));
  double worst = 0;
  for (int i = 0; i < 64; ++i)
    for (int j = 0; j < 64; ++j) {
      double ref = 0;
      for (int k = 0; k < 64; ++k)
        ref += double(float(a[i * 64 + k])) * double(float(kBTransposed ? b[k * 64 + j] : b[j * 64 + k]));
      worst = std::max(worst, std::abs(ref - c[i * 64 + j]));
    }
  EXPECT_LT(worst, 1e-3) << "fp32 accumulation of exact bf16 products";
  cudaFree(da);
  cudaFree(db);
  cudaFree(dc);
}

TEST(HopperPrimitives, WarpgroupGemmSharedA) { FLARE_REQUIRE_HOPPER(); check_wg_gemm<false, false>(); }
TEST(HopperPrimitives, WarpgroupGemmSharedATransposedB) { FLARE_REQUIRE_HOPPER(); check_wg_gemm<false, true>(); }
TEST(HopperPrimitives, WarpgroupGemmRegisterATransposedB) { FLARE_REQUIRE_HOPPER(); check_wg_gemm<true, true>(); }

// A 2-stage ring streams kTiles 64 x 64 tiles of a matrix through TMA; the consumer warpgroup
// copies each out and releases it. Many laps exercise the phase bits.
constexpr int kTiles = 9;
using TmaTile = decltype(make_tma_copy(SM90_TMA_LOAD{}, make_tensor(make_gmem_ptr(static_cast<const Elem*>(nullptr)),
                                                                    make_layout(make_shape(0, _64{}), make_stride(_64{}, _1{}))),
                                       SmemTile{}, Shape<_64, _64>{}, _1{}));

__global__ void ring_kernel(const __grid_constant__ TmaTile tma, int rows, Elem* out) {
  __shared__ alignas(1024) Elem stage[2][64 * 64];
  __shared__ hopper::StageBarriers<2> ring;
  if (threadIdx.x == 0) {
    ring.init(4);
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();
  if (threadIdx.x >= 128) {  // producer warpgroup, one thread
    if (threadIdx.x == 128) {
      Tensor m = tma.get_tma_tensor(make_shape(rows, 64));
      Tensor g = local_tile(m, Shape<_64, _64>{}, make_coord(_, _0{}));  // (64, 64, tile)
      hopper::RingPos pos;
      for (int t = 0; t < kTiles; ++t) {
        Tensor s = make_tensor(make_smem_ptr(stage[pos.index]), SmemTile{});
        auto part = tma.get_slice(_0{});
        uint64_t& bar = ring.acquire(pos, 64 * 64 * 2);
        copy(tma.with(bar), part.partition_S(g(_, _, t)), part.partition_D(s));
        pos.advance<2>();
      }
    }
    return;
  }
  hopper::RingPos pos;
  for (int t = 0; t < kTiles; ++t) {
    ring.wait_full(pos);
    Tensor s = make_tensor(make_smem_ptr(stage[pos.index]), SmemTile{});
    for (int i = threadIdx.x; i < 64 * 64; i += 128) out[(t * 64 + i / 64) * 64 + i % 64] = s(i / 64, i % 64);
    __syncwarp();
    if (threadIdx.x % 32 == 0) ring.release(pos);
    pos.advance<2>();
  }
}

TEST(HopperPrimitives, TmaStageRingOverManyLaps) {
  FLARE_REQUIRE_HOPPER();
  const int rows = kTiles * 64;
  std::vector<Elem> in(rows * 64);
  for (size_t i = 0; i < in.size(); ++i) in[i] = Elem(float((i * 37) % 1001) - 500.f);
  Elem *din, *dout;
  FLARE_CUDA_OK(cudaMalloc(&din, in.size() * 2));
  FLARE_CUDA_OK(cudaMalloc(&dout, in.size() * 2));
  FLARE_CUDA_OK(cudaMemcpy(din, in.data(), in.size() * 2, cudaMemcpyHostToDevice));
  FLARE_CUDA_OK(cudaMemset(dout, 0xFF, in.size() * 2));
  TmaTile tma = make_tma_copy(SM90_TMA_LOAD{}, make_tensor(make_gmem_ptr(static_cast<const Elem*>(din)),
                                                          make_layout(make_shape(rows, _64{}), make_stride(_64{}, _1{}))),
                              SmemTile{}, Shape<_64, _64>{}, _1{});
  ring_kernel<<<1, 256>>>(tma, rows, dout);
  FLARE_CUDA_OK(cudaGetLastError());
  std::vector<Elem> out(in.size());
  FLARE_CUDA_OK(cudaMemcpy(out.data(), dout, out.size() * 2, cudaMemcpyDeviceToHost));
  int mismatches = 0;
  for (size_t i = 0; i < in.size(); ++i) mismatches += float(in[i]) != float(out[i]);
  EXPECT_EQ(mismatches, 0);
  cudaFree(din);
  cudaFree(dout);
}

__global__ void exp2_kernel(const float* x, float* poly, float* hw, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) {
    poly[i] = hopper::exp2_poly(x[i]);
    hw[i] = exp2f(x[i]);
  }
}

TEST(HopperPrimitives, Exp2PolynomialMatchesExp2) {
  FLARE_REQUIRE_HOPPER();
  std::vector<float> x;
  for (float v = -130.f; v <= 0.f; v += 0.0137f) x.push_back(v);
  x.push_back(-INFINITY);
  x.push_back(0.f);
  const int n = static_cast<int>(x.size());
  float *dx, *dp, *dh;
  FLARE_CUDA_OK(cudaMalloc(&dx, n * 4));
  FLARE_CUDA_OK(cudaMalloc(&dp, n * 4));
  FLARE_CUDA_OK(cudaMalloc(&dh, n * 4));
  FLARE_CUDA_OK(cudaMemcpy(dx, x.data(), n * 4, cudaMemcpyHostToDevice));
  exp2_kernel<<<(n + 255) / 256, 256>>>(dx, dp, dh, n);
  FLARE_CUDA_OK(cudaGetLastError());
  std::vector<float> p(n), h(n);
  FLARE_CUDA_OK(cudaMemcpy(p.data(), dp, n * 4, cudaMemcpyDeviceToHost));
  FLARE_CUDA_OK(cudaMemcpy(h.data(), dh, n * 4, cudaMemcpyDeviceToHost));
  double worst_rel = 0;
  for (int i = 0; i < n; ++i) {
    if (x[i] < -125.f) {
      EXPECT_EQ(p[i], 0.f) << "x = " << x[i];
      continue;
    }
    const double ref = std::exp2(double(x[i]));
    if (ref > 1e-30) worst_rel = std::max(worst_rel, std::abs(p[i] - ref) / ref);
  }
  EXPECT_LT(worst_rel, 2e-4);
  cudaFree(dx);
  cudaFree(dp);
  cudaFree(dh);
}

}  // namespace
}  // namespace flare::test
