// The attention entry points: validate, build device params once, pick the kernel family.
#include "flare/attention.h"

#include <cstdint>
#include <cstdlib>
#include <string>

#include "flare/block_mask.h"
#include "src/attention/attention_args.h"
#include "src/attention/fwd_params.h"
#include "src/attention/bwd_params.h"
#include "src/attention/portable/bwd_launch.h"
#include "src/attention/portable/fwd_launch.h"
#include "src/block_sparse/block_mask_args.h"
#include "src/block_sparse/block_sparse_params.h"
#include "src/block_sparse/dq_write_order.h"
#ifdef FLARE_WITH_HOPPER
#include "src/attention/hopper/bwd_launch.h"
#include "src/attention/hopper/bwd_dq_replicas.h"
#include "src/attention/hopper/fwd_launch.h"
#endif
#include "src/common/cuda_check.h"
#include "src/common/device_facts.h"

namespace flare {
namespace {

// Block-sparse masks run on the Hopper kernel where it takes the mask's block sizes (kAuto on an
// sm_90 device, or kHopper), else on the portable one. The lists must cover the attention's
// batched shape: varlen sequences have no per-batch block rows.
Status block_sparse_forward(const AttentionForwardParams& params, const detail::AttentionShape& shape,
                            const detail::FwdKernelParams& kp) {
  if (shape.varlen)
    return Status::NotSupported("block_mask: block-sparse attention with varlen sequences (cu_seqlens) is not supported");
  if (params.backend == Backend::kReference)
    return Status::NotSupported("backend: the reference kernel has no block-sparse mask (the CPU oracle is flare::ref)");
  const detail::BlockMaskProblem problem{shape.batch, shape.heads, shape.seqlen_q, shape.seqlen_k};
  detail::BlockMaskShape mask_shape;
  FLARE_RETURN_IF_ERROR(detail::validate_block_mask(*params.block_mask, problem, DeviceKind::kCUDA, &mask_shape));
  const block_sparse::BlockSparseParams bs =
      block_sparse::make_block_sparse_params(*params.block_mask, shape.seqlen_q, shape.seqlen_k);
  if (params.backend != Backend::kPortable) {
#ifdef FLARE_WITH_HOPPER
    const Status hopper = hopper::hopper_forward_sparse_check(kp, bs, params.q.dtype);
    if (hopper.ok()) return hopper::hopper_attention_forward_sparse(kp, bs, params.q.dtype, params.stream);
    if (params.backend == Backend::kHopper) return hopper;
#else
    if (params.backend == Backend::kHopper)
      return Status::NotSupported("backend: this build has no Hopper kernels (FLARE_HOPPER_ARCHS is empty)");
#endif
  }
  return portable::portable_attention_forward_sparse(kp, bs, params.q.dtype, params.stream);
}

#ifdef FLARE_WITH_HOPPER
// Whether a dense forward runs the Hopper kernel: the backend allows it (kAuto, kHopper) and
// hopper_forward_check accepts the problem. attention_forward and its workspace size both ask.
bool dense_forward_on_hopper(const AttentionForwardParams& params, const detail::FwdKernelParams& kp) {
  return (params.backend == Backend::kAuto || params.backend == Backend::kHopper) &&
         hopper::hopper_forward_check(kp, params.q.dtype).ok();
}
#endif

}  // namespace

Status attention_forward_workspace_size(const AttentionForwardParams& params, std::size_t* bytes) {
  if (bytes == nullptr) return Status::InvalidArgument("bytes", "null pointer");
  *bytes = 0;
  detail::AttentionShape shape;
  FLARE_RETURN_IF_ERROR(detail::validate_attention_forward(params, DeviceKind::kCUDA, &shape));
#ifdef FLARE_WITH_HOPPER
  // Only the Hopper kernels take scratch: the dense one's split tiles, the block-sparse one's CTA order.
  const detail::FwdKernelParams kp = detail::make_fwd_kernel_params(params, shape);
  if (params.block_mask == nullptr && dense_forward_on_hopper(params, kp))
    *bytes = hopper::hopper_forward_workspace_bytes(kp, params.q.dtype);
  if (params.block_mask != nullptr && params.backend != Backend::kPortable && params.backend != Backend::kReference &&
      hopper::hopper_forward_check(kp, params.q.dtype).ok())
    *bytes = hopper::hopper_forward_sparse_workspace_bytes(kp, params.block_mask->element.doc_ids_q.data != nullptr);
#endif
  return Status::Ok();
}

Status attention_forward(const AttentionForwardParams& params) {
  detail::AttentionShape shape;
  FLARE_RETURN_IF_ERROR(detail::validate_attention_forward(params, DeviceKind::kCUDA, &shape));
  const detail::FwdKernelParams kp = detail::make_fwd_kernel_params(params, shape);
  if (params.block_mask != nullptr) return block_sparse_forward(params, shape, kp);
  switch (params.backend) {
    case Backend::kReference:
      return detail::naive_attention_forward(kp, params.q.dtype, params.stream);
    case Backend::kAuto:
#ifdef FLARE_WITH_HOPPER
      if (dense_forward_on_hopper(params, kp)) return hopper::hopper_attention_forward(kp, params.q.dtype, params.stream);
#endif
      return portable::portable_attention_forward(kp, params.q.dtype, params.stream);
    case Backend::kPortable:
      return portable::portable_attention_forward(kp, params.q.dtype, params.stream);
    case Backend::kHopper:
#ifdef FLARE_WITH_HOPPER
      if (dense_forward_on_hopper(params, kp)) return hopper::hopper_attention_forward(kp, params.q.dtype, params.stream);
      return hopper::hopper_forward_check(kp, params.q.dtype);  // its error
#else
      return Status::NotSupported("backend: this build has no Hopper kernels (FLARE_HOPPER_ARCHS is empty)");
#endif
  }
  return Status::NotSupported("attention forward: unknown backend");
}

namespace {

struct BackwardPlan {
  detail::AttentionShape shape;
  portable::BwdBlocks blocks;
  detail::BwdWorkspaceLayout layout;
  bool hopper = false;  // the Hopper kernel, else the portable one
  int dq_chains = 1;     // deterministic dQ semaphores per query block
  int dq_replicas = 1;   // deterministic Hopper dense: copies of the dQ accumulator
  sched::TailSplit tail;  // the Hopper grid's last tiles split (ordinary dense, uniform tiles)
  detail::BlockMaskShape mask_shape;  // with a block mask
};

// The deterministic block-sparse backward's plan must be the one for this attention and mask.
Status check_dq_plan(const AttentionBackwardParams& p, const detail::AttentionShape& shape,
                     const detail::BlockMaskShape& mask) {
  const BlockSparseDqPlan* plan = p.block_mask_dq_plan;
  if (plan == nullptr || p.block_mask_dq_plan_data == nullptr)
    return Status::InvalidArgument("block_mask_dq_plan",
                                   "deterministic with a block_mask needs the mask's plan (make_block_sparse_dq_plan) "
                                   "and its data on the device (block_mask_dq_plan_data)");
  if (reinterpret_cast<uintptr_t>(p.block_mask_dq_plan_data) % 4 != 0)
    return Status::InvalidArgument("block_mask_dq_plan_data", "must be 4-byte aligned");
  auto differs = [](const char* what, int64_t planned, int64_t here) {
    return Status::InvalidArgument("block_mask_dq_plan", std::string("made for ") + what + " " +
                                                             std::to_string(planned) + ", this backward has " +
                                                             std::to_string(here));
  };
  if (plan->batch != shape.batch) return differs("batch", plan->batch, shape.batch);
  if (plan->heads != shape.heads) return differs("heads", plan->heads, shape.heads);
  if (plan->heads_kv != shape.heads_kv) return differs("heads_kv", plan->heads_kv, shape.heads_kv);
  if (plan->num_q_blocks != mask.num_q_blocks) return differs("q blocks", plan->num_q_blocks, mask.num_q_blocks);
  if (plan->num_kv_blocks != mask.num_kv_blocks) return differs("kv blocks", plan->num_kv_blocks, mask.num_kv_blocks);
  if (plan->q_block_size != p.block_mask->q_block_size)
    return differs("q_block_size", plan->q_block_size, p.block_mask->q_block_size);
  if (plan->kv_block_size != p.block_mask->kv_block_size)
    return differs("kv_block_size", plan->kv_block_size, p.block_mask->kv_block_size);
  return Status::Ok();
}

// The block-sparse backward walks the mask's transposed lists (per kv block, the q blocks that see
// it), so those must be given; as in the forward, no varlen.
Status check_block_sparse_backward(const AttentionBackwardParams& p, const detail::AttentionShape& shape,
                                   detail::BlockMaskShape* mask_shape) {
  if (shape.varlen)
    return Status::NotSupported("block_mask: block-sparse attention with varlen sequences (cu_seqlens) is not supported");
  const detail::BlockMaskProblem problem{shape.batch, shape.heads, shape.seqlen_q, shape.seqlen_k};
  FLARE_RETURN_IF_ERROR(detail::validate_block_mask(*p.block_mask, problem, DeviceKind::kCUDA, mask_shape));
  if (!mask_shape->has_transposed_lists)
    return Status::InvalidArgument("block_mask.q_num_blocks",
                                   "the backward needs the transposed lists (q_num_blocks, q_indices, and "
                                   "full_q_num_blocks, full_q_indices with full blocks): build the mask with them");
  if (p.deterministic) FLARE_RETURN_IF_ERROR(check_dq_plan(p, shape, *mask_shape));
  return Status::Ok();
}

#ifdef FLARE_WITH_HOPPER
// The Hopper grid's split of its last tiles (sched::tail_split) where every tile has the same
// steps: batched, no causal mask or window, ordinary mode (the deterministic grid follows its turn
// order). FLARE_HOPPER_BWD_TAIL_SPLIT=0 turns it off (A/B runs).
sched::TailSplit hopper_tail_split(const AttentionBackwardParams& p, const detail::AttentionShape& s,
                                   const portable::BwdBlocks& blocks) {
  static const bool enabled = [] {
    const char* e = std::getenv("FLARE_HOPPER_BWD_TAIL_SPLIT");
    return e == nullptr || e[0] != '0';
  }();
  if (!enabled || s.varlen || p.mask.causal || p.mask.window_left >= 0 || p.mask.window_right >= 0) return {};
  const int step_rows = hopper::hopper_bwd_block_m(blocks.head_dim);
  const int steps = static_cast<int>((s.seqlen_q + step_rows - 1) / step_rows);
  const int64_t tiles = int64_t{(s.seqlen_k + blocks.block_n - 1) / blocks.block_n} * s.heads * s.batch;
  return sched::tail_split(tiles, steps, detail::current_device_facts().num_sms);
}

// The deterministic dense grid's dQ accumulator copies: hopper_bwd_dq_replicas, or
// FLARE_HOPPER_BWD_DQ_REPLICAS=1..4 (A/B runs and the tests of every count; read per call).
int hopper_dq_replicas(int head_dim, int seqlen_k, bool causal) {
  const char* e = std::getenv("FLARE_HOPPER_BWD_DQ_REPLICAS");
  if (e != nullptr && e[0] >= '1' && e[0] <= '4' && e[1] == 0) return e[0] - '0';
  return hopper::hopper_bwd_dq_replicas(head_dim, seqlen_k, causal);
}
#endif

Status plan_backward(const AttentionBackwardParams& p, BackwardPlan* plan) {
  FLARE_RETURN_IF_ERROR(detail::validate_attention_backward(p, DeviceKind::kCUDA, &plan->shape));
  if (p.backend == Backend::kReference)
    return Status::NotSupported("backend: the attention backward has no reference kernel (the CPU oracle is flare::ref)");
  if (p.block_mask != nullptr) FLARE_RETURN_IF_ERROR(check_block_sparse_backward(p, plan->shape, &plan->mask_shape));
  plan->blocks = portable::portable_bwd_blocks(plan->shape.head_dim);
  if (plan->blocks.head_dim == 0)
    return Status::NotSupported("head dim " + std::to_string(plan->shape.head_dim) +
                                ": no backward kernel instantiated for it in this build (see FLARE_HEAD_DIMS)");
#ifdef FLARE_WITH_HOPPER
  // Block masks too (ordinary and deterministic) wherever hopper_backward_sparse_check accepts them.
  const bool sparse = p.block_mask != nullptr;
  if (p.backend == Backend::kAuto || p.backend == Backend::kHopper) {
    const Status hop = sparse ? hopper::hopper_backward_sparse_check(p, plan->blocks.head_dim)
                              : hopper::hopper_backward_check(p, plan->blocks.head_dim);
    if (hop.ok()) {
      plan->hopper = true;
      plan->blocks.block_m = hopper::kHopperBwdBlockM;
      plan->blocks.block_n = hopper::hopper_bwd_block_n(plan->blocks.head_dim);
      plan->dq_chains = hopper::hopper_bwd_dq_chains(plan->blocks.head_dim);
      if (!sparse && !p.deterministic) plan->tail = hopper_tail_split(p, plan->shape, plan->blocks);
      if (!sparse && p.deterministic)
        plan->dq_replicas = hopper_dq_replicas(plan->blocks.head_dim, plan->shape.seqlen_k, p.mask.causal);
    } else if (p.backend == Backend::kHopper) {
      return hop;
    }
  }
#else
  if (p.backend == Backend::kHopper)
    return Status::NotSupported("backend: this build has no Hopper kernels (FLARE_HOPPER_ARCHS is empty)");
#endif
  int64_t sparse_dq = 0, sparse_dkv = 0;  // the deterministic block-sparse backward's semaphores per head
  if (p.block_mask != nullptr && p.deterministic) {
    const int64_t q_tiles = (p.block_mask->q_block_size + plan->blocks.block_m - 1) / plan->blocks.block_m;
    const int64_t kv_tiles = (p.block_mask->kv_block_size + plan->blocks.block_n - 1) / plan->blocks.block_n;
    sparse_dq = int64_t{plan->mask_shape.num_q_blocks} * q_tiles;
    sparse_dkv = int64_t{plan->mask_shape.num_kv_blocks} * kv_tiles;
  }
  const int64_t dkv_tail = plan->tail.active() && plan->shape.heads_kv == plan->shape.heads
                               ? plan->tail.tiles * plan->blocks.block_n * plan->shape.head_dim
                               : 0;
  plan->layout = detail::bwd_workspace_layout(plan->shape, plan->blocks.block_m, plan->blocks.block_n, p.deterministic,
                                              plan->hopper ? plan->blocks.head_dim : 0, plan->dq_chains, sparse_dq,
                                              sparse_dkv, dkv_tail, plan->dq_replicas);
  return Status::Ok();
}

}  // namespace

Status attention_backward_workspace_size(const AttentionBackwardParams& params, std::size_t* bytes) {
  if (bytes == nullptr) return Status::InvalidArgument("bytes", "null pointer");
  BackwardPlan plan;
  FLARE_RETURN_IF_ERROR(plan_backward(params, &plan));
  *bytes = plan.layout.total;
  return Status::Ok();
}

Status attention_backward(const AttentionBackwardParams& params) {
  BackwardPlan plan;
  FLARE_RETURN_IF_ERROR(plan_backward(params, &plan));
  const detail::BwdWorkspaceLayout& l = plan.layout;
  char* ws = static_cast<char*>(params.workspace);
  const bool owned = ws == nullptr;
  if (owned) {
    FLARE_CUDA_RETURN(cudaMallocAsync(reinterpret_cast<void**>(&ws), l.total, params.stream));
  } else if (params.workspace_bytes < l.total) {
    return Status::InvalidArgument("workspace", "needs " + std::to_string(l.total) + " bytes, got " +
                                                    std::to_string(params.workspace_bytes));
  }
  // Everything after dpsum accumulates or counts from zero (but a dq_accum whose first turns store).
  Status st = detail::cuda_status(cudaMemsetAsync(ws + l.zero_from, 0, l.total - l.zero_from, params.stream),
                                  "backward workspace reset");
  if (st.ok()) {
    const detail::BwdKernelParams k = detail::make_bwd_kernel_params(
        params, detail::make_fwd_kernel_params(detail::forward_view(params), plan.shape), plan.shape, l, ws,
        plan.blocks.block_m, plan.blocks.block_n, plan.tail);
    if (params.block_mask != nullptr) {
      const block_sparse::BlockSparseParams bs =
          block_sparse::make_block_sparse_params(*params.block_mask, plan.shape.seqlen_q, plan.shape.seqlen_k);
      const block_sparse::DqPlanView dq_plan =
          params.deterministic ? block_sparse::dq_plan_view(*params.block_mask_dq_plan, params.block_mask_dq_plan_data)
                               : block_sparse::DqPlanView{};
#ifdef FLARE_WITH_HOPPER
      if (plan.hopper)
        st = hopper::hopper_attention_backward_sparse(k, bs, params.deterministic ? &dq_plan : nullptr,
                                                      params.q.dtype, params.stream);
      else
#endif
        st = portable::portable_attention_backward_sparse(k, bs, params.deterministic ? &dq_plan : nullptr,
                                                          params.q.dtype, params.stream);
    } else {
#ifdef FLARE_WITH_HOPPER
      if (plan.hopper) st = hopper::hopper_attention_backward(k, params.q.dtype, params.stream);
      else
#endif
        st = portable::portable_attention_backward(k, params.q.dtype, params.stream);
    }
  }
  if (owned) {
    Status freed = detail::cuda_status(cudaFreeAsync(ws, params.stream), "backward workspace free");
    if (st.ok()) st = freed;
  }
  return st;
}

}  // namespace flare
