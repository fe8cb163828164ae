// Hopper attention forward (sm_90a): warp-specialized, TMA-fed, wgmma-computed.
//
// A CTA owns kBlockM = 64 x kConsumerWGs query rows of one (sequence, head). Warpgroup 0 is the
// producer: one thread issues the TMA loads of Q and of the visible K/V blocks, last block first
// (the masked blocks at the diagonal come first), into rings of kStages stages. Each consumer
// warpgroup owns 64 rows and runs, per key block n (from the last to the first):
//
//     S_n = Q K_n^T                       (wgmma, issued before the softmax of the previous block)
//     O  += P_{n+1} V_{n+1}              (wgmma, P from registers, overlapping S_n's softmax)
//     P_n = exp2(S_n * scale - m_n)      (online softmax; O rescaled by exp2(m_{n+1} - m_n))
//
// Masks apply on the partial tiles only. The epilogue normalizes O and writes it and the LSE.
//
// With a block mask (kSparse, fwd_kv_walk.h) the CTA's rows lie in one mask q block and the key
// tiles come from its lists instead of the band: partial blocks first (the element predicate on
// top of the band's), then full ones.
//
// The tail split's parts are merged after the grid by fwd_tail_merge.h's kernel.
//
// The kernel's data are in fwd_tile.h, its producer in fwd_producer.h, its consumers in
// fwd_consumer.h.
#pragma once

#include <cuda_runtime.h>

#include <type_traits>

#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include "src/attention/hopper/fwd_consumer.h"
#include "src/attention/hopper/fwd_producer.h"
#include "src/attention/hopper/fwd_tail_merge.h"
#include "src/attention/hopper/fwd_tile.h"
#include "src/attention/hopper/smem_struct.h"
#include "src/common/grid_dependency.h"

namespace flare::hopper {

// kPersistent: one CTA per SM; its producer thread takes the next tile of the L2-grouped order
// from a counter (hp.next_tile: dynamic, so uneven tiles balance), writes it beside the
// tile's Q stage and loads Q and K/V while the consumers finish the current tile (two Q stages
// where they fit); the consumers learn the tile from the stage once its Q has landed (the
// barrier's arrival publishes the producer's write), and stop at the -1 of an empty one.
// Otherwise one CTA per tile, launched longest first when rows see different numbers of keys.
// kSparse: the key tiles of hp.bs's lists. One CTA per tile: in hp.sparse_order's order where
// given, else the last q blocks first (the longest lists of causal-like masks); the first consumer
// warp expands the CTA's list row into shared memory while the producer issues Q; the producer's K/V
// loads and the consumers' walks wait for it. Persistent (hp.sparse_order given): the tiles of the
// order from a counter (produce_sparse_persistent), each list written by a warp of the producer's
// warpgroup into its Q stage's buffer (sparse_list_writer).
template <typename Cfg, typename T, bool kPersistent, bool kSparse = false>
__global__ void __launch_bounds__(Cfg::kThreads, 1) hopper_fwd_kernel(const __grid_constant__ HopperFwdParams<Cfg, T> hp) {
  using Smem = FwdSmem<Cfg, T, hopper_fwd_kernel_q_stages<Cfg, T, kPersistent, kSparse>(), kSparse, kPersistent>;
  using Walk = std::conditional_t<kSparse, SparseKvWalkOf<typename FwdListSmem<kSparse, kPersistent>::List>, DenseKvWalk>;
  static_assert(!(kSparse && kPersistent) || hopper_sparse_persistent_fits<Cfg, T>(), "no persistent sparse form");
  extern __shared__ unsigned char smem_raw[];
  auto& sm = smem_struct<Smem>(smem_raw);
  const detail::FwdKernelParams& p = hp.p;
  const int warp = threadIdx.x / 32, wg = warp / 4;
  unsigned long long* tl = timeline_of(hp);
  const int cta = static_cast<int>(blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z));
  // An ordered sparse grid's tile (and its first key tile), loaded before the barriers' setup so
  // that its latency passes there. The grid is the programmatic dependent of the kernel that writes
  // the order or the document spans: it may start under that kernel and waits for it here.
  int ordered = -1, first_tile = -1;
  if constexpr (kSparse) {
    if (kPersistent || hp.sparse_order != nullptr || hp.doc_spans != nullptr) device::wait_for_prerequisite_grids();
    if (!kPersistent && hp.sparse_order != nullptr) {
      const int2 record = hp.sparse_order[blockIdx.x];
      ordered = record.x, first_tile = record.y;
    }
  }
  if (!kPersistent && threadIdx.x == 0) {
    timeline_mark(tl, cta, kMarkStart);
    timeline_mark_global(tl, cta, kMarkGlobalStart);
    timeline_set(tl, cta, kMarkSm, sm_id());
  }
  if (threadIdx.x == 32) {  // the tensor maps fetched while the barriers are set up (the producer's first loads need them)
    cute::prefetch_tma_descriptor(hp.tma_q.get_tma_descriptor());
    cute::prefetch_tma_descriptor(hp.tma_k.get_tma_descriptor());
    cute::prefetch_tma_descriptor(hp.tma_v.get_tma_descriptor());
  }
  if (threadIdx.x == 0) {
    // Every consumer thread releases a Q stage.
    sm.q_ring.init(128 * Cfg::kConsumerWGs);
    sm.k_ring.init(4 * Cfg::kConsumerWGs);
    sm.v_ring.init(4 * Cfg::kConsumerWGs);
    if constexpr (kSparse && kPersistent) {
      for (int st = 0; st < 2; ++st) {
        cutlass::arch::ClusterBarrier::init(&sm.lists[st].full, 32);  // the writing warp's lanes
        cutlass::arch::ClusterBarrier::init(&sm.announce[st], 1);
      }
    } else if constexpr (kSparse) {
      cutlass::arch::ClusterBarrier::init(&sm.list.full, 32);  // the writing warp's lanes
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();

  auto tile_at_order = [&](int i) {
    const sched::TileCoord c = sched::tile_at(p.order, i);
    FwdTile<Walk> tile = fwd_tile_of<Cfg, Walk>(hp, c.block, c.head, c.batch);
    tile.id = i;
    return tile;
  };
  auto this_ctas_tile = [&] {  // one CTA per tile; rows that see different key counts: longest first
    if constexpr (!kSparse) {
      if (hp.tail.active()) {  // a 1D grid: whole tiles, then the split ones' parts
        const sched::TileCoord c = split_fwd_tile<Cfg>(p, sched::tail_work(hp.tail, blockIdx.x, 0).tile);
        FwdTile<Walk> tile = fwd_tile_of<Cfg, Walk>(hp, c.block, c.head, c.batch);
        const sched::BlockRange r = tile.kv.range;  // every block unmasked: any range of them is a part
        const sched::TailWork w = sched::tail_work(hp.tail, blockIdx.x, r.last - r.first);
        tile.kv.range = sched::BlockRange{r.first + w.begin, r.first + w.end};
        tile.id = cta;
        return tile;
      }
      if (p.order.num_tiles > 0) return tile_at_order(blockIdx.x);  // banded: detail::dense_fwd_grid
    }
    if constexpr (kSparse) {
      if (ordered >= 0) {
        const int m_tiles = (p.seqlen_q + Cfg::kBlockM - 1) / Cfg::kBlockM, flat = ordered / m_tiles;
        FwdTile<Walk> tile = fwd_tile_of<Cfg, Walk>(hp, ordered - flat * m_tiles, flat % p.heads, flat / p.heads);
        tile.id = cta;
        return tile;
      }
    }
    const bool longest_first = kSparse;  // block-sparse without a CTA order: the last q blocks first
    FwdTile<Walk> tile =
        fwd_tile_of<Cfg, Walk>(hp, longest_first ? gridDim.x - 1 - blockIdx.x : blockIdx.x, blockIdx.y, blockIdx.z);
    tile.id = cta;
    return tile;
  };
  PipePos pos;
  if constexpr (kSparse && kPersistent) {
    if (wg == 0) {
      cutlass::arch::warpgroup_reg_dealloc<Cfg::kProducerRegs>();
      if (warp == 1) sparse_list_writer<Cfg, T>(hp, sm, threadIdx.x % 32);
      if (warp == 0 && cute::elect_one_sync()) produce_sparse_persistent<Cfg, T>(hp, sm);
    } else {
      cutlass::arch::warpgroup_reg_alloc<Cfg::kConsumerRegs>();
      GemmTurns<Cfg::kConsumerWGs, Cfg::kPingPong>::start(wg - 1);
      for (;;) {
        sm.q_ring.wait_full(pos.q);
        // The stage's tile as the producer announced it ({order index, encoded tile, ..}; -1: none
        // left), read before the consumers release the stage (consume), as the dense grid's tile_of_q.
        const int4 a = sm.announced[pos.q.index];
        if (a.x < 0) return;
        FwdTile<Walk> tile = ordered_sparse_tile<Cfg, Walk>(hp, a.y);
        tile.id = a.x;
        tile.kv = sparse_walk(sm.lists[pos.q.index], pos.q.phase);
        consume<Cfg, T>(hp, sm, tile, threadIdx.x - 128, pos, /*q_waited=*/true);
        if (threadIdx.x == 128) atomicAdd(hp.next_tile + 1, 1);  // tiles done (a test checks: each once)
      }
    }
  } else {
    if (wg == 0) {
      cutlass::arch::warpgroup_reg_dealloc<Cfg::kProducerRegs>();
      if (warp != 0 || !cute::elect_one_sync()) return;
      if constexpr (kPersistent) {
        for (;;) {
          cutlass::arch::ClusterBarrier::wait(&sm.q_ring.empty[pos.q.index], pos.q.phase ^ 1u);
          int i = atomicAdd(hp.next_tile, 1);
          FwdTile<Walk> tile;
          for (; i < p.order.num_tiles; i = atomicAdd(hp.next_tile, 1)) {  // tiles of no rows skipped
            tile = tile_at_order(i);
            if (tile.rows > 0) break;
          }
          if (i >= p.order.num_tiles) {  // the consumers' signal to stop: an empty stage
            sm.tile_of_q[pos.q.index] = -1;
            cutlass::arch::ClusterBarrier::arrive(&sm.q_ring.full[pos.q.index]);
            return;
          }
          sm.tile_of_q[pos.q.index] = i;
          timeline_mark(tl, tile.id, kMarkStart);
          timeline_mark_global(tl, tile.id, kMarkGlobalStart);
          timeline_set(tl, tile.id, kMarkSm, sm_id());
          produce<Cfg, T>(hp, sm, tile, pos, /*q_stage_free=*/true);  // Q even where no key is visible
        }
      } else if constexpr (kSparse) {  // Q first: it needs no list
        FwdTile<Walk> tile = this_ctas_tile();
        if (tile.rows <= 0) return;
        produce_q<Cfg, T>(hp, sm, tile, pos, /*q_stage_free=*/false);
        // The first K from the order's record, while the list row is still being written.
        produce_kv<Cfg, T>(hp, sm, tile, pos, first_tile >= 0 ? first_tile & kSparseTileIndex : -1,
                           [&] { return sparse_walk(sm.list); });
      } else {
        const FwdTile<Walk> tile = this_ctas_tile();
        if (tile.rows > 0 && !tile.kv.empty()) produce<Cfg, T>(hp, sm, tile, pos);
      }
    } else {
      cutlass::arch::warpgroup_reg_alloc<Cfg::kConsumerRegs>();
      GemmTurns<Cfg::kConsumerWGs, Cfg::kPingPong>::start(wg - 1);
      if constexpr (kPersistent) {
        for (;;) {
          sm.q_ring.wait_full(pos.q);
          // Every consumer thread releases the Q stage (consume) after this read: the producer, which
          // rewrites the slot after the release, is ordered after each reader by that reader's own
          // arrive (a lane-0 arrive after __syncwarp left racecheck hazards at d64).
          const int i = sm.tile_of_q[pos.q.index];
          if (i < 0) return;
          consume<Cfg, T>(hp, sm, tile_at_order(i), threadIdx.x - 128, pos, /*q_waited=*/true);
        }
      } else {
        FwdTile<Walk> tile = this_ctas_tile();
        if (tile.rows <= 0) return;
        if constexpr (kSparse) {
          if (warp == 4)  // the first consumer warp writes the list row (its loads overlap Q's)
            fill_sparse_tile_list<Cfg::kBlockN>(sm.list, hp.bs, tile.b, tile.h, tile.row0 / hp.bs.q_block_size,
                                                tile.seq.seqlen_k, threadIdx.x % 32, hp.doc_spans, tile.row0,
                                                tile.seq.seqlen_q);
          tile.kv = sparse_walk(sm.list);
        }
        consume<Cfg, T>(hp, sm, tile, threadIdx.x - 128, pos);
      }
    }
  }
}

}  // namespace flare::hopper
