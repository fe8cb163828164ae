// The Hopper backward's producer (bwd_kernel.h, bwd_split_kernel.h): one thread of producer warp 0
// issues the TMA loads of a CTA's K and V, then of each query step's Q, dO and row statistics.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "src/attention/hopper/bwd_tile.h"
#include "src/attention/hopper/stage_ring.h"

namespace flare::hopper {

// Producer warp 0 (one thread) of both backward tilings: K and V once, then per step of the walk
// `step_loads(m, q_src, q_dst, do_src, do_dst, stats_src, stats_block)`, which issues that query
// block's Q, dO and row statistics (stats_src's 64-row blocks from stats_block on) into the
// tiling's rings. The sources are (.., query block, piece) in pieces of
// L::QLoadShape (the whole head dim, or the split tiling's halves); q_dst is (.., L::SmemQ's last
// mode) and do_dst (.., SmemDO's). SmemDO: dO's shared-memory layout.
template <typename L, typename SmemDO, typename Params, typename Smem, typename Tile, typename StepLoads>
__device__ __forceinline__ void bwd_produce_tiles(const Params& hp, Smem& sm, const Tile& t, StepLoads&& step_loads) {
  using namespace cute;
  const detail::FwdKernelParams& p = hp.p.fwd;
  const bool varlen = p.cu_seqlens_q != nullptr;
  const int hk = t.h / p.group, bt = varlen ? 0 : t.b;
  Tensor mQ = domain_offset(make_coord(int32_t(t.seq.q_start), _0{}), hp.tma_q.get_tma_tensor(hp.shape_q)(_, _, t.h, bt));
  Tensor mDO = domain_offset(make_coord(int32_t(t.seq.q_start), _0{}), hp.tma_do.get_tma_tensor(hp.shape_q)(_, _, t.h, bt));
  Tensor mK = domain_offset(make_coord(int32_t(t.seq.k_start), _0{}), hp.tma_k.get_tma_tensor(hp.shape_k)(_, _, hk, bt));
  Tensor mV = domain_offset(make_coord(int32_t(t.seq.k_start), _0{}), hp.tma_v.get_tma_tensor(hp.shape_k)(_, _, hk, bt));
  Tensor gQ = local_tile(mQ, typename L::QLoadShape{}, make_coord(_, _));  // (BM, piece columns, m, piece)
  Tensor gDO = local_tile(mDO, typename L::QLoadShape{}, make_coord(_, _));
  Tensor gK = local_tile(mK, Shape<typename L::BN, typename L::HD>{}, make_coord(t.n, _0{}));
  Tensor gV = local_tile(mV, Shape<typename L::BN, typename L::HD>{}, make_coord(t.n, _0{}));
  Tensor sQ = make_tensor(make_smem_ptr(sm.q.data()), typename L::SmemQ{});
  Tensor sDO = make_tensor(make_smem_ptr(sm.dout.data()), SmemDO{});
  Tensor sK = make_tensor(make_smem_ptr(sm.k.data()), typename L::SmemK{});
  Tensor sV = make_tensor(make_smem_ptr(sm.v.data()), typename L::SmemK{});
  auto q_part = hp.tma_q.get_slice(_0{});
  auto do_part = hp.tma_do.get_slice(_0{});
  auto k_part = hp.tma_k.get_slice(_0{});
  auto v_part = hp.tma_v.get_slice(_0{});
  // Row statistics: block (b, h, m) of row_stats is column (b heads + h) num_m_blocks + m.
  auto stats_part = hp.tma_stats.get_slice(_0{});
  Tensor stats_src = stats_part.partition_S(
      local_tile(hp.tma_stats.get_tma_tensor(hp.shape_stats), Shape<typename L::StatsBlock, _1>{}, make_coord(_0{}, _)));
  const int stats_block0 = (t.b * p.heads + t.h) * hp.p.num_m_blocks;

  cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&sm.kv_full, 2 * L::kKBytes);
  copy(hp.tma_k.with(sm.kv_full), k_part.partition_S(gK), k_part.partition_D(sK));
  copy(hp.tma_v.with(sm.kv_full), v_part.partition_S(gV), v_part.partition_D(sV));
  Tensor q_src = q_part.partition_S(gQ);
  Tensor q_dst = q_part.partition_D(sQ);
  Tensor do_src = do_part.partition_S(gDO);
  Tensor do_dst = do_part.partition_D(sDO);
  for (int step = 0; step < t.steps(); ++step) {
    const int m = t.m_at(step);
    step_loads(m, q_src, q_dst, do_src, do_dst, stats_src, stats_block0 + m * L::kRowBlocks);
  }
}

// The d <= 128 tiling: Q, dO and the statistics share one ring of kStages stages.
template <typename Cfg, typename T, typename Smem, typename Tile>
__device__ __forceinline__ void bwd_produce(const HopperBwdParams<Cfg, T>& hp, Smem& sm, const Tile& t) {
  using namespace cute;
  using L = BwdLayouts<Cfg, T>;
  RingPos pos;
  auto stats_part = hp.tma_stats.get_slice(_0{});
  bwd_produce_tiles<L, typename L::SmemQ>(hp, sm, t, [&](int m, auto& q_src, auto& q_dst, auto& do_src, auto& do_dst,
                                                          auto& stats_src, int stats_block) {
    uint64_t& bar = sm.qdo_ring.acquire(pos, 2 * L::kQBytes + L::kStatsBytes);
    copy(hp.tma_q.with(bar), q_src(_, _, _, m, 0), q_dst(_, _, _, pos.index));
    copy(hp.tma_do.with(bar), do_src(_, _, _, m, 0), do_dst(_, _, _, pos.index));
    // [LSE of the step's rows, dpsum of its rows]: with two 64-row blocks, each block's halves apart.
    float* stage_stats = &sm.stats[pos.index * 2 * Cfg::kBlockM];
    CUTE_UNROLL
    for (int r = 0; r < L::kRowBlocks; ++r) {
      CUTE_UNROLL
      for (int piece = 0; piece < L::kStatsPieces; ++piece) {
        float* dst = stage_stats + (L::kStatsPieces == 1 ? 0 : piece * Cfg::kBlockM + r * detail::kRowStatsBlockM);
        copy(hp.tma_stats.with(bar), stats_src(_, _, _, (stats_block + r) * L::kStatsPieces + piece),
             stats_part.partition_D(make_tensor(make_smem_ptr(dst), typename L::SmemStats{})));
      }
    }
    pos.template advance<Cfg::kStages>();
  });
}

}  // namespace flare::hopper
