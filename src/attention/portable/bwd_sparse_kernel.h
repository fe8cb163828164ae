// Portable block-sparse attention backward (sm_80+): the dense backward's step functions
// (bwd_kernel.h: query block loads, S^T and dP^T, P^T and dS^T, dK/dV accumulation, the dQ product
// and reduction, the dK/dV epilogue) walking a block mask's TRANSPOSED lists instead of a band.
//
// A CTA owns kBlockN keys inside one mask kv block (a kv block of kv_block_size keys is
// ceil(kv_block_size / kBlockN) CTAs; a smaller one leaves the CTA's extra key rows zero). It
// walks the kv block's PARTIAL q blocks, applying the element predicate, then its FULL ones,
// without it; each mask q block is ceil(q_block_size / kBlockM) query tiles. Rows past a q
// block's end (or seqlen_q) and keys past the kv block's end (or seqlen_k) are masked, and a
// dense mask (params.mask) given with the block mask is applied on top, as the oracle composes
// them. dQ is added with atomics (red.global).
//
// Deterministic mode (kDet): the grid is 1D in the plan's schedule (dq_write_order.h), CTA x the
// key slice x % tiles_per_kv_block of the tile at position x / tiles_per_kv_block; the tile walks
// its q blocks in the planned order. The dQ of a q block's query tiles is staged in shared memory
// (DqStage: up to 4 tiles, a group) and a group's adds are made when its semaphore, one per (b, h,
// mask q block m, group), shows the turn dq_turn(step) * tiles_per_kv_block + slice, so the adds
// land in schedule order. A turn per query tile cost 0.75-0.86 of the ordinary backward: each
// one is an acquire poll and a release that waits for the CTA's reductions, with every warp
// waiting at the barriers around them; a turn per group of 4 measured 0.82-0.95. (Handing the
// turn on after the next tile's dQ product measured slower than per tile.) GQA's dK/dV adds take
// the turn dkv_turn(tile) per (batch, kv head, kv block, slice). A slice without keys (past
// seqlen_k) computes nothing and still takes every turn. Turns follow grid order, so a CTA only
// waits for CTAs launched before it.
#pragma once

#include "src/attention/portable/bwd_kernel.h"
#include "src/attention/portable/sparse_block_walk.h"
#include "src/block_sparse/block_sparse_params.h"
#include "src/block_sparse/dq_write_order.h"

namespace flare::portable {

// Sets the probabilities of the elements `visible(query, key)` rejects to 0. Element e of tile
// j: query row0 + 8j + 2t + e % 2 (row0: the query tile's first row), key key0 + g + 8 * (e / 2)
// (key0: the warp's first key).
template <int kQTiles, typename Visible>
__device__ __forceinline__ void mask_probs(float (&s)[kQTiles][4], int row0, int key0, int g, int t,
                                           Visible&& visible) {
#pragma unroll
  for (int j = 0; j < kQTiles; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int qi = row0 + 8 * j + 2 * t + (e % 2), key = key0 + g + 8 * (e / 2);
      s[j][e] = visible(qi, key) ? s[j][e] : 0.f;
    }
}

// Deterministic mode: the dQ of up to kTiles consecutive query tiles of a q block is staged in
// shared memory (fp32, rows padded by 8 floats) and added under one turn, so a CTA takes one turn
// (an acquire poll, and a release that waits for its reductions) per group instead of per query
// tile. As many tiles as fit beside the kernel's own shared memory, at most 4.
template <typename Cfg, typename T>
struct DqStage {
  static constexpr int kStride = Cfg::kHeadDim + 8;
  static constexpr int kTileBytes = Cfg::kBlockM * kStride * static_cast<int>(sizeof(float));
  static constexpr int kBase = (bwd_smem_bytes<Cfg, T>() + 15) / 16 * 16;
  static constexpr int kFit = (227 * 1024 - kBase) / kTileBytes;
  static constexpr int kTiles = kFit < 4 ? kFit : 4;
  static_assert(kTiles >= 1, "one staged dQ tile fits");
  static constexpr int kBytes = kBase + kTiles * kTileBytes;  // the deterministic kernel's shared memory
};

// Stages this warp's part of a query tile's dQ (scaled) in `stage` (kStride floats per row).
template <typename Cfg, typename T>
__device__ __forceinline__ void stage_dq(float* stage, DqPart<Cfg> part, int lane, float scale,
                                         const float (&dq)[Cfg::kDqCols / 8][4]) {
  const int g = lane / 4, t = lane % 4;
#pragma unroll
  for (int c = 0; c < Cfg::kDqCols / 8; ++c)
#pragma unroll
    for (int r = 0; r < 2; ++r)
      *reinterpret_cast<float2*>(stage + (part.row + g + 8 * r) * DqStage<Cfg, T>::kStride + part.col + 8 * c + 2 * t) =
          make_float2(dq[c][2 * r] * scale, dq[c][2 * r + 1] * scale);
}

// Adds the staged rows [0, rows) (query rows row0 ..., row0 a multiple of 8) into the fp32
// accumulator, a warp an 8 x 8 block of it in turn (its 32 column pairs: one contiguous 256-byte
// span of the blocked accumulator, detail::portable_dq_offset).
template <typename Cfg, typename T>
__device__ __forceinline__ void add_staged_dq(const BwdKernelParams& P, const detail::SeqInfo& seq, int b, int h,
                                              int row0, int rows, const float* stage) {
  const detail::FwdKernelParams& p = P.fwd;
  const int col_groups = p.head_dim / 8;
  float* const acc = P.dq_accum + detail::portable_dq_offset(detail::portable_dq_row(p, b, seq.q_start, row0), h, 0,
                                                              p.heads, p.head_dim);
  const int64_t group_pitch = int64_t{p.heads} * p.head_dim * 8;  // the next 8 rows
  for (int e = threadIdx.x; e < (rows + 7) / 8 * col_groups * 32; e += Cfg::kThreads) {
    const int block = e / 32, in = e % 32;  // block (row group, column group); in it row in / 4, pair in % 4
    const int rg = block / col_groups, cg = block - rg * col_groups;
    const int r = 8 * rg + in / 4, col = 8 * cg + 2 * (in % 4);
    if (r >= rows) continue;
    const float2 v = *reinterpret_cast<const float2*>(stage + r * DqStage<Cfg, T>::kStride + col);
    red_add_f32x2(acc + rg * group_pitch + 64 * cg + 2 * in, v.x, v.y);
  }
}

template <typename Cfg, typename T, bool kDet>
__global__ void __launch_bounds__(Cfg::kThreads)
    portable_bwd_sparse_kernel(const BwdKernelParams P, const block_sparse::BlockSparseParams bs,
                               const block_sparse::DqPlanView plan) {
  constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN;
  constexpr int kQTiles = kBlockM / 8;
  constexpr int kDkvTiles = Cfg::kDkvCols / 8;
  constexpr int kDqTiles = Cfg::kDqCols / 8;
  const detail::FwdKernelParams& p = P.fwd;

  const int tiles_per_kv_block = (bs.kv_block_size + kBlockN - 1) / kBlockN;
  const int slice = blockIdx.x % tiles_per_kv_block;
  int b, h, n;  // n: the mask's kv block
  block_sparse::DqTile tile;
  if constexpr (kDet) {
    tile = plan.tile_at(blockIdx.x / tiles_per_kv_block);
    b = tile.batch, h = tile.head, n = tile.kv_block;
  } else {
    h = blockIdx.y, b = blockIdx.z, n = blockIdx.x / tiles_per_kv_block;
  }
  const detail::SeqInfo seq = detail::seq_info(p, b);
  const int col0 = n * bs.kv_block_size + slice * kBlockN;              // first key of this CTA
  const int col_end = min((n + 1) * bs.kv_block_size, seq.seqlen_k);  // the kv block's end
  const int hk = h / p.group;
  const int tiles_per_q_block = (bs.q_block_size + kBlockM - 1) / kBlockM;
  // Deterministic: the walk's first step in the plan, and the semaphores: a q block's query tiles
  // in groups of DqStage::kTiles, a semaphore per group.
  const int step0 = kDet ? plan.walk_begin(tile) : 0;
  constexpr int kStageTiles = DqStage<Cfg, T>::kTiles;
  const int groups_per_q_block = (tiles_per_q_block + kStageTiles - 1) / kStageTiles;
  auto dq_semaphore = [&](const SparseTileCursor& c) {
    return P.dq_semaphore + plan.dq_tile_semaphore(b, h, c.block, c.sub / kStageTiles, groups_per_q_block);
  };
  // Whether the tile at `c` ends its group (`after`: the walk's next tile).
  auto ends_group = [&](const SparseTileCursor& c, const SparseTileCursor& after) {
    return after.block < 0 || after.pos != c.pos || after.sub % kStageTiles == 0;
  };
  int* dkv_sem = (kDet && p.group > 1) ? P.dkv_semaphore + plan.dkv_slice_semaphore(b, hk, n, slice, tiles_per_kv_block)
                                       : nullptr;
  // The tile's q blocks: the plan's walk (deterministic) or the mask's transposed lists.
  auto walk_of_tile = [&] {
    if constexpr (kDet)
      return SparseBlockWalk::planned(plan.data + plan.layout.walk_q_blocks + step0,
                                      plan.data + plan.layout.walk_is_full + step0, plan.walk_end(tile) - step0,
                                      bs.q_block_size, bs.num_q_blocks, seq.seqlen_q);
    else
      return SparseBlockWalk::of(bs.partial_q, bs.full_q, b, h, n, bs.q_block_size, bs.num_q_blocks, seq.seqlen_q);
  };
  if (col0 >= col_end) {
    if constexpr (kDet) {  // no keys: take every turn anyway
      const SparseBlockWalk walk = walk_of_tile();
      for (SparseTileCursor c = walk.begin(); c.block >= 0;) {
        SparseTileCursor after = c;
        walk.advance<kBlockM>(after);
        if (ends_group(c, after)) {
          int* sem = dq_semaphore(c);
          wait_turn(sem, plan.dq_slice_turn(step0 + c.pos, slice, tiles_per_kv_block));
          pass_turn(sem);
        }
        c = after;
      }
      if (dkv_sem) {
        wait_turn(dkv_sem, plan.dkv_turn(tile));
        pass_turn(dkv_sem);
      }
    }
    return;
  }
  const int keys = min(kBlockN, col_end - col0);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int row_group = warp / Cfg::kColSplit, part = warp % Cfg::kColSplit;
  const int kv_row = 16 * row_group;
  const int dkv_col = part * Cfg::kDkvCols;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  auto& sm = *reinterpret_cast<BwdSmem<Cfg, T>*>(smem_raw);

  const BwdQuerySide<T> qs = BwdQuerySide<T>::of(P, seq, b, h);

  const SparseBlockWalk walk = walk_of_tile();
  const sched::Band band = detail::band_of(p, seq);  // a dense mask given with the block mask
  const block_sparse::ElementMaskParams& el = bs.element;

  // A query tile: kBlockM rows from walk.tile_start, of which those before the q block's end are
  // loaded.
  auto load_q_tile = [&](const SparseTileCursor& c, int stage) {
    const int row0 = walk.tile_start<kBlockM>(c);
    bwd_load_q_block<Cfg, T>(sm, stage, P, qs, row0, min(row0 + kBlockM, walk.block_end(c.block)));
  };

  float dk[kDkvTiles][4], dv[kDkvTiles][4];
#pragma unroll
  for (int c = 0; c < kDkvTiles; ++c)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[c][e] = dv[c][e] = 0.f;

  SparseTileCursor cur = walk.begin();
  SparseTileCursor next = cur;  // the next tile to load
  if (cur.block >= 0) {
    bwd_load_kv_block<Cfg, T>(sm, P, seq, b, hk, col0, keys);
    load_q_tile(next, 0);
    cp_async_commit();
    walk.advance<kBlockM>(next);
  }

  for (int it = 0; cur.block >= 0; ++it) {
    const int stage = it & 1;
    cp_async_wait<0>();
    __syncthreads();  // tile `cur` landed; the previous tile's readers of ds and the other stage are done
    if (next.block >= 0) load_q_tile(next, stage ^ 1);
    cp_async_commit();
    const T* sq = sm.q[stage];
    const T* sdo = sm.dout[stage];
    const int row0 = walk.tile_start<kBlockM>(cur);
    const int row_end = min(row0 + kBlockM, walk.block_end(cur.block));

    float s[kQTiles][4], dp[kQTiles][4];
    bwd_scores<Cfg, T>(sm.k, sm.v, sq, sdo, kv_row, lane, s, dp);

    const bool partial_block = walk.in_partial(cur);
    // A full block's tile needs no mask unless it crosses the blocks' ends or the dense band.
    const bool tile_full = !partial_block && row0 + kBlockM <= row_end && col0 + kBlockN <= col_end &&
                           sched::classify_tile(band, row0, row_end, col0, col0 + kBlockN, col_end) ==
                               sched::TileKind::kFull;
    const QueryStats stats{sm.lse[stage], sm.dpsum[stage], t};
    auto mask = [&](float (&s)[kQTiles][4]) {
      if (tile_full) return;
      if (!partial_block) {
        mask_probs(s, row0, col0 + kv_row, g, t, [&](int qi, int key) {
          return qi < row_end && key < col_end && band.visible(qi, key);
        });
        return;
      }
      // Partial: the element predicate too (the structural interval, then the lookups).
      mask_probs(s, row0, col0 + kv_row, g, t, [&](int qi, int key) {
        return qi < row_end && key < col_end && band.visible(qi, key) && el.visible(b, h, qi, key);
      });
    };
    if (p.softcap > 0.f) probs_and_grads<true, kQTiles>(p, stats, s, dp, mask);
    else probs_and_grads<false, kQTiles>(p, stats, s, dp, mask);

    bwd_accumulate_dkv<Cfg, T>(s, dp, sq, sdo, sm.ds, kv_row, dkv_col, part, lane, dk, dv);
    __syncthreads();

    const DqPart<Cfg> dq_part(warp);
    float dq[kDqTiles][4];
    bwd_dq_product<Cfg, T>(sm.ds, sm.k, dq_part, lane, dq);
    if constexpr (kDet) {  // staged; the group's adds under one turn
      float* stage = reinterpret_cast<float*>(smem_raw + DqStage<Cfg, T>::kBase);
      const int in_group = cur.sub % kStageTiles;
      stage_dq<Cfg, T>(stage + in_group * kBlockM * DqStage<Cfg, T>::kStride, dq_part, lane, p.scale, dq);
      if (ends_group(cur, next)) {
        int* sem = dq_semaphore(cur);
        wait_turn(sem, plan.dq_slice_turn(step0 + cur.pos, slice, tiles_per_kv_block));  // (every part staged)
        const int group_row0 = row0 - in_group * kBlockM;
        add_staged_dq<Cfg, T>(P, seq, b, h, group_row0, row_end - group_row0, stage);
        pass_turn(sem);
      }
    } else {
      bwd_add_dq<Cfg>(P, seq, b, h, row0, row_end, dq_part, lane, dq);
    }

    cur = next;
    if (next.block >= 0) walk.advance<kBlockM>(next);
  }

  if (dkv_sem) wait_turn(dkv_sem, plan.dkv_turn(tile));
  bwd_store_dkv<Cfg, T, false>(P, seq, b, hk, col0, keys, kv_row, dkv_col, lane, dk, dv);
  if (dkv_sem) pass_turn(dkv_sem);
}

// dpsum, then one CTA per (kernel key tile, head, batch) (the hardware's block scheduler balances
// the uneven lists; deterministic: a 1D grid in the plan's schedule, which `plan` is), then dsinks
// and the conversions.
template <typename Cfg, typename T>
Status launch_portable_bwd_sparse_cfg(const BwdKernelParams& P, const block_sparse::BlockSparseParams& bs,
                                      const block_sparse::DqPlanView* plan, Stream stream) {
  const detail::FwdKernelParams& p = P.fwd;
  constexpr int kSmem = bwd_smem_bytes<Cfg, T>(), kDetSmem = DqStage<Cfg, T>::kBytes;
  auto kernel = portable_bwd_sparse_kernel<Cfg, T, false>;
  auto det_kernel = portable_bwd_sparse_kernel<Cfg, T, true>;
  static const cudaError_t attr = prepare_smem(kernel, kSmem);
  static const cudaError_t det_attr = prepare_smem(det_kernel, kDetSmem);
  if (attr != cudaSuccess || det_attr != cudaSuccess)
    return detail::cuda_status(attr != cudaSuccess ? attr : det_attr,
                               "portable block-sparse backward: shared memory attribute");
  if (p.batch == 0 || p.heads == 0) return Status::Ok();
  launch_bwd_dpsum<T>(P, stream);
  if (p.seqlen_k > 0 && bs.num_kv_blocks > 0) {
    const int tiles_per_kv_block = (bs.kv_block_size + Cfg::kBlockN - 1) / Cfg::kBlockN;
    if (plan != nullptr) {
      det_kernel<<<plan->num_tiles() * tiles_per_kv_block, Cfg::kThreads, kDetSmem, stream>>>(P, bs, *plan);
    } else {
      const dim3 grid(bs.num_kv_blocks * tiles_per_kv_block, p.heads, p.batch);
      kernel<<<grid, Cfg::kThreads, kSmem, stream>>>(P, bs, block_sparse::DqPlanView{});
    }
  }
  FLARE_RETURN_IF_ERROR(launch_bwd_finish<T>(P, stream));
  return detail::cuda_status(cudaGetLastError(), "portable block-sparse backward launch");
}

// `plan`: the deterministic mode's plan (its data on the device), null for the ordinary mode.
template <int kHeadDim, typename T>
Status launch_portable_bwd_sparse(const BwdKernelParams& p, const block_sparse::BlockSparseParams& bs,
                                  const block_sparse::DqPlanView* plan, Stream stream) {
  return launch_portable_bwd_sparse_cfg<typename BwdConfigFor<kHeadDim>::type, T>(p, bs, plan, stream);
}

}  // namespace flare::portable
