// The attention entry points: validate, build device params once, pick the kernel family.
#include "flare/attention.h"
#include "src/attention/attention_args.h"
#include "src/attention/fwd_params.h"
#include "src/attention/bwd_params.h"
#include "src/attention/portable/bwd_launch.h"
#include "src/attention/portable/fwd_launch.h"
#include "src/common/cuda_check.h"

namespace flare {

Status attention_forward(const AttentionForwardParams& params) {
  detail::AttentionShape shape;
  FLARE_RETURN_IF_ERROR(detail::validate_attention_forward(params, DeviceKind::kCUDA, &shape));
  if (params.block_mask != nullptr) return Status::NotSupported("block-sparse attention forward is not built yet");
  const detail::FwdKernelParams kp = detail::make_fwd_kernel_params(params, shape);
  switch (params.backend) {
    case Backend::kReference:
      return detail::naive_attention_forward(kp, params.q.dtype, params.stream);
    case Backend::kAuto:
    case Backend::kPortable:
      return portable::portable_attention_forward(kp, params.q.dtype, params.stream);
    case Backend::kHopper:
      break;
  }
  return Status::NotSupported("attention forward: requested backend is not built yet");
}

namespace {

// The forward's view of a backward call: the same inputs, mask and scalars.
AttentionForwardParams forward_view(const AttentionBackwardParams& b) {
  AttentionForwardParams f;
  f.q = b.q;
  f.k = b.k;
  f.v = b.v;
  f.out = b.out;
  f.lse = b.lse;
  f.cu_seqlens_q = b.cu_seqlens_q;
  f.cu_seqlens_k = b.cu_seqlens_k;
  f.max_seqlen_q = b.max_seqlen_q;
  f.max_seqlen_k = b.max_seqlen_k;
  f.softmax_scale = b.softmax_scale;
  f.softcap = b.softcap;
  f.sinks = b.sinks;
  f.mask = b.mask;
  return f;
}

struct BackwardPlan {
  detail::AttentionShape shape;
  portable::BwdBlocks blocks;
  detail::BwdWorkspaceLayout layout;
};

Status plan_backward(const AttentionBackwardParams& p, BackwardPlan* plan) {
  FLARE_RETURN_IF_ERROR(detail::validate_attention_backward(p, DeviceKind::kCUDA, &plan->shape));
  if (p.block_mask != nullptr) return Status::NotSupported("block-sparse attention backward is not built yet");
  if (p.backend == Backend::kHopper || p.backend == Backend::kReference)
    return Status::NotSupported("attention backward: only the portable backend is built");
  plan->blocks = portable::portable_bwd_blocks(plan->shape.head_dim);
  if (plan->blocks.head_dim == 0)
    return Status::NotSupported("head dim " + std::to_string(plan->shape.head_dim) +
                                ": no backward kernel instantiated for it in this build (see FLARE_HEAD_DIMS)");
  plan->layout = detail::bwd_workspace_layout(plan->shape, plan->blocks.block_m, plan->blocks.block_n, p.deterministic);
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
  // Everything after dpsum accumulates or counts from zero.
  Status st = detail::cuda_status(cudaMemsetAsync(ws + l.dq_accum, 0, l.total - l.dq_accum, params.stream),
                                  "backward workspace reset");
  if (st.ok()) {
    detail::BwdKernelParams k;
    k.fwd = detail::make_fwd_kernel_params(forward_view(params), plan.shape);
    const bool varlen = plan.shape.varlen;
    k.dout = params.dout.data;
    k.dout_str = detail::row_strides(params.dout, varlen);
    k.dq = params.dq.data;
    k.dk = params.dk.data;
    k.dv = params.dv.data;
    k.dq_str = detail::row_strides(params.dq, varlen);
    k.dk_str = detail::row_strides(params.dk, varlen);
    k.dv_str = detail::row_strides(params.dv, varlen);
    k.dsinks = static_cast<float*>(params.dsinks.data);
    k.dpsum = reinterpret_cast<float*>(ws + l.dpsum);
    k.dq_accum = reinterpret_cast<float*>(ws + l.dq_accum);
    if (l.dk_accum != l.dv_accum) {
      k.dk_accum = reinterpret_cast<float*>(ws + l.dk_accum);
      k.dv_accum = reinterpret_cast<float*>(ws + l.dv_accum);
    }
    k.deterministic = params.deterministic;
    if (params.deterministic) {
      k.dq_semaphore = reinterpret_cast<int*>(ws + l.dq_semaphore);
      k.dkv_semaphore = reinterpret_cast<int*>(ws + l.dkv_semaphore);
    }
    k.num_m_blocks = (plan.shape.seqlen_q + plan.blocks.block_m - 1) / plan.blocks.block_m;
    k.num_n_blocks = (plan.shape.seqlen_k + plan.blocks.block_n - 1) / plan.blocks.block_n;
    st = portable::portable_attention_backward(k, params.q.dtype, params.stream);
  }
  if (owned) {
    Status freed = detail::cuda_status(cudaFreeAsync(ws, params.stream), "backward workspace free");
    if (st.ok()) st = freed;
  }
  return st;
}

}  // namespace flare
