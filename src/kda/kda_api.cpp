// The KDA / GDN entry points: validate, size the workspace, build the device args once, launch.
#include <cstdint>
#include <string>

#include "flare/kda.h"
#include "src/kda/kda_args.h"
#include "src/kda/kda_fwd_params.h"

namespace flare {
namespace {

detail::RowStrides row_strides(const TensorView& t) {
  return {t.stride[0], t.stride[1], t.rank > 2 ? t.stride[2] : 0};
}

struct ForwardPlan {
  detail::KdaShape shape;
  int64_t max_chunks = 0;
  detail::KdaWorkspaceLayout layout;
};

Status plan_forward(const KdaForwardParams& p, ForwardPlan* plan) {
  FLARE_RETURN_IF_ERROR(detail::validate_kda_forward(p, DeviceKind::kCUDA, &plan->shape));
  const detail::KdaShape& s = plan->shape;
  for (int dim : {s.key_dim, s.value_dim})
    if (dim != 64 && dim != 128)
      return Status::NotSupported("KDA forward on the GPU: K and V must be 64 or 128, got K = " +
                                  std::to_string(s.key_dim) + ", V = " + std::to_string(s.value_dim));
  const int64_t per_row = (int64_t{s.seqlen} + detail::kKdaChunk - 1) / detail::kKdaChunk;
  // With cu_seqlens each sequence adds at most one partial chunk.
  plan->max_chunks = s.varlen ? per_row + s.num_seqs : per_row * s.batch;
  plan->layout = detail::kda_workspace_layout(plan->max_chunks, s.heads_v, s.key_dim, s.value_dim, s.num_seqs,
                                              dtype_size(p.q.dtype));
  return Status::Ok();
}

}  // namespace

Status kda_forward_workspace_size(const KdaForwardParams& params, size_t* bytes) {
  if (bytes == nullptr) return Status::InvalidArgument("bytes", "null pointer");
  ForwardPlan plan;
  FLARE_RETURN_IF_ERROR(plan_forward(params, &plan));
  *bytes = plan.layout.total;
  return Status::Ok();
}

Status kda_forward(const KdaForwardParams& p) {
  ForwardPlan plan;
  FLARE_RETURN_IF_ERROR(plan_forward(p, &plan));
  const detail::KdaShape& s = plan.shape;
  if (p.workspace_bytes < plan.layout.total || (plan.layout.total > 0 && p.workspace == nullptr))
    return Status::InvalidArgument("workspace", "needs " + std::to_string(plan.layout.total) +
                                                    " bytes (kda_forward_workspace_size), got " +
                                                    std::to_string(p.workspace_bytes));
  if (reinterpret_cast<uintptr_t>(p.workspace) % 256 != 0)
    return Status::InvalidArgument("workspace", "must be 256-byte aligned");

  detail::KdaFwdArgs a{};
  a.q = p.q.data, a.k = p.k.data, a.v = p.v.data, a.g = p.g.data, a.beta = p.beta.data;
  a.A_log = p.A_log.defined() ? p.A_log.ptr<const float>() : nullptr;
  a.dt_bias = p.dt_bias.defined() ? p.dt_bias.ptr<const float>() : nullptr;
  a.initial_state = p.initial_state.defined() ? p.initial_state.ptr<const float>() : nullptr;
  a.cu_seqlens = p.cu_seqlens.defined() ? p.cu_seqlens.data : nullptr;
  a.q_st = row_strides(p.q), a.k_st = row_strides(p.k), a.v_st = row_strides(p.v);
  a.g_st = row_strides(p.g), a.beta_st = row_strides(p.beta);
  a.g_fp32 = p.g.dtype == DType::kFloat32;
  a.beta_fp32 = p.beta.dtype == DType::kFloat32;
  a.cu_int64 = p.cu_seqlens.defined() && p.cu_seqlens.dtype == DType::kInt64;
  a.out = p.out.data, a.out_st = row_strides(p.out);
  a.final_state = p.final_state.defined() ? p.final_state.ptr<float>() : nullptr;

  a.batch = s.batch, a.seqlen = s.seqlen, a.heads = s.heads, a.heads_v = s.heads_v, a.num_seqs = s.num_seqs;
  a.key_dim = s.key_dim, a.value_dim = s.value_dim;
  a.chunks_per_row = static_cast<int>((int64_t{s.seqlen} + detail::kKdaChunk - 1) / detail::kKdaChunk);
  a.max_chunks = static_cast<int>(plan.max_chunks);
  a.varlen = s.varlen, a.scalar_gate = s.scalar_gate;
  a.scale = s.scale;
  const KdaOptions& o = p.options;
  a.qk_l2norm = o.qk_l2norm, a.beta_sigmoid = o.beta_sigmoid, a.gate_in_kernel = o.gate_in_kernel;
  a.beta_factor = o.allow_neg_eigval ? 2.f : 1.f;
  a.lower_bound = o.lower_bound;

  char* ws = static_cast<char*>(p.workspace);
  const detail::KdaWorkspaceLayout& l = plan.layout;
  a.w = ws + l.w, a.u = ws + l.u, a.kg = ws + l.kg, a.qg = ws + l.qg, a.P = ws + l.P;
  a.decay = reinterpret_cast<float*>(ws + l.decay);
  a.chunks = reinterpret_cast<detail::KdaChunk*>(ws + l.chunks);
  a.seq_chunk_begin = reinterpret_cast<int*>(ws + l.seq_chunk_begin);
  return detail::launch_kda_forward(a, p.q.dtype, p.stream);
}

}  // namespace flare
