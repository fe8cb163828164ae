// Host side of the Hopper forward: tensor maps, shared memory, grid. Included by the generated
// per-(head dim, dtype) translation units only.
#pragma once

#include <atomic>
#include <cstdint>
#include <cstdlib>

#include <cute/tensor.hpp>

#include "src/attention/hopper/fwd_grid.h"
#include "src/attention/hopper/fwd_kernel.h"
#include "src/attention/hopper/fwd_launch.h"
#include "src/block_sparse/doc_spans.h"
#include "src/block_sparse/sparse_fwd_order.h"
#include "src/common/cuda_check.h"
#include "src/common/device_facts.h"
#include "src/common/programmatic_launch.h"
#include "src/scheduling/sparse_order.h"

namespace flare::hopper {

// One operand's (rows, head dim, heads, batch) view. Varlen tensors have batch extent 1; the
// unused batch stride is given a legal value.
inline void global_view(const detail::RowStrides& st, int64_t rows, int head_dim, int heads, int batch, bool varlen,
                        GShape* shape, GStride* stride) {
  *shape = GShape(static_cast<int32_t>(rows), head_dim, heads, varlen ? 1 : batch);
  *stride = GStride(st.row, cute::_1{}, st.head, varlen ? st.row * rows : st.batch);
}

// `bytes` of scratch: the caller's workspace (checked: size, 16-byte alignment) or, where it gave
// none, memory allocated on `stream` into *owned (the caller frees it after the kernels that use it).
inline Status forward_scratch(const detail::FwdKernelParams& p, std::size_t bytes, Stream stream, void** owned,
                              void** scratch) {
  if (p.workspace == nullptr) {
    FLARE_CUDA_RETURN(cudaMallocAsync(owned, bytes, stream));
    *scratch = *owned;
    return Status::Ok();
  }
  if (p.workspace_bytes < bytes)
    return Status::InvalidArgument("workspace", "needs " + std::to_string(bytes) + " bytes, got " +
                                                    std::to_string(p.workspace_bytes));
  if (reinterpret_cast<std::uintptr_t>(p.workspace) % 16 != 0)
    return Status::InvalidArgument("workspace", "must be 16-byte aligned");
  *scratch = p.workspace;
  return Status::Ok();
}

// The kernel's dynamic shared memory, raised once per instantiation (its status each call).
template <typename Cfg, typename T, bool kPersistent, bool kSparse>
Status hopper_fwd_smem_attribute() {
  static const cudaError_t attr = [] {
    cudaError_t e = cudaFuncSetAttribute(hopper_fwd_kernel<Cfg, T, kPersistent, kSparse>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         hopper_fwd_kernel_smem<Cfg, T, kPersistent, kSparse>());
    if (e != cudaSuccess) (void)cudaGetLastError();
    return e;
  }();
  return attr == cudaSuccess ? Status::Ok() : detail::cuda_status(attr, "hopper forward: shared memory attribute");
}

// The kernel's parameters but for its grid's: p and the tensor maps of Q, K and V.
template <typename Cfg, typename T>
HopperFwdParams<Cfg, T> hopper_fwd_params(const detail::FwdKernelParams& p) {
  using namespace cute;
  using L = FwdLayouts<Cfg, T>;
  const bool varlen = p.cu_seqlens_q != nullptr;
  HopperFwdParams<Cfg, T> hp;
  hp.p = p;
#if FLARE_HOPPER_FWD_TIMELINE
  hp.timeline = fwd_timeline_buffer();
#endif
  GStride q_stride, k_stride, v_stride;
  GShape k_shape_unused;
  global_view(p.q_str, varlen ? p.total_q : p.seqlen_q, p.head_dim, p.heads, p.batch, varlen, &hp.shape_q, &q_stride);
  global_view(p.k_str, varlen ? p.total_k : p.seqlen_k, p.head_dim, p.heads_kv, p.batch, varlen, &hp.shape_k, &k_stride);
  global_view(p.v_str, varlen ? p.total_k : p.seqlen_k, p.head_dim, p.heads_kv, p.batch, varlen, &k_shape_unused, &v_stride);
  hp.tma_q = make_tma_copy(SM90_TMA_LOAD{}, make_gtensor<typename L::Elem>(p.q, hp.shape_q, q_stride), typename L::SmemQ{},
                           Shape<typename L::BM, typename L::HD>{}, _1{});
  hp.tma_k = make_tma_copy(SM90_TMA_LOAD{}, make_gtensor<typename L::Elem>(p.k, hp.shape_k, k_stride),
                           typename L::SmemKVStage{}, Shape<typename L::BN, typename L::HD>{}, _1{});
  hp.tma_v = make_tma_copy(SM90_TMA_LOAD{}, make_gtensor<typename L::Elem>(p.v, hp.shape_k, v_stride),
                           typename L::SmemKVStage{}, Shape<typename L::BN, typename L::HD>{}, _1{});
  return hp;
}

// The dense forward. kPersistent: a grid of one CTA per SM taking tiles of the L2-grouped order
// from a counter (two Q stages where they fit), else one CTA per tile (longest first when masked).
// Measured on the H100 at seqlen 4096 (bench/RESULTS.md), the persistent grid's first version
// (static round-robin, one Q stage) lost 2-4 % on uniform work at d128 and d256 and 8-14 % on
// causal work; the dynamic version with two Q stages wins at d128 causal (hopper_fwd_persistent
// below), where the library takes it.
// `tail` (one CTA per tile): the last tiles split into key ranges (hopper_fwd_grid).
template <typename Cfg, typename T, bool kPersistent = false>
Status launch_hopper_fwd_cfg(const detail::FwdKernelParams& p, Stream stream,
                             const sched::TailSplit& tail = sched::TailSplit{}) {
  constexpr int kSmem = hopper_fwd_kernel_smem<Cfg, T, kPersistent, false>();
  auto kernel = hopper_fwd_kernel<Cfg, T, kPersistent, false>;
  FLARE_RETURN_IF_ERROR((hopper_fwd_smem_attribute<Cfg, T, kPersistent, false>()));
  if (p.seqlen_q == 0 || p.batch == 0) return Status::Ok();
  HopperFwdParams<Cfg, T> hp = hopper_fwd_params<Cfg, T>(p);
  if constexpr (!kPersistent) {
    // Banded work over the tile order (detail::dense_fwd_grid); a tail split is uniform work's.
    const detail::GridDims g =
        detail::dense_fwd_grid(hp.p, Cfg::kBlockM, Cfg::kBlockN, sizeof(T), detail::current_device_facts().l2_bytes / 2);
    dim3 grid(g.x, g.y, g.z);
    void* owned = nullptr;  // the split slots' scratch where the caller gave no workspace
    hp.tail = tail;
    const std::size_t bytes = hopper_fwd_tail_bytes<Cfg>(tail);
    if (bytes > 0) {
      void* partial = nullptr;
      FLARE_RETURN_IF_ERROR(forward_scratch(p, bytes, stream, &owned, &partial));
      hp.partial = static_cast<float*>(partial);
      grid = dim3(static_cast<unsigned>(hp.tail.ctas()));  // whole tiles, then the split ones' parts
    }
    kernel<<<grid, Cfg::kThreads, kSmem, stream>>>(hp);
    const cudaError_t launched = cudaGetLastError();
    if (launched != cudaSuccess) {
      if (owned != nullptr) (void)cudaFreeAsync(owned, stream);
      return detail::cuda_status(launched, "hopper forward launch");
    }
    if (hp.tail.active())
      hopper_fwd_tail_merge_kernel<Cfg, T>
          <<<dim3(static_cast<unsigned>(hp.tail.tiles), Cfg::kBlockM / kFwdMergeRows), 32 * kFwdMergeRows, 0, stream>>>(
              p, hp.tail, hp.partial);
    if (owned != nullptr) FLARE_CUDA_RETURN(cudaFreeAsync(owned, stream));
  } else {
    const detail::DeviceFacts dev = detail::current_device_facts();
    hp.p.order = sched::make_forward_order(detail::forward_tile_shape(p, Cfg::kBlockM, Cfg::kBlockN, sizeof(T)),
                                           dev.l2_bytes / 2);
    const dim3 grid(std::min(hp.p.order.num_tiles, dev.num_sms));  // one CTA fits an SM
    static std::atomic<unsigned> next_slot{0};  // this launch's counter: the next slot of the ring
    void* counters = nullptr;
    cudaError_t e = cudaGetSymbolAddress(&counters, hopper_fwd_tile_counters);
    hp.next_tile = static_cast<int*>(counters) + next_slot.fetch_add(1) % kHopperFwdCounterSlots;
    if (e == cudaSuccess) e = cudaMemsetAsync(hp.next_tile, 0, sizeof(int), stream);
    if (e != cudaSuccess) return detail::cuda_status(e, "hopper forward: the persistent grid's tile counter");
    kernel<<<grid, Cfg::kThreads, kSmem, stream>>>(hp);
  }
  return detail::cuda_status(cudaGetLastError(), "hopper forward launch");
}

// The block-sparse forward of the block mask `bs`. Scratch (hopper_sparse_scratch): the CTA order
// where the tiles outnumber the SMs (longest list rows first, sparse_order.h) with the persistent
// grid's tile counter, which the order's kernel zeroes; then a documents mask's row spans
// (doc_spans.h). Both kernels run ahead of the forward, which waits for them (it is the
// programmatic dependent of the last). With the order, the grid is persistent where
// hopper_sparse_persistent says so (one CTA per SM, Cfg's persistent form), else one CTA per tile.
template <typename Cfg, typename T>
Status launch_hopper_fwd_sparse_cfg(const detail::FwdKernelParams& p, const block_sparse::BlockSparseParams& bs,
                                    Stream stream) {
  constexpr bool kHasPersistent = hopper_sparse_persistent_fits<Cfg, T>();
  FLARE_RETURN_IF_ERROR((hopper_fwd_smem_attribute<Cfg, T, false, true>()));
  if constexpr (kHasPersistent) FLARE_RETURN_IF_ERROR((hopper_fwd_smem_attribute<Cfg, T, true, true>()));
  if (p.seqlen_q == 0 || p.batch == 0) return Status::Ok();
  HopperFwdParams<Cfg, T> hp = hopper_fwd_params<Cfg, T>(p);
  hp.bs = bs;
  dim3 grid((p.seqlen_q + Cfg::kBlockM - 1) / Cfg::kBlockM, p.heads, p.batch);
  const detail::DeviceFacts dev = detail::current_device_facts();
  const SparseScratch layout = hopper_sparse_scratch(p, bs.element.doc_q != nullptr, dev.num_sms);
  void* owned = nullptr;  // scratch where the caller gave no workspace
  void* scratch = nullptr;
  if (layout.total() > 0) FLARE_RETURN_IF_ERROR(forward_scratch(p, layout.total(), stream, &owned, &scratch));
  auto fail = [&](const Status& s) {
    if (owned != nullptr) (void)cudaFreeAsync(owned, stream);
    return s;
  };
  if (layout.span_bytes > 0) {
    int2* doc_spans = reinterpret_cast<int2*>(static_cast<char*>(scratch) + layout.span_offset());
    const Status s = block_sparse::launch_doc_spans(bs.element, p.batch, p.seqlen_q, p.seqlen_k, doc_spans, stream);
    if (!s.ok()) return fail(s);
    hp.doc_spans = doc_spans;
  }
  bool persistent = false;
  if (layout.order_bytes > 0) {
    sched::SparseOrder o = sched::make_sparse_forward_order(
        detail::forward_tile_shape(p, Cfg::kBlockM, Cfg::kBlockN, sizeof(T)), dev.l2_bytes / 2, dev.num_sms);
    if (const int units = hopper_sparse_order_units_override(); units > 0) o.units_per_group = units;
    int2* order = static_cast<int2*>(scratch);
    int* counter = reinterpret_cast<int*>(static_cast<char*>(scratch) + layout.counter_offset());
    const Status s =
        block_sparse::launch_sparse_forward_order(o, bs, Cfg::kBlockM, Cfg::kBlockN, p.seqlen_k, order, counter, stream);
    if (!s.ok()) return fail(s);
    hp.sparse_order = order;
    hp.next_tile = counter;
    persistent = kHasPersistent && hopper_sparse_persistent(p, Cfg::kBlockN);
    grid = dim3(static_cast<unsigned>(persistent ? std::min(o.num_tiles(), dev.num_sms) : o.num_tiles()));
  }
  // A programmatic dependent of the kernel ahead of it where that one writes what it reads.
  const bool after_prologue = hp.sparse_order != nullptr || hp.doc_spans != nullptr;
  cudaError_t launched = cudaSuccess;
  if constexpr (kHasPersistent) {
    if (persistent) {
      launched = detail::launch_maybe_programmatic(after_prologue, hopper_fwd_kernel<Cfg, T, true, true>, grid,
                                                   dim3(Cfg::kThreads), hopper_fwd_kernel_smem<Cfg, T, true, true>(),
                                                   stream, hp);
    }
  }
  if (!persistent)
    launched = detail::launch_maybe_programmatic(after_prologue, hopper_fwd_kernel<Cfg, T, false, true>, grid,
                                                 dim3(Cfg::kThreads), hopper_fwd_kernel_smem<Cfg, T, false, true>(),
                                                 stream, hp);
  if (launched != cudaSuccess) return fail(detail::cuda_status(launched, "hopper forward launch"));
  if (owned != nullptr) FLARE_CUDA_RETURN(cudaFreeAsync(owned, stream));
  return Status::Ok();
}

template <int kHeadDim, typename T>
Status launch_hopper_fwd(const detail::FwdKernelParams& p, Stream stream) {
  const HopperFwdGrid grid = hopper_fwd_grid<kHeadDim>(p);
  if constexpr (hopper_fwd_has_persistent(kHeadDim))
    if (grid.persistent)
      return launch_hopper_fwd_cfg<typename HopperFwdPersistentConfigFor<kHeadDim>::type, T, true>(p, stream);
  return launch_hopper_fwd_cfg<typename HopperFwdConfigFor<kHeadDim>::type, T>(p, stream, grid.tail);
}

// The block-sparse forward (launch_hopper_fwd_sparse_cfg).
template <int kHeadDim, typename T>
Status launch_hopper_fwd_sparse(const detail::FwdKernelParams& p, const block_sparse::BlockSparseParams& bs,
                                Stream stream) {
  return launch_hopper_fwd_sparse_cfg<typename HopperFwdSparseConfigFor<kHeadDim>::type, T>(p, bs, stream);
}

}  // namespace flare::hopper
