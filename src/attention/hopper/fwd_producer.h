// The Hopper forward's producer warpgroup (fwd_kernel.h): one thread issues the TMA loads of a
// tile's Q and of its key tiles' K and V in the order the consumers read them; in the persistent
// block-sparse grid it also claims the tiles, and a warp writes their list rows.
#pragma once

#include <cuda_runtime.h>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "src/attention/hopper/fwd_tile.h"
#include "src/attention/hopper/sparse_tile_list.h"

namespace flare::hopper {

// The producer thread's Q load of the tile. q_stage_free: the caller has already waited for Q's
// stage to be empty (the persistent grid).
template <typename Cfg, typename T, typename Walk, typename Smem>
__device__ __forceinline__ void produce_q(const HopperFwdParams<Cfg, T>& hp, Smem& sm, const FwdTile<Walk>& t,
                                          PipePos& pos, bool q_stage_free) {
  using namespace cute;
  using L = FwdLayouts<Cfg, T>;
  const bool varlen = hp.p.cu_seqlens_q != nullptr;
  // From the tile's first row, which may lie before the sequence (zeros out of the tensor's bounds).
  Tensor mQ = domain_offset(make_coord(int32_t(t.seq.q_start + t.row0), _0{}),
                            hp.tma_q.get_tma_tensor(hp.shape_q)(_, _, t.h, varlen ? 0 : t.b));
  Tensor gQ = local_tile(mQ, Shape<typename L::BM, typename L::HD>{}, make_coord(_0{}, _0{}));
  Tensor sQ = make_tensor(make_smem_ptr(sm.q.data() + pos.q.index * sm.kQElems), typename L::SmemQ{});
  auto q_part = hp.tma_q.get_slice(_0{});
  if (!q_stage_free) cutlass::arch::ClusterBarrier::wait(&sm.q_ring.empty[pos.q.index], pos.q.phase ^ 1u);
  cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&sm.q_ring.full[pos.q.index], L::kQBytes);
  copy(hp.tma_q.with(sm.q_ring.full[pos.q.index]), q_part.partition_S(gQ), q_part.partition_D(sQ));
  pos.q.template advance<Smem::kQStages>();
  timeline_mark(timeline_of(hp), t.id, kMarkQIssued);
}

// The producer thread's loads of the tile's key tiles: K_n and V_{n+1} in the order the consumers
// read them. A block mask's walk comes from `walk_of` (it waits for the list row), after the K of
// `early_first` where that is >= 0: the walk's first tile, known before the list (first_sparse_tile).
template <typename Cfg, typename T, typename Walk, typename Smem, typename WalkOf>
__device__ __forceinline__ void produce_kv(const HopperFwdParams<Cfg, T>& hp, Smem& sm, FwdTile<Walk>& t, PipePos& pos,
                                           int early_first, WalkOf&& walk_of) {
  using namespace cute;
  using L = FwdLayouts<Cfg, T>;
  const detail::FwdKernelParams& p = hp.p;
  const bool varlen = p.cu_seqlens_q != nullptr;
  const int hk = t.h / p.group, bt = varlen ? 0 : t.b;
  Tensor mK = domain_offset(make_coord(int32_t(t.seq.k_start), _0{}), hp.tma_k.get_tma_tensor(hp.shape_k)(_, _, hk, bt));
  Tensor mV = domain_offset(make_coord(int32_t(t.seq.k_start), _0{}), hp.tma_v.get_tma_tensor(hp.shape_k)(_, _, hk, bt));
  Tensor gK = local_tile(mK, Shape<typename L::BN, typename L::HD>{}, make_coord(_, _0{}));  // (BN, HD, n)
  Tensor gV = local_tile(mV, Shape<typename L::BN, typename L::HD>{}, make_coord(_, _0{}));
  Tensor sK = make_tensor(make_smem_ptr(sm.k.data()), typename L::SmemKV{});
  Tensor sV = make_tensor(make_smem_ptr(sm.v.data()), typename L::SmemKV{});
  auto k_part = hp.tma_k.get_slice(_0{});
  auto v_part = hp.tma_v.get_slice(_0{});
  Tensor k_src = k_part.partition_S(gK);  // (TMA, .., n)
  Tensor k_dst = k_part.partition_D(sK);  // (TMA, .., stage)
  Tensor v_src = v_part.partition_S(gV);
  Tensor v_dst = v_part.partition_D(sV);
  unsigned long long* tl = timeline_of(hp);

  RingPos& kpos = pos.k;
  RingPos& vpos = pos.v;
  auto load_k = [&](int n) {
    uint64_t& bar = sm.k_ring.acquire(kpos, L::kKVBytes);
    copy(hp.tma_k.with(bar), k_src(_, _, _, n), k_dst(_, _, _, kpos.index));
    kpos.template advance<Cfg::kStages>();
  };
  auto load_v = [&](int n) {
    uint64_t& bar = sm.v_ring.acquire(vpos, L::kKVBytes);
    copy(hp.tma_v.with(bar), v_src(_, _, _, n), v_dst(_, _, _, vpos.index));
    vpos.template advance<Cfg::kStages>();
  };
  if (early_first >= 0) {
    load_k(early_first);
    timeline_mark(tl, t.id, kMarkKIssued);
  }
  t.kv = walk_of();
  typename Walk::Cursor c = t.kv.begin();
  if (!t.kv.more(c)) return;  // a block mask's empty row: Q alone (the consumers wait for it)
  int prev = t.kv.tile(c);  // == early_first where that was given
  if (early_first < 0) {
    load_k(prev);
    timeline_mark(tl, t.id, kMarkKIssued);
  }
  for (t.kv.advance(c); t.kv.more(c); t.kv.advance(c)) {
    const int n = t.kv.tile(c);
    load_k(n);
    load_v(prev);
    prev = n;
  }
  load_v(prev);
}

// The producer thread: Q once, then the walk's K and V.
template <typename Cfg, typename T, typename Walk, typename Smem>
__device__ __forceinline__ void produce(const HopperFwdParams<Cfg, T>& hp, Smem& sm, FwdTile<Walk> t,
                                        PipePos& pos, bool q_stage_free = false) {
  produce_q<Cfg, T>(hp, sm, t, pos, q_stage_free);
  const Walk walk = t.kv;
  produce_kv<Cfg, T>(hp, sm, t, pos, -1, [&] { return walk; });
}

// The persistent block-sparse grid's list writer: warp 1 of the producer warpgroup. It writes the
// list row of each tile the producer announces into the tile's Q stage's buffer (the producer
// announces a tile once the stage is free: the consumers are done with the tile two before, whose
// list the buffer held, and so is the producer).
template <typename Cfg, typename T, typename Smem>
__device__ __forceinline__ void sparse_list_writer(const HopperFwdParams<Cfg, T>& hp, Smem& sm, int lane) {
  using Walk = SparseKvWalkOf<typename Smem::List>;
  RingPos q;
  for (;;) {
    cutlass::arch::ClusterBarrier::wait(&sm.announce[q.index], q.phase);
    const int4 a = sm.announced[q.index];
    if (a.x < 0) return;
    const FwdTile<Walk> t = ordered_sparse_tile<Cfg, Walk>(hp, a.y);
    fill_sparse_tile_list<Cfg::kBlockN>(sm.lists[q.index], hp.bs, t.b, t.h, t.row0 / hp.bs.q_block_size,
                                        t.seq.seqlen_k, lane, hp.doc_spans, t.row0, t.seq.seqlen_q);
    q.template advance<Smem::kQStages>();
  }
}

// The persistent block-sparse grid's producer thread. Once it has issued a tile's loads it claims
// the CTA's next tile in the sorted order (hp.sparse_order: blockIdx.x first, then from the
// counter), waits for a Q stage to be free, announces the tile to the list writer ({order index,
// encoded tile, first key tile}) and to the consumers (who read it once its Q has landed), and
// issues its Q, its first K
// and, once the list is written, the walk's K and V; an empty stage (tile -1) ends the consumers and
// the writer. Claimed a tile earlier (by the writer, as soon as a Q stage was free), long tiles went
// to CTAs that stayed busy longer than others: causal 1.012-1.017 and documents 1.007-1.018 of one
// CTA per tile's time, against 0.992 and 0.995 with the claim here (bench/RESULTS.md, session 47).
template <typename Cfg, typename T, typename Smem>
__device__ __forceinline__ void produce_sparse_persistent(const HopperFwdParams<Cfg, T>& hp, Smem& sm) {
  using Walk = SparseKvWalkOf<typename Smem::List>;
  const detail::FwdKernelParams& p = hp.p;
  const int num_tiles = (p.seqlen_q + Cfg::kBlockM - 1) / Cfg::kBlockM * p.heads * p.batch;
  unsigned long long* tl = timeline_of(hp);
  PipePos pos;
  int i = blockIdx.x;
  for (bool first = true;; first = false) {
    const int s = pos.q.index;
    const uint32_t phase = pos.q.phase;
    if (!first) i = static_cast<int>(gridDim.x) + atomicAdd(hp.next_tile, 1);
    const int2 record = i < num_tiles ? hp.sparse_order[i] : make_int2(-1, -1);
    cutlass::arch::ClusterBarrier::wait(&sm.q_ring.empty[s], phase ^ 1u);
    sm.announced[s] = i < num_tiles ? make_int4(i, record.x, record.y, 0) : make_int4(-1, -1, -1, 0);
    cutlass::arch::ClusterBarrier::arrive(&sm.announce[s]);
    if (i >= num_tiles) {  // the consumers' signal to stop: the stage full without a Q
      cutlass::arch::ClusterBarrier::arrive(&sm.q_ring.full[s]);
      return;
    }
    FwdTile<Walk> tile = ordered_sparse_tile<Cfg, Walk>(hp, record.x);
    tile.id = i;
    timeline_mark(tl, tile.id, kMarkStart);
    timeline_mark_global(tl, tile.id, kMarkGlobalStart);
    timeline_set(tl, tile.id, kMarkSm, sm_id());
    produce_q<Cfg, T>(hp, sm, tile, pos, /*q_stage_free=*/true);
    produce_kv<Cfg, T>(hp, sm, tile, pos, record.y >= 0 ? record.y & kSparseTileIndex : -1,
                       [&] { return sparse_walk(sm.lists[s], phase); });
  }
}

}  // namespace flare::hopper
