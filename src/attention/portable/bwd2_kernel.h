// Portable attention backward, second design (docs/portable_bwd_v2.md): FlashAttention-2's 2-D
// warp tiling. The library's default where Bwd2ConfigFor says so (head dims 64, 128, 256); the
// first design (bwd_kernel.h) serves the others.
//
// A CTA of 8 warps owns kBlockN keys of one (sequence, head) and walks query blocks of kBlockM
// rows. Per query block, each GEMM is split over the warps in 2-D, so that no warp reads all of
// Q and dO twice (the first design's shared-memory bound):
//   S = Q K^T, dP = dO V^T      warps 2 (query rows) x 4 (keys)
//   P = exp2(S - lse), dS = P o (dP - dpsum)   in registers; P and dS to shared memory
//   dV += P^T dO, dK += dS^T Q  warps 4 (keys) x 2 (head-dim columns); dK and dV stay in registers
//   dQ = dS K                   warps 2 (query rows) x 4 (head-dim columns), added into fp32
// dK/dV before dQ, except in the ordinary mode of head dims other than 128, where odd warps take dQ
// first (FLARE_PORTABLE_BWD2_STAGGER), and in the deterministic mode, where dQ goes first (its turn).
// The pre-pass, the conversions, the masks, the deterministic turn order and the dK/dV epilogue
// are the first design's (bwd_kernel.h).
#pragma once

#include <cstdlib>
#include <type_traits>

#include "src/attention/portable/bwd_kernel.h"

namespace flare::portable {

// kBlockN keys per CTA, kBlockM query rows per step, 8 warps, laid out in three grids:
// S and dP on kSRowWarps (query rows) x the rest (keys); dK and dV on kKvKeyWarps (keys) x the
// rest (head-dim columns); dQ on kDqRowWarps (query rows) x the rest (columns).
template <int kHeadDim_, int kBlockN_, int kBlockM_ = 64, int kSRowWarps_ = 2, int kKvKeyWarps_ = 4,
          int kDqRowWarps_ = 2>
struct Bwd2TileConfig {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kWarps = 8;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kSRowWarps = kSRowWarps_, kKvKeyWarps = kKvKeyWarps_, kDqRowWarps = kDqRowWarps_;
  // S and dP: a warp's tile of kSRows query rows x kSKeys keys.
  static constexpr int kSRows = kBlockM / kSRowWarps, kSKeys = kBlockN / (kWarps / kSRowWarps);
  // dK and dV: kDkvKeys keys x kDkvCols columns a warp (bwd_store_dkv's Cfg::kDkvCols).
  static constexpr int kDkvKeys = kBlockN / kKvKeyWarps, kDkvCols = kHeadDim / (kWarps / kKvKeyWarps);
  // dQ: kDqRows query rows x kDqCols columns a warp (bwd_add_dq's Cfg::kDqCols).
  static constexpr int kDqRows = kBlockM / kDqRowWarps, kDqCols = kHeadDim / (kWarps / kDqRowWarps);
  static constexpr int kRowStride = kHeadDim + 8;  // padded rows: conflict-free ldmatrix
  static constexpr int kPStride = kBlockN + 8;     // P and dS rows (query) of kBlockN keys

  static_assert(kHeadDim % 64 == 0 && kHeadDim <= 256, "head dim: 64, 128, 192 or 256");
  static_assert(kWarps % kSRowWarps == 0 && kWarps % kKvKeyWarps == 0 && kWarps % kDqRowWarps == 0,
                "each grid covers the 8 warps");
  static_assert(kSRows % 16 == 0 && kSKeys % 16 == 0 && kDkvKeys % 16 == 0, "whole 16-row MMA tiles");
  static_assert(kDkvCols % 16 == 0 && kDqCols % 16 == 0 && kBlockM % 16 == 0, "whole 16-wide MMA steps");
};

// The 2-D backward's tile per head dim (a multiple of 64), and whether the library takes it by
// default over bwd_kernel.h: measured on the H100 for 64, 128 and 256 (15-19 % faster, ordinary
// and deterministic; bench/RESULTS.md, session 15), not yet for 192. d64 walks 128-row query steps
// (11 % faster there than 64). The warp grids (FLARE_PORTABLE_BWD2_GRIDS=1, the default) are
// FlashAttention-2's: from 192 on, S on 4 x 2 warps and dK/dV on 2 (keys) x 4, so that a dK/dV
// warp reads 32 keys x 64 columns (12 ldmatrix a 16-row step, not 18 for 16 keys x 128); d64's dQ
// on 4 x 2 (32 rows x 32 columns). 0: 2 x 4, 4 x 2, 2 x 4 everywhere (sessions 15-28).
#ifndef FLARE_PORTABLE_BWD2_GRIDS
#define FLARE_PORTABLE_BWD2_GRIDS 1
#endif
// The deterministic mode's step order: dQ computed and added (in its turn) before the dK/dV GEMMs,
// so that the turn passes to the next key block sooner: 4-7 % faster (bench/RESULTS.md, session
// 30). The ordinary mode keeps dK/dV first, 1-4 % faster for it. 0: dK/dV first in both (A/B).
#ifndef FLARE_PORTABLE_BWD2_DET_DQ_FIRST
#define FLARE_PORTABLE_BWD2_DET_DQ_FIRST 1
#endif
// Ordinary mode: odd warps take the step's dQ before their dK/dV, so that the eight warps' dQ
// reductions (red.global, issued in a burst) do not all reach the memory queue at once. On the
// H200 (bench/RESULTS.md, session 32): d256 8-11 % faster (ncu: the reductions' memory-queue stalls
// had been 11 % of the warps' samples), d64 0.1-0.7 %; d128 within 1 % but then spilling in its
// loop, so it keeps one order. 0: every warp dK/dV first (A/B).
#ifndef FLARE_PORTABLE_BWD2_STAGGER
#define FLARE_PORTABLE_BWD2_STAGGER 1
#endif
template <int kHeadDim>
struct Bwd2ConfigFor {
  static constexpr bool kWide = FLARE_PORTABLE_BWD2_GRIDS && kHeadDim > 128;
  using type = Bwd2TileConfig<kHeadDim, kHeadDim <= 128 ? 128 : 64, kHeadDim == 64 ? 128 : 64, /*s_row_warps=*/kWide ? 4 : 2,
                              /*kv_key_warps=*/kWide ? 2 : 4,
                              /*dq_row_warps=*/FLARE_PORTABLE_BWD2_GRIDS && kHeadDim == 64 ? 4 : 2>;
  static constexpr bool kDefault = kHeadDim == 64 || kHeadDim == 128 || kHeadDim == 256;
};

template <typename Cfg, typename T>
struct Bwd2Smem {
  T k[Cfg::kBlockN * Cfg::kRowStride];
  T v[Cfg::kBlockN * Cfg::kRowStride];
  T q[2][Cfg::kBlockM * Cfg::kRowStride];
  T dout[2][Cfg::kBlockM * Cfg::kRowStride];
  T p[Cfg::kBlockM * Cfg::kPStride];   // P of the current query block, [query][key]
  T ds[Cfg::kBlockM * Cfg::kPStride];  // dS, [query][key]
  float lse[2][Cfg::kBlockM];
  float dpsum[2][Cfg::kBlockM];
};

template <typename Cfg, typename T>
constexpr int bwd2_smem_bytes() {
  return static_cast<int>(sizeof(Bwd2Smem<Cfg, T>));
}

// kDqFirst: the step's dQ before its dK/dV (FLARE_PORTABLE_BWD2_DET_DQ_FIRST).
template <typename Cfg, typename T, bool kDqFirst = false>
__global__ void __launch_bounds__(Cfg::kThreads) portable_bwd2_kernel(const BwdKernelParams P) {
  constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN, kStride = Cfg::kRowStride;
  constexpr int kPStride = Cfg::kPStride;
  constexpr int kSM = Cfg::kSRows / 16, kSN = Cfg::kSKeys / 8;           // S tiles a warp: m16 x n8
  constexpr int kKvM = Cfg::kDkvKeys / 16, kKvN = Cfg::kDkvCols / 8;     // dK/dV tiles a warp
  constexpr int kDqM = Cfg::kDqRows / 16, kDqN = Cfg::kDqCols / 8;       // dQ tiles a warp
  constexpr float kLog2e = static_cast<float>(M_LOG2E);
  constexpr bool kStaggerDq = FLARE_PORTABLE_BWD2_STAGGER && Cfg::kHeadDim != 128;
  const detail::FwdKernelParams& p = P.fwd;

  const sched::TileCoord cta = bwd_cta_tile(P);
  const int h = cta.head, b = cta.batch, n = cta.block;
  const detail::SeqInfo seq = detail::seq_info(p, b);
  const int col0 = n * kBlockN;  // first key of this block
  if (col0 >= seq.seqlen_k) return;
  const int hk = h / p.group;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int keys = min(kBlockN, seq.seqlen_k - col0);
  // The warp's places in the three tilings.
  constexpr int kSKeyWarps = Cfg::kWarps / Cfg::kSRowWarps, kKvColWarps = Cfg::kWarps / Cfg::kKvKeyWarps,
                kDqColWarps = Cfg::kWarps / Cfg::kDqRowWarps;
  const int s_row = (warp / kSKeyWarps) * Cfg::kSRows, s_key = (warp % kSKeyWarps) * Cfg::kSKeys;
  const int kv_key = (warp / kKvColWarps) * Cfg::kDkvKeys, kv_col = (warp % kKvColWarps) * Cfg::kDkvCols;
  const int dq_row = (warp / kDqColWarps) * Cfg::kDqRows, dq_col = (warp % kDqColWarps) * Cfg::kDqCols;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  auto& sm = *reinterpret_cast<Bwd2Smem<Cfg, T>*>(smem_raw);

  const BwdQuerySide<T> qs = BwdQuerySide<T>::of(P, seq, b, h);

  const sched::Band band = detail::band_of(p, seq);
  // The query steps whose tile is FULL, by first row, once (sched::full_row_tiles).
  const sched::RowSpan full_rows = sched::full_row_tiles(band, col0, col0 + kBlockN, seq.seqlen_k, kBlockM);
  const sched::BlockRange mrange = sched::q_block_range(band, col0, col0 + keys, seq.seqlen_q, kBlockM);

  float dk[kKvM][kKvN][4], dv[kKvM][kKvN][4];
#pragma unroll
  for (int mi = 0; mi < kKvM; ++mi)
#pragma unroll
    for (int c = 0; c < kKvN; ++c)
#pragma unroll
      for (int e = 0; e < 4; ++e) dk[mi][c][e] = dv[mi][c][e] = 0.f;

  if (mrange.first < mrange.last) {
    bwd_load_kv_block<Cfg, T>(sm, P, seq, b, hk, col0, keys);
    bwd_load_q_block<Cfg, T>(sm, 0, P, qs, mrange.first * kBlockM, seq.seqlen_q);
    cp_async_commit();
  }

  for (int m = mrange.first, it = 0; m < mrange.last; ++m, ++it) {
    const int stage = it & 1;
    const int row0 = m * kBlockM;
    cp_async_wait<0>();
    __syncthreads();  // block m landed; the previous block's readers of P, dS and the other stage are done
    if (m + 1 < mrange.last)
      bwd_load_q_block<Cfg, T>(sm, stage ^ 1, P, qs, (m + 1) * kBlockM, seq.seqlen_q);
    cp_async_commit();
    const T* sq = sm.q[stage];
    const T* sdo = sm.dout[stage];

    // ---- S = Q K^T and dP = dO V^T on the warp's kSRows x kSKeys tile --------------------------
    float s[kSM][kSN][4], dp[kSM][kSN][4];
#pragma unroll
    for (int mi = 0; mi < kSM; ++mi)
#pragma unroll
      for (int j = 0; j < kSN; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mi][j][e] = dp[mi][j][e] = 0.f;
#pragma unroll
    for (int ks = 0; ks < Cfg::kHeadDim / 16; ++ks) {
      uint32_t aq[kSM][4], ado[kSM][4];
#pragma unroll
      for (int mi = 0; mi < kSM; ++mi) {
        const int off = (s_row + 16 * mi + lane % 16) * kStride + 16 * ks + (lane / 16) * 8;
        ldmatrix_x4(aq[mi], sq + off);
        ldmatrix_x4(ado[mi], sdo + off);
      }
#pragma unroll
      for (int jp = 0; jp < kSN / 2; ++jp) {
        const int off = (s_key + 16 * jp + lane % 8 + (lane / 16) * 8) * kStride + 16 * ks + ((lane / 8) % 2) * 8;
        uint32_t bk[4], bv[4];
        ldmatrix_x4(bk, sm.k + off);
        ldmatrix_x4(bv, sm.v + off);
#pragma unroll
        for (int mi = 0; mi < kSM; ++mi) {
          mma_16x8x16<T>(s[mi][2 * jp], aq[mi], bk[0], bk[1]);
          mma_16x8x16<T>(s[mi][2 * jp + 1], aq[mi], bk[2], bk[3]);
          mma_16x8x16<T>(dp[mi][2 * jp], ado[mi], bv[0], bv[1]);
          mma_16x8x16<T>(dp[mi][2 * jp + 1], ado[mi], bv[2], bv[3]);
        }
      }
    }

    // ---- P and dS (element (mi, j, e): query row s_row + 16 mi + g + 8 (e / 2), key s_key + 8 j +
    // 2 t + e % 2), masked on partial blocks, to shared memory ------------------------------------
    const bool partial = row0 + kBlockM > seq.seqlen_q || !full_rows.contains(row0);
    const float* lse_s = sm.lse[stage];
    const float* dpsum_s = sm.dpsum[stage];
    // One branch-free element loop per (soft-capping, partial block) pair: a per-element test of
    // either made every element a branch (SASS).
    auto probs_and_grads = [&](auto softcap_tag, auto partial_tag) {
      constexpr bool kSoftcap = decltype(softcap_tag)::value, kPartial = decltype(partial_tag)::value;
      const float pre = kSoftcap ? p.scale / p.softcap : 0.f, post = kSoftcap ? p.softcap * kLog2e : 0.f;
#pragma unroll
      for (int mi = 0; mi < kSM; ++mi)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int qr = s_row + 16 * mi + g + 8 * r;  // row within the block
          const float lse2 = lse_s[qr] * kLog2e, dpsum = dpsum_s[qr];
          // The row's visible keys [lo, hi), relative to this thread's first column.
          int lo = 0, hi = 0;
          if constexpr (kPartial) {
            const int qi = row0 + qr, base = col0 + s_key + 2 * t;
            lo = qi < seq.seqlen_q ? band.row_lo(qi) - base : 0;
            hi = qi < seq.seqlen_q ? band.row_hi(qi, seq.seqlen_k) - base : 0;
          }
#pragma unroll
          for (int j = 0; j < kSN; ++j) {
            float pv[2], dsv[2];
#pragma unroll
            for (int c = 0; c < 2; ++c) {
              const int e = 2 * r + c;
              float x = s[mi][j][e], cap_grad = 1.f;
              if constexpr (kSoftcap) {
                const float th = fast_tanh(x * pre);
                x = post * th;
                cap_grad = 1.f - th * th;
              } else {
                x *= p.scale_log2;
              }
              float prob = fast_exp2(x - lse2);
              if constexpr (kPartial) prob = (8 * j + c >= lo && 8 * j + c < hi) ? prob : 0.f;
              pv[c] = prob;
              dsv[c] = prob * (dp[mi][j][e] - dpsum);
              if constexpr (kSoftcap) dsv[c] *= cap_grad;
            }
            const int at = qr * kPStride + s_key + 8 * j + 2 * t;
            *reinterpret_cast<uint32_t*>(sm.p + at) = ElemTraits<T>::pack(pv[0], pv[1]);
            *reinterpret_cast<uint32_t*>(sm.ds + at) = ElemTraits<T>::pack(dsv[0], dsv[1]);
          }
        }
    };
    using Yes = std::true_type;
    using No = std::false_type;
    if (p.softcap > 0.f) {
      if (partial) probs_and_grads(Yes{}, Yes{});
      else probs_and_grads(Yes{}, No{});
    } else {
      if (partial) probs_and_grads(No{}, Yes{});
      else probs_and_grads(No{}, No{});
    }
    __syncthreads();  // P and dS complete

    // ---- dV += P^T dO and dK += dS^T Q on the warp's kDkvKeys keys x kDkvCols columns ----------
    auto dkv_gemm = [&] {
#pragma unroll
      for (int ks = 0; ks < kBlockM / 16; ++ks) {
        uint32_t ap[kKvM][4], ads[kKvM][4];
#pragma unroll
        for (int mi = 0; mi < kKvM; ++mi) {  // P^T, dS^T: the [query][key] tiles read transposed
          const int off = (16 * ks + lane % 8 + (lane / 16) * 8) * kPStride + kv_key + 16 * mi + ((lane / 8) % 2) * 8;
          ldmatrix_x4_trans(ap[mi], sm.p + off);
          ldmatrix_x4_trans(ads[mi], sm.ds + off);
        }
#pragma unroll
        for (int cp = 0; cp < kKvN / 2; ++cp) {
          const int off = (16 * ks + lane % 8 + ((lane / 8) % 2) * 8) * kStride + kv_col + 16 * cp + (lane / 16) * 8;
          uint32_t bo[4], bq[4];
          ldmatrix_x4_trans(bo, sdo + off);
          ldmatrix_x4_trans(bq, sq + off);
#pragma unroll
          for (int mi = 0; mi < kKvM; ++mi) {
            mma_16x8x16<T>(dv[mi][2 * cp], ap[mi], bo[0], bo[1]);
            mma_16x8x16<T>(dv[mi][2 * cp + 1], ap[mi], bo[2], bo[3]);
            mma_16x8x16<T>(dk[mi][2 * cp], ads[mi], bq[0], bq[1]);
            mma_16x8x16<T>(dk[mi][2 * cp + 1], ads[mi], bq[2], bq[3]);
          }
        }
      }
    };

    // ---- dQ = dS K on the warp's kDqRows rows x kDqCols columns, added into fp32 ----------------
    float dq[kDqM][kDqN][4];
    auto dq_gemm = [&] {
#pragma unroll
      for (int mi = 0; mi < kDqM; ++mi)
#pragma unroll
        for (int c = 0; c < kDqN; ++c)
#pragma unroll
          for (int e = 0; e < 4; ++e) dq[mi][c][e] = 0.f;
#pragma unroll
      for (int ks = 0; ks < kBlockN / 16; ++ks) {
        uint32_t a[kDqM][4];
#pragma unroll
        for (int mi = 0; mi < kDqM; ++mi)
          ldmatrix_x4(a[mi], sm.ds + (dq_row + 16 * mi + lane % 16) * kPStride + 16 * ks + (lane / 16) * 8);
#pragma unroll
        for (int cp = 0; cp < kDqN / 2; ++cp) {
          uint32_t bk[4];
          ldmatrix_x4_trans(bk, sm.k + (16 * ks + lane % 8 + ((lane / 8) % 2) * 8) * kStride + dq_col + 16 * cp +
                                    (lane / 16) * 8);
#pragma unroll
          for (int mi = 0; mi < kDqM; ++mi) {
            mma_16x8x16<T>(dq[mi][2 * cp], a[mi], bk[0], bk[1]);
            mma_16x8x16<T>(dq[mi][2 * cp + 1], a[mi], bk[2], bk[3]);
          }
        }
      }
    };
    auto dq_add = [&] {
#pragma unroll
      for (int mi = 0; mi < kDqM; ++mi)
        bwd_add_dq<Cfg>(P, seq, b, h, row0, seq.seqlen_q, DqPart<Cfg>(dq_row + 16 * mi, dq_col), lane, dq[mi]);
    };
    if (kStaggerDq && !P.deterministic) {  // odd warps dQ first; one copy of each part (a rolled loop)
#pragma unroll 1
      for (int part = 0; part < 2; ++part) {
        if (((warp ^ part) & 1) == 0) {
          dkv_gemm();
        } else {
          dq_gemm();
          dq_add();
        }
      }
    } else {
      if constexpr (!kDqFirst) dkv_gemm();
      dq_gemm();
      int* sem = dq_turn_semaphore(P, b, h, m);
      if (sem) wait_turn(sem, dq_turn_of(P, band, m, n, kBlockM, kBlockN, seq.seqlen_q, seq.seqlen_k));
      dq_add();
      if (sem) pass_turn(sem);
      if constexpr (kDqFirst) dkv_gemm();
    }
  }

  int* sem = dkv_turn_semaphore(P, b, hk, n);
  if (sem) wait_turn(sem, h % p.group);
#pragma unroll
  for (int mi = 0; mi < kKvM; ++mi)
    bwd_store_dkv<Cfg, T>(P, seq, b, hk, col0, keys, kv_key + 16 * mi, kv_col, lane, dk[mi], dv[mi]);
  if (sem) pass_turn(sem);
}

// The second design's launch (pre-pass, kernel, conversions), for tuning and tests. The grid's
// key blocks are the API's (P.num_n_blocks for BwdConfigFor's kBlockN): Cfg::kBlockN must match.
template <typename Cfg, typename T, bool kDqFirst>
Status launch_portable_bwd2_order(const BwdKernelParams& P, Stream stream) {
  constexpr int kSmem = bwd2_smem_bytes<Cfg, T>();
  auto kernel = portable_bwd2_kernel<Cfg, T, kDqFirst>;
  static const cudaError_t attr = prepare_smem(kernel, kSmem);
  if (attr != cudaSuccess) return detail::cuda_status(attr, "portable backward (2-D tiling): shared memory attribute");
  return launch_bwd_passes<T>(kernel, Cfg::kThreads, kSmem, Cfg::kBlockN, P, stream, "portable backward (2-D tiling) launch");
}
template <typename Cfg, typename T>
Status launch_portable_bwd2_cfg(const BwdKernelParams& P, Stream stream) {
  if (P.fwd.batch == 0 || P.fwd.heads == 0) return Status::Ok();
  if (P.deterministic) return launch_portable_bwd2_order<Cfg, T, FLARE_PORTABLE_BWD2_DET_DQ_FIRST != 0>(P, stream);
  return launch_portable_bwd2_order<Cfg, T, false>(P, stream);
}

// The library's portable backward (bwd_launch.h): the 2-D tiling where Bwd2ConfigFor takes it by
// default, else the first design; FLARE_PORTABLE_BWD_2D=0 or 1 forces one (1: where the head dim
// has the 2-D kernel, a multiple of 64).
template <int kHeadDim, typename T>
Status launch_portable_bwd(const BwdKernelParams& p, Stream stream) {
  if constexpr (kHeadDim % 64 == 0) {
    using For2 = Bwd2ConfigFor<kHeadDim>;
    using Cfg2 = typename For2::type;
    static_assert(Cfg2::kBlockN == BwdConfigFor<kHeadDim>::type::kBlockN,
                  "the API sizes the grid and the semaphores from BwdConfigFor's key blocks");
    static const bool use_2d = [] {
      const char* e = std::getenv("FLARE_PORTABLE_BWD_2D");
      return e != nullptr && (e[0] == '0' || e[0] == '1') ? e[0] == '1' : For2::kDefault;
    }();
    if (use_2d) return launch_portable_bwd2_cfg<Cfg2, T>(p, stream);
  }
  return launch_portable_bwd_cfg<typename BwdConfigFor<kHeadDim>::type, T>(p, stream);
}

}  // namespace flare::portable
