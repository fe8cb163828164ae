// Portable attention forward (sm_80+): FlashAttention-2's algorithm on mma.sync.
//
// A CTA owns kBlockM query rows of one (sequence, head); each warp owns 16 * kMTiles of them.
// It walks the visible KV blocks from the last to the first (the partial, masked ones at the
// diagonal come first), double-buffering K and V through cp.async, and keeps S, P and O in
// registers:  S = Q K^T;  mask (partial tiles only);  online softmax in exp2;  O += P V.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>

#include "src/attention/fwd_params.h"
#include "src/attention/portable/fwd_config.h"
#include "src/attention/portable/tile_copy.h"
#include "src/attention/portable/warp_mma.h"
#include "src/common/cuda_check.h"
#include "src/common/device_facts.h"

namespace flare::portable {

using detail::FwdKernelParams;

template <typename Cfg, typename T>
struct FwdSmem {
  T q[Cfg::kBlockM * Cfg::kRowStride];
  T k[Cfg::kStages][Cfg::kBlockN * Cfg::kRowStride];
  T v[Cfg::kStages][Cfg::kBlockN * Cfg::kRowStride];
};

// Per-thread softmax state of the 2 * kMTiles rows a thread touches (rows g and g + 8 of each m-tile).
template <int kMTiles>
struct RowState {
  float max[kMTiles][2];  // running max, scaled log2 units
  float sum[kMTiles][2];  // this thread's share of the denominator
};

// The pieces of a q tile's work that the dense kernel below and the block-sparse kernel
// (fwd_sparse_kernel.h) share: accumulator set-up, one KV block's step, the epilogue.

// O = 0; the running max and sum start from the sink (if any) or empty.
template <typename Cfg>
__device__ __forceinline__ void fwd_init_accumulators(const FwdKernelParams& p, int h, int t,
                                                      float (&o)[Cfg::kMTiles][Cfg::kHeadDim / 8][4],
                                                      RowState<Cfg::kMTiles>& st) {
  const float sink_log2 = p.sinks ? p.sinks[h] * static_cast<float>(M_LOG2E) : -INFINITY;
#pragma unroll
  for (int mt = 0; mt < Cfg::kMTiles; ++mt) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      st.max[mt][r] = sink_log2;
      st.sum[mt][r] = (p.sinks && t == 0) ? 1.f : 0.f;  // the quad's sum is reduced at the end
    }
#pragma unroll
    for (int dt = 0; dt < Cfg::kHeadDim / 8; ++dt) o[mt][dt][0] = o[mt][dt][1] = o[mt][dt][2] = o[mt][dt][3] = 0.f;
  }
}

// Sets the scores of the elements `visible(row, col)` rejects to -inf. row_base: the first row
// of this thread (tile row + warp row + g), col_base: its first column (tile column + 2t).
template <int kMTiles, int kNTiles, typename Visible>
__device__ __forceinline__ void mask_scores(float (&s)[kMTiles][kNTiles][4], int row_base, int col_base,
                                            Visible&& visible) {
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int j = 0; j < kNTiles; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = row_base + 16 * mt + (e / 2) * 8;
        const int jcol = col_base + 8 * j + (e % 2);
        s[mt][j][e] = visible(mt, e / 2, i, jcol) ? s[mt][j][e] : -INFINITY;
      }
}

// Sets the scores outside the band (or at columns col_end and past) to -inf: the dense masks'
// case of mask_scores. Each row's visible columns [lo, hi) are found once, relative to the
// thread's first column, so an element costs two compares against a constant offset.
template <int kMTiles, int kNTiles>
__device__ __forceinline__ void mask_band(float (&s)[kMTiles][kNTiles][4], const sched::Band& band, int row_base,
                                          int col_base, int col_end) {
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int i = row_base + 16 * mt + 8 * r;
      const int lo = band.row_lo(i) - col_base, hi = band.row_hi(i, col_end) - col_base;
#pragma unroll
      for (int j = 0; j < kNTiles; ++j)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const int col = 8 * j + c;
          s[mt][j][2 * r + c] = col >= lo && col < hi ? s[mt][j][2 * r + c] : -INFINITY;
        }
    }
}

// No-op pipeline hook of fwd_attend_block.
struct NoHook {
  __device__ __forceinline__ void operator()() const {}
};

// One KV block (K and V staged in k_s, v_s):  S = Q K^T;  after_s();  soft-cap;  mask_block(s)
// (the caller's masking, by mask_scores or not at all);  online softmax in exp2;  before_pv();
// O += P V. The hooks let the split pipeline (kStages = 1) reload K once S is done and wait for V
// just before PV.
template <typename Cfg, typename T, typename MaskBlock, typename AfterS = NoHook, typename BeforePV = NoHook>
__device__ __forceinline__ void fwd_attend_block(const FwdKernelParams& p, const T* q_s, const T* k_s, const T* v_s,
                                                 int warp_row, int lane, float score_scale,
                                                 float (&o)[Cfg::kMTiles][Cfg::kHeadDim / 8][4],
                                                 RowState<Cfg::kMTiles>& st, MaskBlock&& mask_block,
                                                 AfterS&& after_s = {}, BeforePV&& before_pv = {}) {
  constexpr int kHeadDim = Cfg::kHeadDim;
  constexpr int kMTiles = Cfg::kMTiles, kBlockN = Cfg::kBlockN;
  constexpr int kNTiles = kBlockN / 8, kDTiles = kHeadDim / 8, kKSteps = kHeadDim / 16;
  constexpr int kStride = Cfg::kRowStride;

  // S = Q K^T
  float s[kMTiles][kNTiles][4];
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int j = 0; j < kNTiles; ++j) s[mt][j][0] = s[mt][j][1] = s[mt][j][2] = s[mt][j][3] = 0.f;
#pragma unroll
  for (int ks = 0; ks < kKSteps; ++ks) {
    uint32_t a[kMTiles][4];
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
      ldmatrix_x4(a[mt], q_s + (warp_row + 16 * mt + lane % 16) * kStride + 16 * ks + (lane / 16) * 8);
#pragma unroll
    for (int jp = 0; jp < kNTiles / 2; ++jp) {
      uint32_t bk[4];
      ldmatrix_x4(bk, k_s + (16 * jp + lane % 8 + (lane / 16) * 8) * kStride + 16 * ks +
                          ((lane / 8) % 2) * 8);
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
        mma_16x8x16<T>(s[mt][2 * jp], a[mt], bk[0], bk[1]);
        mma_16x8x16<T>(s[mt][2 * jp + 1], a[mt], bk[2], bk[3]);
      }
    }
  }
  after_s();

  // Scores soft-capped (then in scaled log2 units) and masked on partial tiles. Each step is a
  // branch-free loop under a uniform condition, so the compiler keeps the element work
  // straight-line and interleaved.
  if (p.softcap > 0.f) {
    const float pre = p.scale / p.softcap, post = p.softcap * static_cast<float>(M_LOG2E);
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int j = 0; j < kNTiles; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mt][j][e] = post * fast_tanh(s[mt][j][e] * pre);
  }  // without a cap, the scale is folded into the exponent below (one FFMA per element)
  mask_block(s);

  // Online softmax: new max, rescale the sum and O, P = exp2(S - max). With kLazyRescale, O is
  // rescaled only when some row of the warp has a new max: otherwise every factor is exactly 1
  // (the max settles within a few blocks; the rescale is kHeadDim / 4 multiplies a row pair).
  float alphas[kMTiles][2];
  bool new_max = false;
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float mx = -INFINITY;  // of the raw scores: the scale is positive
#pragma unroll
      for (int j = 0; j < kNTiles; ++j) mx = fmaxf(mx, fmaxf(s[mt][j][2 * r], s[mt][j][2 * r + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      mx = fmaxf(st.max[mt][r], mx * score_scale);      // scaled log2 units
      const float base = mx == -INFINITY ? 0.f : mx;  // rows with nothing visible yet
      const float alpha = fast_exp2(st.max[mt][r] - base);
      new_max |= st.max[mt][r] != mx;
      alphas[mt][r] = alpha;
      st.max[mt][r] = mx;
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < kNTiles; ++j) {
        s[mt][j][2 * r] = fast_exp2(fmaf(s[mt][j][2 * r], score_scale, -base));
        s[mt][j][2 * r + 1] = fast_exp2(fmaf(s[mt][j][2 * r + 1], score_scale, -base));
        sum += s[mt][j][2 * r] + s[mt][j][2 * r + 1];
      }
      st.sum[mt][r] = st.sum[mt][r] * alpha + sum;
    }
  if (!Cfg::kLazyRescale || __any_sync(0xffffffffu, new_max)) {
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int dt = 0; dt < kDTiles; ++dt) {
        o[mt][dt][0] *= alphas[mt][0];
        o[mt][dt][1] *= alphas[mt][0];
        o[mt][dt][2] *= alphas[mt][1];
        o[mt][dt][3] *= alphas[mt][1];
      }
  }

  // O += P V
  before_pv();
#pragma unroll
  for (int ks = 0; ks < kBlockN / 16; ++ks) {
    uint32_t a[kMTiles][4];
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
      accum_to_a<T>(s[mt][2 * ks], s[mt][2 * ks + 1], a[mt]);
    }
#pragma unroll
    for (int dp = 0; dp < kDTiles / 2; ++dp) {
      uint32_t bv[4];
      ldmatrix_x4_trans(bv, v_s + (16 * ks + lane % 8 + ((lane / 8) % 2) * 8) * kStride + 16 * dp +
                                (lane / 16) * 8);
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
        mma_16x8x16<T>(o[mt][2 * dp], a[mt], bv[0], bv[1]);
        mma_16x8x16<T>(o[mt][2 * dp + 1], a[mt], bv[2], bv[3]);
      }
    }
  }
}

// Epilogue: normalize, write the LSE, stage O through shared memory (the Q tile's, q_s: every
// warp is done with Q after the barrier) for 16-byte stores. Rows [row0, row0 + rows) of the sequence.
template <typename Cfg, typename T>
__device__ __forceinline__ void fwd_epilogue(const FwdKernelParams& p, T* q_s,
                                             const float (&o)[Cfg::kMTiles][Cfg::kHeadDim / 8][4],
                                             const RowState<Cfg::kMTiles>& st, const detail::SeqInfo& seq, int row0,
                                             int rows, int h, int b, int warp_row) {
  constexpr int kHeadDim = Cfg::kHeadDim;
  constexpr int kMTiles = Cfg::kMTiles, kBlockM = Cfg::kBlockM;
  constexpr int kDTiles = kHeadDim / 8;
  constexpr int kStride = Cfg::kRowStride;
  const int lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  __syncthreads();
  float* lse = p.lse ? p.lse + b * p.lse_batch_stride + h * p.lse_head_stride + seq.q_start : nullptr;
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float sum = st.sum[mt][r];
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      const float inv = sum > 0.f ? 1.f / sum : 0.f;
      const int row = warp_row + 16 * mt + g + 8 * r;
#pragma unroll
      for (int dt = 0; dt < kDTiles; ++dt)
        *reinterpret_cast<uint32_t*>(q_s + row * kStride + 8 * dt + 2 * t) =
            ElemTraits<T>::pack(o[mt][dt][2 * r] * inv, o[mt][dt][2 * r + 1] * inv);
      if (lse != nullptr && t == 0 && row < rows)
        lse[row0 + row] = sum > 0.f ? (st.max[mt][r] + log2f(sum)) * static_cast<float>(M_LN2) : INFINITY;
    }
  __syncthreads();
  T* out_g = static_cast<T*>(p.out) + detail::row_offset(p.out_str, b, seq.q_start + row0, h);
  constexpr int kChunksPerRow = kHeadDim / 8;
  for (int c = threadIdx.x; c < kBlockM * kChunksPerRow; c += Cfg::kThreads) {
    const int r = c / kChunksPerRow, col = (c % kChunksPerRow) * 8;
    if (r < rows && col < p.head_dim)
      *reinterpret_cast<uint4*>(out_g + r * p.out_str.row + col) =
          *reinterpret_cast<const uint4*>(q_s + r * kStride + col);
  }
}

// One tile: query rows [m_block * kBlockM, +kBlockM) of head h of sequence b.
template <typename Cfg, typename T>
__device__ __forceinline__ void fwd_tile(const FwdKernelParams& p, FwdSmem<Cfg, T>& sm, int m_block, int h, int b) {
  constexpr int kHeadDim = Cfg::kHeadDim;
  constexpr int kMTiles = Cfg::kMTiles, kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN;
  constexpr int kNTiles = kBlockN / 8, kDTiles = kHeadDim / 8;
  constexpr int kStride = Cfg::kRowStride;

  const detail::SeqInfo seq = detail::seq_info(p, b);
  const int row0 = m_block * kBlockM;
  if (row0 >= seq.seqlen_q) return;
  const int hk = h / p.group;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int rows = min(kBlockM, seq.seqlen_q - row0);

  const T* q_g = static_cast<const T*>(p.q) + detail::row_offset(p.q_str, b, seq.q_start + row0, h);
  const T* k_g = static_cast<const T*>(p.k) + detail::row_offset(p.k_str, b, seq.k_start, hk);
  const T* v_g = static_cast<const T*>(p.v) + detail::row_offset(p.v_str, b, seq.k_start, hk);

  const sched::Band band = detail::band_of(p, seq);
  const sched::BlockRange range = sched::kv_block_range(band, row0, row0 + rows, seq.seqlen_k, kBlockN);

  float o[kMTiles][kDTiles][4];
  RowState<kMTiles> st;
  fwd_init_accumulators<Cfg>(p, h, t, o, st);

  const int warp_row = warp * 16 * kMTiles;  // first row of this warp within the block
  const float score_scale = p.softcap > 0.f ? 1.f : p.scale_log2;  // raw (or capped) score -> log2 units
  auto load_k = [&](int n, int stage) {
    load_tile<kBlockN, kHeadDim, Cfg::kThreads, kStride>(sm.k[stage], k_g + n * kBlockN * p.k_str.row,
                                                         p.k_str.row, seq.seqlen_k - n * kBlockN, p.head_dim);
  };
  auto load_v = [&](int n, int stage) {
    load_tile<kBlockN, kHeadDim, Cfg::kThreads, kStride>(sm.v[stage], v_g + n * kBlockN * p.v_str.row,
                                                         p.v_str.row, seq.seqlen_k - n * kBlockN, p.head_dim);
  };
  auto mask_block = [&](int n) {
    return [&, n](float (&s)[kMTiles][kNTiles][4]) {
      const int col0 = n * kBlockN;
      if (sched::classify_tile(band, row0, row0 + rows, col0, col0 + kBlockN, seq.seqlen_k) != sched::TileKind::kFull)
        mask_band(s, band, row0 + warp_row + g, col0 + 2 * t, seq.seqlen_k);
    };
  };
  if constexpr (Cfg::kStages == 1) {
    // The split pipeline: cp.async groups in the order {Q, K_last}, {V_last}, then per block n
    // {K_n-1} after S_n and {V_n-1} after PV_n; each wait leaves only the newest group in flight.
    if (range.first < range.last) {
      load_tile<kBlockM, kHeadDim, Cfg::kThreads, kStride>(sm.q, q_g, p.q_str.row, rows, p.head_dim);
      load_k(range.last - 1, 0);
      cp_async_commit();
      load_v(range.last - 1, 0);
      cp_async_commit();
    }
    for (int n = range.last - 1; n >= range.first; --n) {
      cp_async_wait<1>();  // K_n (and Q) landed for this thread...
      __syncthreads();     // ...and for all
      fwd_attend_block<Cfg, T>(
          p, sm.q, sm.k[0], sm.v[0], warp_row, lane, score_scale, o, st, mask_block(n),
          [&] {
            __syncthreads();  // every warp's S is done with K_n
            if (n > range.first) load_k(n - 1, 0);
            cp_async_commit();
          },
          [&] {
            cp_async_wait<1>();  // V_n landed (K_n-1 may still fly)
            __syncthreads();
          });
      __syncthreads();  // every warp's PV is done with V_n
      if (n > range.first) load_v(n - 1, 0);
      cp_async_commit();
    }
    fwd_epilogue<Cfg, T>(p, sm.q, o, st, seq, row0, rows, h, b, warp_row);
    return;
  }
  // K/V blocks are loaded kStages - 1 iterations ahead, one cp.async group per block (Q joins
  // the first), so a block's load overlaps the compute of the blocks before it.
  auto load_kv = [&](int n, int stage) {
    load_k(n, stage);
    load_v(n, stage);
  };
  if (range.first < range.last) {
    load_tile<kBlockM, kHeadDim, Cfg::kThreads, kStride>(sm.q, q_g, p.q_str.row, rows, p.head_dim);
    int n_next = range.last - 1;  // the next block to load
    for (int stage = 0; stage < Cfg::kStages - 1; ++stage, --n_next) {
      if (n_next >= range.first) load_kv(n_next, stage);
      cp_async_commit();
    }

    for (int n = range.last - 1, it = 0; n >= range.first; --n, ++it) {
      const int stage = it % Cfg::kStages;
      cp_async_wait<Cfg::kStages - 2>();  // block n (and Q) have landed for this thread...
      __syncthreads();                    // ...and for all; the stage refilled below is free
      if (n_next >= range.first) load_kv(n_next, (it + Cfg::kStages - 1) % Cfg::kStages);
      cp_async_commit();
      --n_next;

      fwd_attend_block<Cfg, T>(p, sm.q, sm.k[stage], sm.v[stage], warp_row, lane, score_scale, o, st,
                               mask_block(n));
    }
  }

  fwd_epilogue<Cfg, T>(p, sm.q, o, st, seq, row0, rows, h, b, warp_row);
}

// The launch mode is a template parameter so that each gets its own register allocation: tile
// coordinates from blockIdx are re-read where needed, from the tile order (kOrdered, kPersistent) they
// are held, and one kernel holding both paths spilled (session 55, d128: 120 bytes on sm_80, against
// 16 for the 3D grid alone and 88 for the ordered grid alone; 0 and 28 on sm_90).
template <typename Cfg, typename T, bool kPersistent, bool kOrdered = false>
__global__ void __launch_bounds__(Cfg::kThreads) portable_fwd_kernel(const FwdKernelParams p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  auto& sm = *reinterpret_cast<FwdSmem<Cfg, T>*>(smem_raw);
  if constexpr (kPersistent) {
    for (int tile = blockIdx.x; tile < p.order.num_tiles; tile += gridDim.x) {
      const sched::TileCoord c = sched::tile_at(p.order, tile);
      fwd_tile<Cfg, T>(p, sm, c.block, c.head, c.batch);
      __syncthreads();  // the epilogue's shared-memory reads end before the next tile's loads
    }
  } else if constexpr (kOrdered) {
    // Banded work (detail::dense_fwd_grid): one CTA per index of the L2-grouped, longest-first order.
    const sched::TileCoord c = sched::tile_at(p.order, blockIdx.x);
    fwd_tile<Cfg, T>(p, sm, c.block, c.head, c.batch);
  } else {
    fwd_tile<Cfg, T>(p, sm, blockIdx.x, blockIdx.y, blockIdx.z);
  }
}

// Raises the kernel's shared-memory limit and asks for the largest carveout, so that as many
// CTAs fit per SM as registers allow. Once per kernel.
template <typename Kernel>
cudaError_t prepare_smem(Kernel kernel, int smem_bytes) {
  cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
  if (e == cudaSuccess)
    e = cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared);
  if (e != cudaSuccess) (void)cudaGetLastError();  // reported through the Status, not left sticky
  return e;
}

// Uniform work (no causal or window mask) runs on a persistent grid over the L2-grouped tile
// order; masked work keeps one CTA per tile, dispatched in that order (detail::dense_fwd_grid), so the
// hardware's block scheduler balances the uneven tiles (measured: persistent static round-robin lost 2-10 % on
// causal runs and won 1-4 % on uniform ones; bench/RESULTS.md). persistent: -1 the rule, 0 one CTA
// per tile, 1 the persistent grid. kWithPersistent = false: one CTA per tile only, and the
// persistent kernel not instantiated (the library's split shapes, which never take it).
template <typename Cfg, typename T, bool kWithPersistent = true>
Status launch_portable_fwd_cfg(const FwdKernelParams& params, Stream stream, int persistent = -1) {
  constexpr int kSmem = fwd_smem_bytes<Cfg, T>();
  auto tiled = portable_fwd_kernel<Cfg, T, false>;
  auto ordered = portable_fwd_kernel<Cfg, T, false, true>;
  static const cudaError_t attr = [&] {
    cudaError_t e = prepare_smem(tiled, kSmem);
    if (e == cudaSuccess) e = prepare_smem(ordered, kSmem);
    if constexpr (kWithPersistent) {
      if (e == cudaSuccess) e = prepare_smem(portable_fwd_kernel<Cfg, T, true>, kSmem);
    }
    return e;
  }();
  if (attr != cudaSuccess) return detail::cuda_status(attr, "portable forward: shared memory attribute");
  if (params.seqlen_q == 0 || params.batch == 0) return Status::Ok();
  if constexpr (kWithPersistent) {
    const bool uniform = !detail::has_band(params);
    auto persistent_kernel = portable_fwd_kernel<Cfg, T, true>;
    // A persistent variant that spills (its loop costs registers; d64 does at 255) is never chosen.
    static const bool persistent_spills = [&] {
      cudaFuncAttributes a{};
      return cudaFuncGetAttributes(&a, persistent_kernel) != cudaSuccess || a.localSizeBytes > 0;
    }();
    if (persistent > 0 || (persistent < 0 && uniform && !persistent_spills)) {
      static int ctas_per_sm = 0;
      if (ctas_per_sm == 0)
        FLARE_CUDA_RETURN(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&ctas_per_sm, persistent_kernel, Cfg::kThreads, kSmem));
      const detail::DeviceFacts dev = detail::current_device_facts();
      FwdKernelParams p = params;
      p.order = sched::make_forward_order(detail::forward_tile_shape(params, Cfg::kBlockM, Cfg::kBlockN, sizeof(T)),
                                          dev.l2_bytes / 2);
      const dim3 grid(std::min(p.order.num_tiles, std::max(1, ctas_per_sm) * dev.num_sms));
      persistent_kernel<<<grid, Cfg::kThreads, kSmem, stream>>>(p);
      return detail::cuda_status(cudaGetLastError(), "portable forward launch");
    }
  }
  FwdKernelParams p = params;
  const detail::GridDims g =
      detail::dense_fwd_grid(p, Cfg::kBlockM, Cfg::kBlockN, sizeof(T), detail::current_device_facts().l2_bytes / 2);
  if (p.order.num_tiles > 0)
    ordered<<<dim3(g.x, g.y, g.z), Cfg::kThreads, kSmem, stream>>>(p);
  else
    tiled<<<dim3(g.x, g.y, g.z), Cfg::kThreads, kSmem, stream>>>(p);
  return detail::cuda_status(cudaGetLastError(), "portable forward launch");
}

template <int kHeadDim, typename T>
Status launch_portable_fwd(const FwdKernelParams& p, Stream stream) {
  using Cfg = typename FwdConfigFor<kHeadDim>::type;
  return launch_portable_fwd_cfg<Cfg, T, fwd_persistent_when_uniform<Cfg>()>(p, stream);
}

}  // namespace flare::portable
