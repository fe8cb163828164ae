// Host side of the Hopper backward: the portable pre-pass, tensor maps, the main kernel, dsinks and
// the conversions. Included by the generated per-(head dim, dtype) translation units only.
#pragma once

#include <cstdlib>

#include "src/attention/hopper/bwd_kernel.h"
#include "src/attention/hopper/bwd_split_kernel.h"
#include "src/attention/hopper/bwd_launch.h"
#include "src/attention/hopper/fwd_launch_impl.h"
#include "src/attention/portable/bwd_kernel.h"
#include "src/common/device_facts.h"

namespace flare::hopper {

// Takes kKernel (*kernel = kKernel) with its dynamic shared memory raised to kSmem, once per kernel.
template <auto kKernel, int kSmem, typename Kernel>
cudaError_t hopper_bwd_take_kernel(Kernel* kernel) {
  static const cudaError_t attr = [] {
    cudaError_t e = cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
    if (e != cudaSuccess) (void)cudaGetLastError();
    return e;
  }();
  *kernel = kKernel;
  return attr;
}

// The main kernel of a mode, its shared memory raised: the split tiling's, or the d <= 128 tiling's
// with the mode's dQ writers (bwd_config.h; the block-sparse kernel runs the ordinary count).
template <typename Cfg, typename T, bool kSparse, int kSmem>
cudaError_t hopper_bwd_kernel_for(bool deterministic, void (**kernel)(HopperBwdParams<Cfg, T>)) {
  (void)deterministic;  // unread where the modes share a kernel
  if constexpr (Cfg::kSplitHeadDim) {
    return hopper_bwd_take_kernel<hopper_bwd_split_kernel<Cfg, T>, kSmem>(kernel);
  } else {
    if constexpr (!kSparse) {
      constexpr int kDet = Cfg::kDetDqWriters;
      if constexpr (kDet != Cfg::kDqWriters) {
        if (deterministic) return hopper_bwd_take_kernel<hopper_bwd_kernel<Cfg, T, false, kDet>, kSmem>(kernel);
      }
    }
    return hopper_bwd_take_kernel<hopper_bwd_kernel<Cfg, T, kSparse>, kSmem>(kernel);
  }
}

// The deterministic dense grid's turns (sched::dq_turns.h). Banded work (causal, windows): shortest
// first with the last waves' heads longest first (kShortestTail, the default, session 55), shortest
// first (head-major, each head's kv blocks descending) or longest first (kLongestFirst: the
// L2-grouped order with kv blocks ascending, walks descending); full attention rotates its
// rectangles (kAuto). FLARE_HOPPER_BWD_DET_ORDER=tail|shortest|longest forces the banded choice
// (read per call: A/B runs and the tests of each).
inline sched::DqScheme hopper_bwd_det_scheme(const detail::FwdKernelParams& p) {
  if (!FLARE_HOPPER_BWD_ROTATE) return sched::DqScheme::kTileOrder;
  if (!detail::has_band(p)) return sched::DqScheme::kAuto;
  const char* e = std::getenv("FLARE_HOPPER_BWD_DET_ORDER");
  const char order = e == nullptr ? 't' : e[0];
  return order == 'l' ? sched::DqScheme::kLongestFirst : order == 's' ? sched::DqScheme::kAuto
                                                                      : sched::DqScheme::kShortestTail;
}

// FLARE_HOPPER_BWD_DET_TAIL_HEADS (A/B runs of kShortestTail's head count, read per call): N > 0
// reverses the last N flat heads, "l2" as many as the L2 budget holds (sched::shortest_tail_heads_in_l2).
inline void hopper_bwd_tail_heads_override(const sched::TileShape& shape, int64_t l2_budget_bytes,
                                           sched::DqPlan* plan) {
  const char* e = std::getenv("FLARE_HOPPER_BWD_DET_TAIL_HEADS");
  if (e == nullptr || e[0] == 0) return;
  const int heads = shape.batch * shape.heads;
  const int g = e[0] == 'l' ? sched::shortest_tail_heads_in_l2(shape, l2_budget_bytes) : std::atoi(e);
  if (g >= 1) plan->order.reversed_heads = g < heads ? g : heads;
}

// kSparse: the query steps of the block mask `bs`'s transposed lists, or in deterministic mode of
// its plan `dq_plan` (the d <= 128 tiling).
template <typename Cfg, typename T, bool kSparse = false>
Status launch_hopper_bwd_cfg(const detail::BwdKernelParams& P, Stream stream,
                             const block_sparse::BlockSparseParams* bs = nullptr,
                             const block_sparse::DqPlanView* dq_plan = nullptr) {
  static_assert(!kSparse || !Cfg::kSplitHeadDim, "the block-sparse backward has the d <= 128 tiling only");
  using namespace cute;
  using L = BwdLayouts<Cfg, T>;
  const detail::FwdKernelParams& p = P.fwd;
  if (p.batch == 0 || p.heads == 0) return Status::Ok();
  constexpr int kSmem = [] {
    if constexpr (Cfg::kSplitHeadDim) {
      return hopper_bwd_split_smem_bytes<Cfg, T>();
    } else {
      return hopper_bwd_smem_bytes<Cfg, T>();
    }
  }();
  static_assert(kSmem <= 227 * 1024, "the Hopper backward's shared memory exceeds an H100 CTA's 227 KB");
  void (*kernel)(HopperBwdParams<Cfg, T>) = nullptr;
  const cudaError_t attr = hopper_bwd_kernel_for<Cfg, T, kSparse, kSmem>(P.deterministic, &kernel);
  if (attr != cudaSuccess) return detail::cuda_status(attr, "hopper backward: shared memory attribute");
  if (P.row_stats == nullptr || P.dq_tile_elems != detail::kRowStatsBlockM * Cfg::kHeadDim ||
      P.num_m_blocks % Cfg::kRowBlocks != 0)
    return Status::InvalidArgument("workspace", "not laid out for this Hopper backward (head dim " +
                                                    std::to_string(Cfg::kHeadDim) + ")");
  if (p.seqlen_q > 0) {  // dpsum and the padded statistics, padding rows included
    dim3 grid((P.num_m_blocks * detail::kRowStatsBlockM + 7) / 8, p.heads, p.batch);
    portable::bwd_dpsum_kernel<T><<<grid, 256, 0, stream>>>(P);
  }
  if (p.seqlen_k > 0 && p.seqlen_q > 0 && P.num_n_blocks > 0) {
    const bool varlen = p.cu_seqlens_q != nullptr;
    HopperBwdParams<Cfg, T> hp;
    hp.p = P;
    if constexpr (kSparse) {
      hp.bs = *bs;
      if (P.deterministic) hp.dq_plan = *dq_plan;
    }
    GStride q_stride, do_stride, k_stride, v_stride;
    GShape unused;
    global_view(p.q_str, varlen ? p.total_q : p.seqlen_q, p.head_dim, p.heads, p.batch, varlen, &hp.shape_q, &q_stride);
    global_view(P.dout_str, varlen ? p.total_q : p.seqlen_q, p.head_dim, p.heads, p.batch, varlen, &unused, &do_stride);
    global_view(p.k_str, varlen ? p.total_k : p.seqlen_k, p.head_dim, p.heads_kv, p.batch, varlen, &hp.shape_k, &k_stride);
    global_view(p.v_str, varlen ? p.total_k : p.seqlen_k, p.head_dim, p.heads_kv, p.batch, varlen, &unused, &v_stride);
    using E = typename L::Elem;
    hp.tma_q = make_tma_copy(SM90_TMA_LOAD{}, make_gtensor<E>(p.q, hp.shape_q, q_stride), typename L::SmemQLoad{},
                             typename L::QLoadShape{}, _1{});
    hp.tma_do = make_tma_copy(SM90_TMA_LOAD{}, make_gtensor<E>(P.dout, hp.shape_q, do_stride), typename L::SmemQLoad{},
                              typename L::QLoadShape{}, _1{});
    hp.tma_k = make_tma_copy(SM90_TMA_LOAD{}, make_gtensor<E>(p.k, hp.shape_k, k_stride), typename L::SmemK{},
                             Shape<typename L::BN, typename L::HD>{}, _1{});
    hp.tma_v = make_tma_copy(SM90_TMA_LOAD{}, make_gtensor<E>(p.v, hp.shape_k, v_stride), typename L::SmemK{},
                             Shape<typename L::BN, typename L::HD>{}, _1{});
    // Walks and turns; the deterministic grid follows the plan's tile order, one CTA per SM
    // resident (the rotation's rounds must not exceed that).
    const detail::DeviceFacts facts = detail::current_device_facts();
    const sched::TileShape shape = detail::forward_tile_shape(p, Cfg::kBlockM, Cfg::kBlockN, sizeof(T));
    const int64_t l2_budget = int64_t{facts.l2_bytes} / 2;
    hp.plan = sched::make_dq_plan(shape, l2_budget, facts.num_sms,
                                  P.deterministic ? hopper_bwd_det_scheme(p)
                                  : FLARE_HOPPER_BWD_ROTATE ? sched::DqScheme::kAuto
                                                            : sched::DqScheme::kTileOrder,
                                  // kShortestTail: the last two waves' heads at d <= 128, the last
                                  // head at d256 (sched::kShortestTailWaves)
                                  Cfg::kSplitHeadDim ? 0 : sched::kShortestTailWaves);
    if (hp.plan.scheme == sched::DqScheme::kShortestTail) hopper_bwd_tail_heads_override(shape, l2_budget, &hp.plan);
    const int32_t stats_blocks = p.batch * p.heads * P.num_m_blocks * L::kStatsPieces;  // pieces
    hp.shape_stats = typename L::StatsShape{typename L::StatsBlock{}, stats_blocks};
    hp.tma_stats = make_tma_copy(SM90_TMA_LOAD{}, L::stats_gtensor(P.row_stats, stats_blocks), typename L::SmemStats{},
                                 Shape<typename L::StatsBlock, _1>{}, _1{});
    dim3 grid = P.deterministic ? dim3(hp.plan.order.num_tiles) : dim3(P.num_n_blocks, p.heads, p.batch);
    if (!kSparse && !P.deterministic) {  // masked work: a 1D grid over the backward tile order
      const detail::GridDims g = detail::dense_bwd_grid(hp.p, Cfg::kBlockN, sizeof(T), l2_budget);
      grid = dim3(g.x, g.y, g.z);
    }
    const bool split = !kSparse && !P.deterministic && P.tail.active();
    if (split) grid = dim3(static_cast<unsigned>(P.tail.ctas()));  // whole tiles, then the split ones' parts
    if (kSparse && P.deterministic) grid = dim3(dq_plan->num_tiles() * (bs->kv_block_size / Cfg::kBlockN));
    kernel<<<grid, Cfg::kThreads, kSmem, stream>>>(hp);
    if (split && P.dkv_tail != nullptr)
      hopper_dkv_tail_convert_kernel<Cfg, T><<<static_cast<unsigned>(P.tail.tiles), 256, 0, stream>>>(P);
  }
  if (P.dsinks != nullptr) FLARE_RETURN_IF_ERROR(portable::launch_bwd_dsinks(P, stream));
  if (P.num_m_blocks > 0)
    hopper_dq_convert_kernel<Cfg, T>
        <<<dim3(P.num_m_blocks / Cfg::kRowBlocks, p.heads, p.batch), Cfg::kConsumerWGs * 128, 0, stream>>>(P);
  portable::launch_bwd_dkv_convert<T>(P, stream);
  return detail::cuda_status(cudaGetLastError(), "hopper backward launch");
}

template <int kHeadDim, typename T>
Status launch_hopper_bwd(const detail::BwdKernelParams& p, Stream stream) {
  if constexpr (!hopper_bwd_serves(kHeadDim)) {
    (void)p;
    (void)stream;
    return Status::NotSupported("head dim " + std::to_string(kHeadDim) +
                                ": the Hopper backward serves head dims up to 128 and 256");
  } else {
    return launch_hopper_bwd_cfg<HopperBwdConfigFor<kHeadDim>, T>(p, stream);
  }
}

template <int kHeadDim, typename T>
Status launch_hopper_bwd_sparse(const detail::BwdKernelParams& p, const block_sparse::BlockSparseParams& bs,
                                const block_sparse::DqPlanView* dq_plan, Stream stream) {
  if constexpr (!hopper_bwd_sparse_serves(kHeadDim)) {
    (void)p;
    (void)bs;
    (void)dq_plan;
    (void)stream;
    return Status::NotSupported("head dim " + std::to_string(kHeadDim) +
                                ": the Hopper block-sparse backward serves head dims up to 128");
  } else {
    if (p.deterministic && dq_plan == nullptr)
      return Status::InvalidArgument("block_mask_dq_plan", "the deterministic block-sparse backward needs its plan");
    return launch_hopper_bwd_cfg<HopperBwdSparseConfigFor<kHeadDim>, T, true>(p, stream, &bs, dq_plan);
  }
}

}  // namespace flare::hopper
