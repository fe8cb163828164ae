// Portable block-sparse attention forward (sm_80+): the dense kernel's tile code (fwd_kernel.h:
// accumulators, one KV block's S = Q K^T / mask / online softmax / O += P V, epilogue) walking a
// block mask's lists instead of a band.
//
// A CTA owns kBlockM query rows inside one mask q block (a q block of q_block_size rows is
// ceil(q_block_size / kBlockM) CTAs; a smaller one leaves the CTA's extra rows idle). It walks
// the q block's PARTIAL kv blocks, applying the element predicate, then its FULL ones, without
// a mask; each mask kv block is ceil(kv_block_size / kBlockN) kernel tiles. The columns past a
// block's end (or seqlen_k) in its last tile are masked, and a dense mask (params.mask) given
// with the block mask is applied on top, as the oracle composes them.
#pragma once

#include "src/attention/portable/fwd_kernel.h"
#include "src/attention/portable/sparse_block_walk.h"
#include "src/block_sparse/block_sparse_params.h"

namespace flare::portable {

template <typename Cfg, typename T>
__device__ __forceinline__ void fwd_sparse_tile(const FwdKernelParams& p, const block_sparse::BlockSparseParams& bs,
                                                FwdSmem<Cfg, T>& sm, int q_tile, int h, int b) {
  static_assert(Cfg::kStages >= 2, "the sparse walk prefetches whole K/V tiles (no split pipeline)");
  constexpr int kHeadDim = Cfg::kHeadDim;
  constexpr int kMTiles = Cfg::kMTiles, kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN;
  constexpr int kNTiles = kBlockN / 8, kDTiles = kHeadDim / 8;
  constexpr int kStride = Cfg::kRowStride;

  const detail::SeqInfo seq = detail::seq_info(p, b);
  const int tiles_per_q_block = (bs.q_block_size + kBlockM - 1) / kBlockM;
  const int m = q_tile / tiles_per_q_block;
  const int row0 = m * bs.q_block_size + (q_tile % tiles_per_q_block) * kBlockM;
  const int row_end = min(min(row0 + kBlockM, (m + 1) * bs.q_block_size), seq.seqlen_q);
  if (row0 >= row_end) return;
  const int rows = row_end - row0;
  const int hk = h / p.group;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;

  const T* q_g = static_cast<const T*>(p.q) + detail::row_offset(p.q_str, b, seq.q_start + row0, h);
  const T* k_g = static_cast<const T*>(p.k) + detail::row_offset(p.k_str, b, seq.k_start, hk);
  const T* v_g = static_cast<const T*>(p.v) + detail::row_offset(p.v_str, b, seq.k_start, hk);

  const SparseBlockWalk walk = SparseBlockWalk::of(bs.partial_kv, bs.full_kv, b, h, m, bs.kv_block_size,
                                                   bs.num_kv_blocks, seq.seqlen_k);

  const sched::Band band = detail::band_of(p, seq);  // a dense mask given with the block mask
  const block_sparse::ElementMaskParams& el = bs.element;

  float o[kMTiles][kDTiles][4];
  RowState<kMTiles> st;
  fwd_init_accumulators<Cfg>(p, h, t, o, st);

  const int warp_row = warp * 16 * kMTiles;
  const float score_scale = p.softcap > 0.f ? 1.f : p.scale_log2;
  // A kernel tile: kBlockN keys from `col`, of which those before `col_end` (the block's end)
  // are loaded; the rest are zero-filled and masked.
  auto load_kv = [&](const SparseTileCursor& c, int stage) {
    const int col = walk.tile_start<kBlockN>(c);
    const int valid_rows = walk.block_end(c.block) - col;
    load_tile<kBlockN, kHeadDim, Cfg::kThreads, kStride>(sm.k[stage], k_g + col * p.k_str.row, p.k_str.row,
                                                         valid_rows, p.head_dim);
    load_tile<kBlockN, kHeadDim, Cfg::kThreads, kStride>(sm.v[stage], v_g + col * p.v_str.row, p.v_str.row,
                                                         valid_rows, p.head_dim);
  };

  SparseTileCursor cur = walk.begin();
  if (cur.block >= 0) {
    load_tile<kBlockM, kHeadDim, Cfg::kThreads, kStride>(sm.q, q_g, p.q_str.row, rows, p.head_dim);
    SparseTileCursor next = cur;  // the next tile to load
    for (int stage = 0; stage < Cfg::kStages - 1; ++stage) {
      if (next.block >= 0) {
        load_kv(next, stage);
        walk.advance<kBlockN>(next);
      }
      cp_async_commit();
    }

    for (int it = 0; cur.block >= 0; ++it, walk.advance<kBlockN>(cur)) {
      const int stage = it % Cfg::kStages;
      cp_async_wait<Cfg::kStages - 2>();
      __syncthreads();
      if (next.block >= 0) {
        load_kv(next, (it + Cfg::kStages - 1) % Cfg::kStages);
        walk.advance<kBlockN>(next);
      }
      cp_async_commit();

      const int col0 = walk.tile_start<kBlockN>(cur);
      const int col_end = walk.block_end(cur.block);
      const bool partial = walk.in_partial(cur);
      fwd_attend_block<Cfg, T>(p, sm.q, sm.k[stage], sm.v[stage], warp_row, lane, score_scale, o, st,
                               [&](float (&s)[kMTiles][kNTiles][4]) {
        // A full block's tile needs no mask unless it crosses the block's end or the dense band.
        const bool band_full =
            sched::classify_tile(band, row0, row_end, col0, col0 + kBlockN, col_end) == sched::TileKind::kFull;
        if (!partial && band_full) return;
        if (!partial) {
          mask_band(s, band, row0 + warp_row + g, col0 + 2 * t, col_end);
          return;
        }
        // Partial: the element predicate too. Per row once: its structural interval, its
        // document and its bit words; per element the lookups.
        block_sparse::ColumnInterval interval[kMTiles][2];
        int32_t row_doc[kMTiles][2];
        const uint32_t* row_bits[kMTiles][2];
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            // Idle rows (past the q block or the sequence) read row row0 instead: their scores
            // are never written out.
            int i = row0 + warp_row + 16 * mt + g + 8 * r;
            if (i >= row_end) i = row0;
            interval[mt][r] = el.row_interval(i);
            row_doc[mt][r] = el.doc_q ? el.doc_of_row(b, i) : 0;
            row_bits[mt][r] = el.bits ? el.bits_row_ptr(b, h, i) : nullptr;
          }
        const bool lookups = el.has_lookups();
        mask_scores(s, row0 + warp_row + g, col0 + 2 * t, [&](int mt, int r, int i, int j) {
          bool visible = j < col_end && band.visible(i, j) && interval[mt][r].contains(j);
          if (lookups && visible) visible = el.lookups_visible(b, row_doc[mt][r], row_bits[mt][r], j);
          return visible;
        });
      });
    }
  }

  fwd_epilogue<Cfg, T>(p, sm.q, o, st, seq, row0, rows, h, b, warp_row);
}

template <typename Cfg, typename T>
__global__ void __launch_bounds__(Cfg::kThreads)
    portable_fwd_sparse_kernel(const FwdKernelParams p, const block_sparse::BlockSparseParams bs) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  auto& sm = *reinterpret_cast<FwdSmem<Cfg, T>*>(smem_raw);
  fwd_sparse_tile<Cfg, T>(p, bs, sm, blockIdx.x, blockIdx.y, blockIdx.z);
}

// One CTA per (kernel q tile, head, batch); the hardware's block scheduler balances the uneven
// lists (a persistent schedule ordered by list length is future work).
template <typename Cfg, typename T>
Status launch_portable_fwd_sparse_cfg(const FwdKernelParams& params, const block_sparse::BlockSparseParams& bs,
                                      Stream stream) {
  constexpr int kSmem = fwd_smem_bytes<Cfg, T>();
  auto kernel = portable_fwd_sparse_kernel<Cfg, T>;
  static const cudaError_t attr = prepare_smem(kernel, kSmem);
  if (attr != cudaSuccess) return detail::cuda_status(attr, "portable block-sparse forward: shared memory attribute");
  if (params.seqlen_q == 0 || params.batch == 0) return Status::Ok();
  const int tiles_per_q_block = (bs.q_block_size + Cfg::kBlockM - 1) / Cfg::kBlockM;
  const dim3 grid(bs.num_q_blocks * tiles_per_q_block, params.heads, params.batch);
  kernel<<<grid, Cfg::kThreads, kSmem, stream>>>(params, bs);
  return detail::cuda_status(cudaGetLastError(), "portable block-sparse forward launch");
}

template <int kHeadDim, typename T>
Status launch_portable_fwd_sparse(const FwdKernelParams& p, const block_sparse::BlockSparseParams& bs,
                                  Stream stream) {
  return launch_portable_fwd_sparse_cfg<typename FwdSparseConfigFor<kHeadDim>::type, T>(p, bs, stream);
}

}  // namespace flare::portable
