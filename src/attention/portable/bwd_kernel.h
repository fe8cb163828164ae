// Portable attention backward (sm_80+) on mma.sync.
//
// Three launches: a pre-pass (dpsum = rowsum(dO o O), zeroed accumulators), the main kernel
// (a CTA per key block of one (sequence, head) walking the query blocks that see it), and a
// conversion of the fp32 accumulators. Per query block the main kernel computes, with the key
// rows as the MMA's M dimension (so dK and dV stay in registers):
//   S^T = K Q^T;  P^T = exp2(S^T - lse);  dP^T = V dO^T;  dS^T = P^T o (dP^T - dpsum)
//   dV += P^T dO;  dK += dS^T Q;  dQ += dS K  (dS^T through shared memory, dQ into fp32)
// Deterministic mode adds each dQ (and GQA's dK/dV) contribution in a fixed turn order behind a
// per-(sequence, head, block) semaphore; the turn order follows the launch order, so a CTA only
// waits for CTAs launched before it.
#pragma once

#include <cuda_runtime.h>

#include <cmath>

#include "src/attention/bwd_params.h"
#include "src/attention/portable/bwd_config.h"
#include "src/attention/portable/fwd_kernel.h"  // prepare_smem
#include "src/attention/portable/tile_copy.h"
#include "src/attention/portable/warp_mma.h"
#include "src/common/cuda_check.h"
#include "src/common/quad_transpose.h"
#include "src/common/turn_semaphore.h"

namespace flare::portable {

using detail::BwdKernelParams;

template <typename Cfg, typename T>
struct BwdSmem {
  T k[Cfg::kBlockN * Cfg::kRowStride];
  T v[Cfg::kBlockN * Cfg::kRowStride];
  T q[2][Cfg::kBlockM * Cfg::kRowStride];
  T dout[2][Cfg::kBlockM * Cfg::kRowStride];
  T ds[Cfg::kBlockN * Cfg::kDsStride];  // dS^T of the current query block
  float lse[2][Cfg::kBlockM];
  float dpsum[2][Cfg::kBlockM];
};

// 4-byte global -> shared copy, zero-filled when invalid.
__device__ __forceinline__ void cp_async_4(void* smem, const void* gmem, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_addr(smem)), "l"(gmem),
               "r"(valid ? 4 : 0));
}

// Waits until the semaphore reaches `turn` (one thread), then lets the CTA in.
__device__ __forceinline__ void wait_turn(const int* sem, int turn) {
  if (threadIdx.x == 0) device_sync::wait_for_turn(sem, turn);
  __syncthreads();
}
// Publishes this CTA's writes and hands the turn on: the barrier orders every thread's adds before
// thread 0's release, which is cumulative (the pattern of CUTLASS's semaphore); no per-thread
// fence (one in every thread made each add wait for its reductions to reach L2).
__device__ __forceinline__ void pass_turn(int* sem) {
  __syncthreads();
  if (threadIdx.x == 0) device_sync::pass_turn(sem);
}

// Deterministic causal runs walk the kv blocks shortest work first (the last blocks see the fewest
// query blocks): the block that reaches a query block first holds the first turn there. Otherwise
// the order is ascending: longest work first for causal, any order for the rest.
__device__ __forceinline__ bool descending_kv_order(const BwdKernelParams& P) { return P.deterministic && P.fwd.causal; }
__device__ __forceinline__ int kv_block_of(const BwdKernelParams& P, int x) {
  return descending_kv_order(P) ? P.num_n_blocks - 1 - x : x;
}
// This CTA's (sequence, head, kv block): the 3D grid's, or for the ordinary mode's masked work the
// tile order's (detail::dense_bwd_grid).
__device__ __forceinline__ sched::TileCoord bwd_cta_tile(const BwdKernelParams& P) {
  if (P.fwd.order.num_tiles > 0) return sched::tile_at(P.fwd.order, blockIdx.x);
  sched::TileCoord c;
  c.batch = blockIdx.z, c.head = blockIdx.y, c.block = kv_block_of(P, blockIdx.x);
  return c;
}

// dQ turn of kv block n at query block m: its rank among the kv blocks that see m, in launch
// order (descending n for causal, ascending otherwise).
__device__ __forceinline__ int dq_turn_of(const BwdKernelParams& P, const sched::Band& band, int m, int n,
                                          int block_m, int block_n, int seqlen_q, int seqlen_k) {
  const int r0 = m * block_m, r1 = min(seqlen_q, r0 + block_m);
  const sched::BlockRange kv = sched::kv_block_range(band, r0, r1, seqlen_k, block_n);
  return descending_kv_order(P) ? kv.last - 1 - n : n - kv.first;
}

// The dense deterministic backward's turn semaphores, null in the ordinary mode: dQ's of query
// block m of (sequence b, head h), the first of its `chains` adjacent ones (the split Hopper
// kernel's dQ halves, each ordered on its own); dK/dV's of key block n of (b, kv head hk), under GQA
// only.
__device__ __forceinline__ int* dq_turn_semaphore(const BwdKernelParams& P, int b, int h, int m, int chains = 1) {
  return P.deterministic ? P.dq_semaphore + ((int64_t{b} * P.fwd.heads + h) * P.num_m_blocks + m) * chains : nullptr;
}
__device__ __forceinline__ int* dkv_turn_semaphore(const BwdKernelParams& P, int b, int hk, int n) {
  return P.deterministic && P.fwd.group > 1 ? P.dkv_semaphore + (int64_t{b} * P.fwd.heads_kv + hk) * P.num_n_blocks + n
                                            : nullptr;
}

// The pieces of a (key block, query block) step that the dense kernel below and the
// block-sparse kernel (bwd_sparse_kernel.h) share: the query block's loads, S^T and dP^T, the
// probabilities and score gradients, the dK/dV accumulation, the dQ product and its reduction,
// and the dK/dV epilogue.

// Where a (sequence, head)'s query side starts: Q, dO, the LSE and dpsum.
template <typename T>
struct BwdQuerySide {
  const T *q, *dout;
  const float *lse, *dpsum;

  __device__ __forceinline__ static BwdQuerySide of(const BwdKernelParams& P, const detail::SeqInfo& seq, int b,
                                                     int h) {
    const detail::FwdKernelParams& p = P.fwd;
    const int64_t stats = b * p.lse_batch_stride + h * p.lse_head_stride + seq.q_start;
    return {static_cast<const T*>(p.q) + detail::row_offset(p.q_str, b, seq.q_start, h),
            static_cast<const T*>(P.dout) + detail::row_offset(P.dout_str, b, seq.q_start, h), p.lse + stats,
            P.dpsum + stats};
  }
};

// Query rows [row0, row_end) of Q, dO, the LSE and dpsum into pipeline stage `stage`; the rest
// of the kBlockM rows zero-filled (Q = dO = 0 and lse = dpsum = 0 give dS = 0 and P dO = 0).
template <typename Cfg, typename T, typename Smem>
__device__ __forceinline__ void bwd_load_q_block(Smem& sm, int stage, const BwdKernelParams& P,
                                                 const BwdQuerySide<T>& qs, int row0, int row_end) {
  constexpr int kBlockM = Cfg::kBlockM, kHeadDim = Cfg::kHeadDim, kStride = Cfg::kRowStride;
  const detail::FwdKernelParams& p = P.fwd;
  const int rows = row_end - row0;
  load_tile<kBlockM, kHeadDim, Cfg::kThreads, kStride>(sm.q[stage], qs.q + row0 * p.q_str.row, p.q_str.row, rows,
                                                       p.head_dim);
  load_tile<kBlockM, kHeadDim, Cfg::kThreads, kStride>(sm.dout[stage], qs.dout + row0 * P.dout_str.row,
                                                       P.dout_str.row, rows, p.head_dim);
  for (int i = threadIdx.x; i < kBlockM; i += Cfg::kThreads) {
    const bool valid = i < rows;
    cp_async_4(&sm.lse[stage][i], qs.lse + (valid ? row0 + i : 0), valid);
    cp_async_4(&sm.dpsum[stage][i], qs.dpsum + (valid ? row0 + i : 0), valid);
  }
}

// Keys [col0, col0 + keys) of K and V (kv head hk) into sm.k, sm.v; the rest of the kBlockN rows
// zero-filled.
template <typename Cfg, typename T, typename Smem>
__device__ __forceinline__ void bwd_load_kv_block(Smem& sm, const BwdKernelParams& P, const detail::SeqInfo& seq,
                                                  int b, int hk, int col0, int keys) {
  const detail::FwdKernelParams& p = P.fwd;
  const T* k_g = static_cast<const T*>(p.k) + detail::row_offset(p.k_str, b, seq.k_start + col0, hk);
  const T* v_g = static_cast<const T*>(p.v) + detail::row_offset(p.v_str, b, seq.k_start + col0, hk);
  load_tile<Cfg::kBlockN, Cfg::kHeadDim, Cfg::kThreads, Cfg::kRowStride>(sm.k, k_g, p.k_str.row, keys, p.head_dim);
  load_tile<Cfg::kBlockN, Cfg::kHeadDim, Cfg::kThreads, Cfg::kRowStride>(sm.v, v_g, p.v_str.row, keys, p.head_dim);
}

// S^T = K Q^T and dP^T = V dO^T for this warp's 16 key rows (from kv_row of the key block).
template <typename Cfg, typename T>
__device__ __forceinline__ void bwd_scores(const T* k_s, const T* v_s, const T* q_s, const T* do_s, int kv_row,
                                           int lane, float (&s)[Cfg::kBlockM / 8][4],
                                           float (&dp)[Cfg::kBlockM / 8][4]) {
  constexpr int kQTiles = Cfg::kBlockM / 8, kKSteps = Cfg::kHeadDim / 16, kStride = Cfg::kRowStride;
#pragma unroll
  for (int j = 0; j < kQTiles; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) s[j][e] = dp[j][e] = 0.f;
#pragma unroll
  for (int ks = 0; ks < kKSteps; ++ks) {
    uint32_t ak[4], av[4];
    ldmatrix_x4(ak, k_s + (kv_row + lane % 16) * kStride + 16 * ks + (lane / 16) * 8);
    ldmatrix_x4(av, v_s + (kv_row + lane % 16) * kStride + 16 * ks + (lane / 16) * 8);
#pragma unroll
    for (int jp = 0; jp < kQTiles / 2; ++jp) {
      const int off = (16 * jp + lane % 8 + (lane / 16) * 8) * kStride + 16 * ks + ((lane / 8) % 2) * 8;
      uint32_t bq[4], bo[4];
      ldmatrix_x4(bq, q_s + off);
      ldmatrix_x4(bo, do_s + off);
      mma_16x8x16<T>(s[2 * jp], ak, bq[0], bq[1]);
      mma_16x8x16<T>(s[2 * jp + 1], ak, bq[2], bq[3]);
      mma_16x8x16<T>(dp[2 * jp], av, bo[0], bo[1]);
      mma_16x8x16<T>(dp[2 * jp + 1], av, bo[2], bo[3]);
    }
  }
}

// The query block's statistics as this thread's element loops read them.
struct QueryStats {
  const float* lse;    // per query column of the block (natural log)
  const float* dpsum;
  int t;               // lane coordinate in the MMA fragment
};

// s (S^T accumulators) becomes P^T and dp (dP^T) becomes dS^T (w.r.t. the scaled, pre-cap
// scores); mask(s) (the caller's masking, or nothing) runs on P^T. Element e of
// tile j: key row g + 8 * (e / 2) of the warp, query column 8j + 2t + e % 2 of the block.
template <bool kSoftcap, int kQTiles, typename MaskProbs>
__device__ __forceinline__ void probs_and_grads(const detail::FwdKernelParams& p, const QueryStats& c,
                                                float (&s)[kQTiles][4], float (&dp)[kQTiles][4], MaskProbs&& mask) {
  constexpr float kLog2e = static_cast<float>(M_LOG2E);
  float cap_grad[kSoftcap ? kQTiles : 1][4];
  if constexpr (kSoftcap) {
    const float pre = p.scale / p.softcap, post = p.softcap * kLog2e;
#pragma unroll
    for (int j = 0; j < kQTiles; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float th = fast_tanh(s[j][e] * pre);
        s[j][e] = post * th;
        cap_grad[j][e] = 1.f - th * th;
      }
  } else {
#pragma unroll
    for (int j = 0; j < kQTiles; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[j][e] *= p.scale_log2;
  }
#pragma unroll
  for (int j = 0; j < kQTiles; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) s[j][e] = fast_exp2(fmaf(-c.lse[8 * j + 2 * c.t + (e % 2)], kLog2e, s[j][e]));
  mask(s);
#pragma unroll
  for (int j = 0; j < kQTiles; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float ds = s[j][e] * (dp[j][e] - c.dpsum[8 * j + 2 * c.t + (e % 2)]);
      if constexpr (kSoftcap) ds *= cap_grad[j][e];
      dp[j][e] = ds;
    }
}

// dV += P^T dO and dK += dS^T Q over this warp's columns; dS^T to shared memory (ds_s) for the
// dQ product.
template <typename Cfg, typename T>
__device__ __forceinline__ void bwd_accumulate_dkv(const float (&s)[Cfg::kBlockM / 8][4],
                                                   const float (&dp)[Cfg::kBlockM / 8][4], const T* q_s,
                                                   const T* do_s, T* ds_s, int kv_row, int dkv_col, int part,
                                                   int lane, float (&dk)[Cfg::kDkvCols / 8][4],
                                                   float (&dv)[Cfg::kDkvCols / 8][4]) {
  constexpr int kBlockM = Cfg::kBlockM, kDkvTiles = Cfg::kDkvCols / 8;
  constexpr int kStride = Cfg::kRowStride, kDsStride = Cfg::kDsStride;
  const int g = lane / 4, t = lane % 4;
#pragma unroll
  for (int ks = 0; ks < kBlockM / 16; ++ks) {
    uint32_t ap[4], ads[4];
    accum_to_a<T>(s[2 * ks], s[2 * ks + 1], ap);
    accum_to_a<T>(dp[2 * ks], dp[2 * ks + 1], ads);
#pragma unroll
    for (int cp = 0; cp < kDkvTiles / 2; ++cp) {
      const int off = (16 * ks + lane % 8 + ((lane / 8) % 2) * 8) * kStride + dkv_col + 16 * cp + (lane / 16) * 8;
      uint32_t bo[4], bq[4];
      ldmatrix_x4_trans(bo, do_s + off);
      ldmatrix_x4_trans(bq, q_s + off);
      mma_16x8x16<T>(dv[2 * cp], ap, bo[0], bo[1]);
      mma_16x8x16<T>(dv[2 * cp + 1], ap, bo[2], bo[3]);
      mma_16x8x16<T>(dk[2 * cp], ads, bq[0], bq[1]);
      mma_16x8x16<T>(dk[2 * cp + 1], ads, bq[2], bq[3]);
    }
    if (part == 0) {  // one writer per key row
      *reinterpret_cast<uint32_t*>(ds_s + (kv_row + g) * kDsStride + 16 * ks + 2 * t) = ads[0];
      *reinterpret_cast<uint32_t*>(ds_s + (kv_row + g + 8) * kDsStride + 16 * ks + 2 * t) = ads[1];
      *reinterpret_cast<uint32_t*>(ds_s + (kv_row + g) * kDsStride + 16 * ks + 8 + 2 * t) = ads[2];
      *reinterpret_cast<uint32_t*>(ds_s + (kv_row + g + 8) * kDsStride + 16 * ks + 8 + 2 * t) = ads[3];
    }
  }
}

// Where a warp's share of the dQ product sits in the query block: 16 rows x kDqCols columns.
template <typename Cfg>
struct DqPart {
  int row, col;
  __device__ __forceinline__ explicit DqPart(int warp)
      : row(16 * (warp % Cfg::kDqMTiles)), col((warp / Cfg::kDqMTiles) * Cfg::kDqCols) {}
  __device__ __forceinline__ DqPart(int row_, int col_) : row(row_), col(col_) {}
};

// dQ (this warp's part) = dS K, with dS^T staged in ds_s (after a barrier).
template <typename Cfg, typename T>
__device__ __forceinline__ void bwd_dq_product(const T* ds_s, const T* k_s, DqPart<Cfg> part, int lane,
                                               float (&dq)[Cfg::kDqCols / 8][4]) {
  constexpr int kBlockN = Cfg::kBlockN, kDqTiles = Cfg::kDqCols / 8;
  constexpr int kStride = Cfg::kRowStride, kDsStride = Cfg::kDsStride;
#pragma unroll
  for (int c = 0; c < kDqTiles; ++c) dq[c][0] = dq[c][1] = dq[c][2] = dq[c][3] = 0.f;
#pragma unroll
  for (int ks = 0; ks < kBlockN / 16; ++ks) {
    uint32_t a[4];
    ldmatrix_x4_trans(a, ds_s + (16 * ks + lane % 8 + (lane / 16) * 8) * kDsStride + part.row + ((lane / 8) % 2) * 8);
#pragma unroll
    for (int cp = 0; cp < kDqTiles / 2; ++cp) {
      uint32_t bk[4];
      ldmatrix_x4_trans(bk, k_s + (16 * ks + lane % 8 + ((lane / 8) % 2) * 8) * kStride + part.col + 16 * cp +
                                (lane / 16) * 8);
      mma_16x8x16<T>(dq[2 * cp], a, bk[0], bk[1]);
      mma_16x8x16<T>(dq[2 * cp + 1], a, bk[2], bk[3]);
    }
  }
}

// Adds the warp's dQ part (scaled) of query rows [row0, row_end) into the fp32 accumulator.
template <typename Cfg>
__device__ __forceinline__ void bwd_add_dq(const BwdKernelParams& P, const detail::SeqInfo& seq, int b, int h,
                                           int row0, int row_end, DqPart<Cfg> part, int lane,
                                           const float (&dq)[Cfg::kDqCols / 8][4]) {
  const detail::FwdKernelParams& p = P.fwd;
  const int g = lane / 4, t = lane % 4;
  // The thread's first element (row i0, column col0), once: each reduction is then an immediate
  // offset from one pointer. Computed per element, the address math took about 25 instructions a
  // reduction (the reductions' memory clobber forced the parameters to be re-read). In the blocked
  // accumulator (detail::portable_dq_offset; part.row and row0 are multiples of 8) column group c
  // sits 64 floats on, and row i0 + 8 one row group on.
  const int i0 = row0 + part.row + g, col0 = part.col + 2 * t;
  float* const base =
      P.dq_accum + detail::portable_dq_offset(detail::portable_dq_row(p, b, seq.q_start, i0), h, col0, p.heads, p.head_dim);
  const float scale = p.scale;
  float* const base8 = base + int64_t{p.heads} * p.head_dim * 8;
  // Columns col0 + 8 c, + 1 of rows i0 and i0 + 8: one 8-byte reduction each (a warp's is 256
  // contiguous bytes), in turn order when deterministic (the turn's release orders CTAs' reductions).
  if (row0 + part.row + 16 <= row_end && part.col + Cfg::kDqCols <= p.head_dim) {  // the warp's whole tile
#pragma unroll
    for (int c = 0; c < Cfg::kDqCols / 8; ++c) {
      red_add_f32x2(base + 64 * c, dq[c][0] * scale, dq[c][1] * scale);
      red_add_f32x2(base8 + 64 * c, dq[c][2] * scale, dq[c][3] * scale);
    }
    return;
  }
  const int cols = p.head_dim - col0;  // columns from col0 on (the head dim is a multiple of 8)
  const bool row_ok0 = i0 < row_end, row_ok1 = i0 + 8 < row_end;
#pragma unroll
  for (int c = 0; c < Cfg::kDqCols / 8; ++c) {
    red_add_f32x2_if(row_ok0 && 8 * c < cols, base + 64 * c, dq[c][0] * scale, dq[c][1] * scale);
    red_add_f32x2_if(row_ok1 && 8 * c < cols, base8 + 64 * c, dq[c][2] * scale, dq[c][3] * scale);
  }
}

// dK (scaled) and dV of keys [col0, col0 + keys): written directly without GQA, else added into
// fp32 accumulators. kRows16: 16-byte stores through the quad transpose where the rows allow
// (off for the block-sparse deterministic kernel, whose spills it tripled: 44 -> 148 bytes at d128).
template <typename Cfg, typename T, bool kRows16 = true>
__device__ __forceinline__ void bwd_store_dkv(const BwdKernelParams& P, const detail::SeqInfo& seq, int b, int hk,
                                              int col0, int keys, int kv_row, int dkv_col, int lane,
                                              const float (&dk)[Cfg::kDkvCols / 8][4],
                                              const float (&dv)[Cfg::kDkvCols / 8][4]) {
  const detail::FwdKernelParams& p = P.fwd;
  const bool gqa = p.group > 1;
  const int g = lane / 4, t = lane % 4;
  if constexpr (kRows16 && Cfg::kDkvCols % 16 == 0) {
    // Without GQA, where the rows are 16-byte aligned: each 16 x 16 block through the quad
    // transpose, one 16-byte store a lane (row kv_row + g + 8 (t / 2), columns 8 (t % 2) ..).
    T* dk0 = static_cast<T*>(P.dk) + detail::row_offset(P.dk_str, b, seq.k_start + col0, hk);
    T* dv0 = static_cast<T*>(P.dv) + detail::row_offset(P.dv_str, b, seq.k_start + col0, hk);
    if (!gqa && rows_16b_aligned(dk0, P.dk_str.row) && rows_16b_aligned(dv0, P.dv_str.row)) {
      const int key = kv_row + g + 8 * (t / 2);
      auto store = [&](T* dst, const float(&x)[Cfg::kDkvCols / 8][4], float scale) {  // dK, then dV
#pragma unroll
        for (int blk = 0; blk < Cfg::kDkvCols / 16; ++blk) {
          const uint4 v = accumulator_piece<T>([&](int i) { return x[i / 4][i % 4]; }, blk, scale, scale, t);
          const int col = dkv_col + 16 * blk + 8 * (t % 2);
          if (key < keys && col < p.head_dim) *reinterpret_cast<uint4*>(dst + col) = v;
        }
      };
      store(dk0 + static_cast<int64_t>(key) * P.dk_str.row, dk, p.scale);
      store(dv0 + static_cast<int64_t>(key) * P.dv_str.row, dv, 1.f);
      return;
    }
  }
#pragma unroll
  for (int c = 0; c < Cfg::kDkvCols / 8; ++c)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int key = kv_row + g + 8 * r, col = dkv_col + 8 * c + 2 * t;
      if (key >= keys || col >= p.head_dim) continue;
      const float k0 = dk[c][2 * r] * p.scale, k1 = dk[c][2 * r + 1] * p.scale;
      const float v0 = dv[c][2 * r], v1 = dv[c][2 * r + 1];
      if (!gqa) {
        T* dkp = static_cast<T*>(P.dk) + detail::row_offset(P.dk_str, b, seq.k_start + col0 + key, hk) + col;
        T* dvp = static_cast<T*>(P.dv) + detail::row_offset(P.dv_str, b, seq.k_start + col0 + key, hk) + col;
        *reinterpret_cast<uint32_t*>(dkp) = ElemTraits<T>::pack(k0, k1);
        *reinterpret_cast<uint32_t*>(dvp) = ElemTraits<T>::pack(v0, v1);
      } else {
        const int64_t off = (detail::accum_row(p, b, seq.k_start, col0 + key, p.seqlen_k) * p.heads_kv + hk) * p.head_dim + col;
        red_add_f32x2(P.dk_accum + off, k0, k1);
        red_add_f32x2(P.dv_accum + off, v0, v1);
      }
    }
}

template <typename Cfg, typename T>
__global__ void __launch_bounds__(Cfg::kThreads) portable_bwd_kernel(const BwdKernelParams P) {
  constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN;
  constexpr int kQTiles = kBlockM / 8;          // n-tiles of S^T (query columns)
  constexpr int kDkvTiles = Cfg::kDkvCols / 8;  // n-tiles of this warp's dK/dV columns
  constexpr int kDqTiles = Cfg::kDqCols / 8;
  const detail::FwdKernelParams& p = P.fwd;

  const sched::TileCoord cta = bwd_cta_tile(P);
  const int h = cta.head, b = cta.batch, n = cta.block;
  const detail::SeqInfo seq = detail::seq_info(p, b);
  const int col0 = n * kBlockN;  // first key of this block
  if (col0 >= seq.seqlen_k) return;
  const int hk = h / p.group;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int row_group = warp / Cfg::kColSplit, part = warp % Cfg::kColSplit;
  const int kv_row = 16 * row_group;           // this warp's key rows within the block
  const int dkv_col = part * Cfg::kDkvCols;    // and its dK/dV columns
  const int keys = min(kBlockN, seq.seqlen_k - col0);

  extern __shared__ __align__(16) unsigned char smem_raw[];
  auto& sm = *reinterpret_cast<BwdSmem<Cfg, T>*>(smem_raw);

  const BwdQuerySide<T> qs = BwdQuerySide<T>::of(P, seq, b, h);

  const sched::Band band = detail::band_of(p, seq);
  // The query steps whose tile is FULL, by first row, once (sched::full_row_tiles).
  const sched::RowSpan full_rows = sched::full_row_tiles(band, col0, col0 + kBlockN, seq.seqlen_k, kBlockM);
  const sched::BlockRange mrange =
      sched::q_block_range(band, col0, col0 + keys, seq.seqlen_q, kBlockM);

  auto load_q_block = [&](int m, int stage) {
    bwd_load_q_block<Cfg, T>(sm, stage, P, qs, m * kBlockM, seq.seqlen_q);
  };

  float dk[kDkvTiles][4], dv[kDkvTiles][4];
#pragma unroll
  for (int c = 0; c < kDkvTiles; ++c)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[c][e] = dv[c][e] = 0.f;

  if (mrange.first < mrange.last) {
    bwd_load_kv_block<Cfg, T>(sm, P, seq, b, hk, col0, keys);
    load_q_block(mrange.first, 0);
    cp_async_commit();
  }

  for (int m = mrange.first, it = 0; m < mrange.last; ++m, ++it) {
    const int stage = it & 1;
    const int row0 = m * kBlockM;
    cp_async_wait<0>();
    __syncthreads();  // block m landed; the previous block's readers of ds and the other stage are done
    if (m + 1 < mrange.last) load_q_block(m + 1, stage ^ 1);
    cp_async_commit();
    const T* sq = sm.q[stage];
    const T* sdo = sm.dout[stage];

    float s[kQTiles][4], dp[kQTiles][4];
    bwd_scores<Cfg, T>(sm.k, sm.v, sq, sdo, kv_row, lane, s, dp);

    // P^T and dS^T: branch-free element loops, one variant per soft-capping mode.
    const bool partial = row0 + kBlockM > seq.seqlen_q || !full_rows.contains(row0);
    const QueryStats stats{sm.lse[stage], sm.dpsum[stage], t};
    // The loop written out here, not through a helper: at the 255-register ceiling the helper's
    // form cost 16 bytes of spills (ptxas, sm_80 and sm_90, d128).
    auto mask = [&](float (&s)[kQTiles][4]) {
      if (!partial) return;
#pragma unroll
      for (int j = 0; j < kQTiles; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int qi = row0 + 8 * j + 2 * t + (e % 2), key = col0 + kv_row + g + 8 * (e / 2);
          const bool visible = qi < seq.seqlen_q && key < seq.seqlen_k && band.visible(qi, key);
          s[j][e] = visible ? s[j][e] : 0.f;
        }
    };
    if (p.softcap > 0.f) probs_and_grads<true, kQTiles>(p, stats, s, dp, mask);
    else probs_and_grads<false, kQTiles>(p, stats, s, dp, mask);

    bwd_accumulate_dkv<Cfg, T>(s, dp, sq, sdo, sm.ds, kv_row, dkv_col, part, lane, dk, dv);
    __syncthreads();

    const DqPart<Cfg> dq_part(warp);
    float dq[kDqTiles][4];
    bwd_dq_product<Cfg, T>(sm.ds, sm.k, dq_part, lane, dq);
    int* sem = dq_turn_semaphore(P, b, h, m);
    if (sem) wait_turn(sem, dq_turn_of(P, band, m, n, kBlockM, kBlockN, seq.seqlen_q, seq.seqlen_k));
    bwd_add_dq<Cfg>(P, seq, b, h, row0, seq.seqlen_q, dq_part, lane, dq);
    if (sem) pass_turn(sem);
  }

  int* sem = dkv_turn_semaphore(P, b, hk, n);
  if (sem) wait_turn(sem, h % p.group);
  bwd_store_dkv<Cfg, T>(P, seq, b, hk, col0, keys, kv_row, dkv_col, lane, dk, dv);
  if (sem) pass_turn(sem);
}

// dpsum = rowsum(dO o O) in fp32, one warp per (row, head); laid out like the LSE. With
// P.row_stats (the Hopper kernel's padded statistics) also (LSE log2e, dpsum) per row there, and
// (+inf, 0) for the rows past the sequence up to num_m_blocks * kRowStatsBlockM (the grid covers
// them).
template <typename T>
__global__ void bwd_dpsum_kernel(const BwdKernelParams P) {
  const detail::FwdKernelParams& p = P.fwd;
  const int b = blockIdx.z, h = blockIdx.y;
  const detail::SeqInfo seq = detail::seq_info(p, b);
  const int i = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
  constexpr int kStatsM = detail::kRowStatsBlockM;
  float* stats = P.row_stats == nullptr
                     ? nullptr
                     : P.row_stats + ((int64_t{b} * p.heads + h) * P.num_m_blocks + i / kStatsM) * 2 * kStatsM + i % kStatsM;
  if (i >= seq.seqlen_q) {
    if (stats != nullptr && lane == 0 && i < P.num_m_blocks * kStatsM) {
      stats[0] = INFINITY;
      stats[kStatsM] = 0.f;
    }
    return;
  }
  const T* o = static_cast<const T*>(p.out) + detail::row_offset(p.out_str, b, seq.q_start + i, h);
  const T* d = static_cast<const T*>(P.dout) + detail::row_offset(P.dout_str, b, seq.q_start + i, h);
  float acc = 0.f;
  for (int c = lane * 8; c < p.head_dim; c += 32 * 8) {
    const uint4 ov = *reinterpret_cast<const uint4*>(o + c), dv = *reinterpret_cast<const uint4*>(d + c);
    const T* oe = reinterpret_cast<const T*>(&ov);
    const T* de = reinterpret_cast<const T*>(&dv);
#pragma unroll
    for (int e = 0; e < 8; ++e) acc += static_cast<float>(oe[e]) * static_cast<float>(de[e]);
  }
  for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  if (lane == 0) {
    const int64_t at = b * p.lse_batch_stride + h * p.lse_head_stride + seq.q_start + i;
    P.dpsum[at] = acc;
    if (stats != nullptr) {
      stats[0] = p.lse[at] * static_cast<float>(M_LOG2E);
      stats[kStatsM] = acc;
    }
  }
}

// dsinks[h] = -sum over rows of exp(sink - lse) * dpsum (bwd_common.cu).
Status launch_bwd_dsinks(const BwdKernelParams& P, Stream stream);

// An fp32 accumulator -> the dtype through the output's strides: dQ's blocked one
// (q_side: detail::portable_dq_offset), dK's and dV's [rows, heads, head_dim].
template <typename T>
__global__ void bwd_convert_kernel(const float* acc, void* out, detail::RowStrides str, const detail::FwdKernelParams p,
                                   int heads, bool q_side) {
  const int b = blockIdx.z, h = blockIdx.y;
  const detail::SeqInfo seq = detail::seq_info(p, b);
  const int len = q_side ? seq.seqlen_q : seq.seqlen_k;
  const int64_t start = q_side ? seq.q_start : seq.k_start;
  const int max_len = q_side ? p.seqlen_q : p.seqlen_k;
  // Row i's place in the accumulator's row space, and a (row, column)'s float offset.
  auto row_of = [&](int i) {
    return q_side ? detail::portable_dq_row(p, b, start, i) : detail::accum_row(p, b, start, i, max_len);
  };
  auto offset = [&](int64_t row, int c) {
    return q_side ? detail::portable_dq_offset(row, h, c, heads, p.head_dim) : (row * heads + h) * p.head_dim + c;
  };
  // 8 elements a thread (two float4 loads, one 16-byte store) where the output's rows allow it:
  // one element a thread left a d128 row's 128 threads a 2-byte store each and a CTA per row.
  T* out0 = static_cast<T*>(out) + detail::row_offset(str, b, start, h);
  if (p.head_dim % 8 == 0 && rows_16b_aligned(out0, str.row) && reinterpret_cast<uintptr_t>(acc) % 16 == 0) {
    const int vecs = p.head_dim / 8;
    for (int64_t e = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; e < int64_t{len} * vecs;
         e += int64_t{gridDim.x} * blockDim.x) {
      const int i = static_cast<int>(e / vecs), c = static_cast<int>(e % vecs) * 8;
      const float* src = acc + offset(row_of(i), c);
      const float4 lo = *reinterpret_cast<const float4*>(src), hi = *reinterpret_cast<const float4*>(src + 4);
      *reinterpret_cast<uint4*>(out0 + int64_t{i} * str.row + c) =
          make_uint4(ElemTraits<T>::pack(lo.x, lo.y), ElemTraits<T>::pack(lo.z, lo.w), ElemTraits<T>::pack(hi.x, hi.y),
                     ElemTraits<T>::pack(hi.z, hi.w));
    }
    return;
  }
  for (int i = blockIdx.x; i < len; i += gridDim.x) {
    const int64_t row = row_of(i);
    T* dst = static_cast<T*>(out) + detail::row_offset(str, b, start + i, h);
    for (int c = threadIdx.x; c < p.head_dim; c += blockDim.x) dst[c] = static_cast<T>(acc[offset(row, c)]);
  }
}

// bwd_convert_kernel's CTAs per (head, sequence) for `rows` rows: 8 rows each (the vector path's
// 128 threads cover 8 rows of d128), at most 512 (the CTAs then loop).
inline int bwd_convert_ctas(int rows) { return rows > 0 ? std::min((rows + 7) / 8, 512) : 1; }

// GQA: dK and dV from their fp32 accumulators (summed over the q heads of a kv head) to the
// output dtype; without GQA the kernels wrote them directly. Shared by every backward kernel.
template <typename T>
void launch_bwd_dkv_convert(const BwdKernelParams& P, Stream stream) {
  const detail::FwdKernelParams& p = P.fwd;
  if (p.group <= 1) return;
  dim3 grid(bwd_convert_ctas(p.seqlen_k), p.heads_kv, p.batch);
  bwd_convert_kernel<T><<<grid, 128, 0, stream>>>(P.dk_accum, P.dk, P.dk_str, p, p.heads_kv, false);
  bwd_convert_kernel<T><<<grid, 128, 0, stream>>>(P.dv_accum, P.dv, P.dv_str, p, p.heads_kv, false);
}

// The launches around the main kernel, shared with the block-sparse backward: dpsum before it,
// dsinks and the conversions of the fp32 accumulators after it.
template <typename T>
void launch_bwd_dpsum(const BwdKernelParams& P, Stream stream) {
  const detail::FwdKernelParams& p = P.fwd;
  if (p.seqlen_q > 0) {
    dim3 grid((p.seqlen_q + 7) / 8, p.heads, p.batch);
    bwd_dpsum_kernel<T><<<grid, 256, 0, stream>>>(P);
  }
}
template <typename T>
Status launch_bwd_finish(const BwdKernelParams& P, Stream stream) {
  const detail::FwdKernelParams& p = P.fwd;
  if (P.dsinks != nullptr) FLARE_RETURN_IF_ERROR(launch_bwd_dsinks(P, stream));
  bwd_convert_kernel<T><<<dim3(bwd_convert_ctas(p.seqlen_q), p.heads, p.batch), 128, 0, stream>>>(P.dq_accum, P.dq,
                                                                                                    P.dq_str, p, p.heads, true);
  launch_bwd_dkv_convert<T>(P, stream);
  return Status::Ok();
}

// A dense backward's launches: dpsum, `kernel` on a CTA per (key block, head, sequence) (grid:
// detail::dense_bwd_grid), the finishing kernels. (Its shared-memory attribute is the caller's, set once per kernel.)
template <typename T>
Status launch_bwd_passes(void (*kernel)(BwdKernelParams), int threads, int smem, int block_n, const BwdKernelParams& P,
                         Stream stream, const char* what) {
  const detail::FwdKernelParams& p = P.fwd;
  launch_bwd_dpsum<T>(P, stream);
  if (p.seqlen_k > 0 && P.num_n_blocks > 0) {
    BwdKernelParams ordered = P;
    const detail::GridDims g =
        detail::dense_bwd_grid(ordered, block_n, sizeof(T), int64_t{detail::current_device_facts().l2_bytes} / 2);
    kernel<<<dim3(g.x, g.y, g.z), threads, smem, stream>>>(ordered);
  }
  FLARE_RETURN_IF_ERROR(launch_bwd_finish<T>(P, stream));
  return detail::cuda_status(cudaGetLastError(), what);
}

template <typename Cfg, typename T>
Status launch_portable_bwd_cfg(const BwdKernelParams& P, Stream stream) {
  if (P.fwd.batch == 0 || P.fwd.heads == 0) return Status::Ok();
  constexpr int kSmem = bwd_smem_bytes<Cfg, T>();
  auto kernel = portable_bwd_kernel<Cfg, T>;
  static const cudaError_t attr = prepare_smem(kernel, kSmem);
  if (attr != cudaSuccess) return detail::cuda_status(attr, "portable backward: shared memory attribute");
  return launch_bwd_passes<T>(kernel, Cfg::kThreads, kSmem, Cfg::kBlockN, P, stream, "portable backward launch");
}

// launch_portable_bwd (bwd_launch.h) is defined in bwd2_kernel.h, which picks between this design
// and the 2-D tiling.

}  // namespace flare::portable
