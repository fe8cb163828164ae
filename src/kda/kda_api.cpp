// The KDA / GDN entry points: validate, size the workspace, build the device args once, launch.
#include <cstdint>
#include <cstdlib>
#include <string>

#include "flare/kda.h"
#include "src/common/device_facts.h"
#include "src/kda/kda_args.h"
#include "src/kda/kda_bwd_params.h"
#include "src/kda/kda_fwd_params.h"
#include "src/kda/kda_prep_order.h"
#include "src/kda/kda_state_forms.h"
#include "src/kda/kda_state_segments.h"

namespace flare {
namespace {

detail::RowStrides row_strides(const TensorView& t) {
  return {t.stride[0], t.stride[1], t.rank > 2 ? t.stride[2] : 0};
}

// The GPU kernels are instantiated for K and V in {64, 128}.
Status check_gpu_head_dims(const detail::KdaShape& s, const char* op) {
  for (int dim : {s.key_dim, s.value_dim})
    if (dim != 64 && dim != 128)
      return Status::NotSupported(std::string(op) + " on the GPU: K and V must be 64 or 128, got K = " +
                                  std::to_string(s.key_dim) + ", V = " + std::to_string(s.value_dim));
  return Status::Ok();
}

// Chunks of 64 tokens that never straddle a sequence: with cu_seqlens each sequence adds at most
// one partial chunk.
int64_t chunks_per_row_of(const detail::KdaShape& s) {
  return (int64_t{s.seqlen} + detail::kKdaChunk - 1) / detail::kKdaChunk;
}

int64_t max_chunks_of(const detail::KdaShape& s) {
  const int64_t per_row = chunks_per_row_of(s);
  return s.varlen ? per_row + s.num_seqs : per_row * s.batch;
}

// The backward's workspace layout (the forward's arrays first) for a shape and options.
detail::KdaBwdWorkspaceLayout backward_layout(const detail::KdaShape& s, int64_t max_chunks, DType dtype,
                                              const KdaOptions& o) {
  return detail::kda_bwd_workspace_layout(max_chunks, s.heads, s.heads_v, s.key_dim, s.value_dim, s.num_seqs,
                                          int64_t{s.batch} * s.seqlen, dtype_size(dtype), o.gate_in_kernel);
}

struct ForwardPlan {
  detail::KdaShape shape;
  int64_t max_chunks = 0;
  detail::KdaWorkspaceLayout layout;
  size_t total = 0;      // the workspace's size: layout.total, or the backward's with keep_for_backward
  size_t A_inv = 0;      // keep_for_backward: where A goes (the backward's offset)
  detail::KdaStateSegments segments;
  size_t seg_transition = 0, seg_start = 0;  // offsets of the segmented pass's arrays (after the rest)
};

// The segmentation of the state pass on the current device (FLARE_KDA_STATE_SEGMENT=<chunks>
// forces a segment length, FLARE_KDA_SEGMENT0_WEIGHT=<percent> weights segment 0: tests, tuning).
detail::KdaStateSegments state_segments_of(const detail::KdaShape& s) {
  const int64_t chunks_per_row = chunks_per_row_of(s);
  const int64_t wide_ctas = int64_t{s.num_seqs} * s.heads_v * (s.value_dim / (s.value_dim < 128 ? s.value_dim : 128));
  const char* env = std::getenv("FLARE_KDA_STATE_SEGMENT");
  const int forced = env != nullptr ? std::atoi(env) : 0;
  const char* weight_env = std::getenv("FLARE_KDA_SEGMENT0_WEIGHT");
  const int weight =
      weight_env != nullptr ? std::atoi(weight_env) : kda::default_segment0_weight(s.key_dim, s.value_dim);
  return detail::kda_state_segments(wide_ctas, chunks_per_row, s.varlen, detail::current_device_facts().num_sms,
                                    forced, weight);
}

Status plan_forward(const KdaForwardParams& p, ForwardPlan* plan) {
  FLARE_RETURN_IF_ERROR(detail::validate_kda_forward(p, DeviceKind::kCUDA, &plan->shape));
  const detail::KdaShape& s = plan->shape;
  FLARE_RETURN_IF_ERROR(check_gpu_head_dims(s, "KDA forward"));
  plan->max_chunks = max_chunks_of(s);
  plan->layout = detail::kda_workspace_layout(plan->max_chunks, s.heads_v, s.key_dim, s.value_dim, s.num_seqs,
                                              dtype_size(p.q.dtype));
  plan->total = plan->layout.total;
  plan->segments = state_segments_of(s);
  size_t transition_bytes = 0;
  const size_t seg_bytes = plan->segments.count > 1
                               ? detail::kda_segment_bytes(s.num_seqs, s.heads_v, s.key_dim, s.value_dim,
                                                           plan->segments.count, &transition_bytes)
                               : 0;
  if (p.keep_for_backward) {
    // The backward's layout, whose size is the contract of keep_for_backward; the segmented pass's
    // arrays go in its dh array (the backward's scratch, untouched by the forward), which holds
    // them for every count the rule picks (at least 16 chunks per segment); a forced count that
    // does not fit runs unsegmented.
    const detail::KdaBwdWorkspaceLayout bwd = backward_layout(s, plan->max_chunks, p.q.dtype, p.options);
    plan->total = bwd.total;
    plan->A_inv = bwd.A_inv;
    if (seg_bytes > bwd.vnew - bwd.dh) plan->segments = {};
    plan->seg_transition = bwd.dh;
  } else {
    plan->seg_transition = plan->total;
    plan->total += seg_bytes;
  }
  plan->seg_start = plan->seg_transition + transition_bytes;
  return Status::Ok();
}

Status check_workspace(const void* workspace, size_t bytes, size_t needed, const char* sizer) {
  if (bytes < needed || (needed > 0 && workspace == nullptr))
    return Status::InvalidArgument("workspace", "needs " + std::to_string(needed) + " bytes (" + sizer + "), got " +
                                                    std::to_string(bytes));
  if (reinterpret_cast<uintptr_t>(workspace) % 256 != 0)
    return Status::InvalidArgument("workspace", "must be 256-byte aligned");
  return Status::Ok();
}

// The inputs, shape and options both directions pass to the kernels (and the prep's workspace).
template <typename Params>
detail::KdaFwdArgs input_args(const Params& p, const detail::KdaShape& s, int64_t max_chunks,
                              const detail::KdaWorkspaceLayout& l) {
  detail::KdaFwdArgs a{};
  a.q = p.q.data, a.k = p.k.data, a.v = p.v.data, a.g = p.g.data, a.beta = p.beta.data;
  a.A_log = p.A_log.defined() ? p.A_log.template ptr<const float>() : nullptr;
  a.dt_bias = p.dt_bias.defined() ? p.dt_bias.template ptr<const float>() : nullptr;
  a.initial_state = p.initial_state.defined() ? p.initial_state.template ptr<const float>() : nullptr;
  a.cu_seqlens = p.cu_seqlens.defined() ? p.cu_seqlens.data : nullptr;
  a.q_st = row_strides(p.q), a.k_st = row_strides(p.k), a.v_st = row_strides(p.v);
  a.g_st = row_strides(p.g), a.beta_st = row_strides(p.beta);
  a.g_fp32 = p.g.dtype == DType::kFloat32;
  a.beta_fp32 = p.beta.dtype == DType::kFloat32;
  a.cu_int64 = p.cu_seqlens.defined() && p.cu_seqlens.dtype == DType::kInt64;

  a.batch = s.batch, a.seqlen = s.seqlen, a.heads = s.heads, a.heads_v = s.heads_v, a.num_seqs = s.num_seqs;
  a.key_dim = s.key_dim, a.value_dim = s.value_dim;
  a.chunks_per_row = static_cast<int>(chunks_per_row_of(s));
  a.max_chunks = static_cast<int>(max_chunks);
  a.prep_order = detail::kHeadMajorReversed;  // measured best (kda_prep_order.h)
  if (const char* env = std::getenv("FLARE_KDA_PREP_ORDER")) {  // tuning
    const int order = std::atoi(env);
    if (order == detail::kChunkMajor || order == detail::kHeadMajor || order == detail::kHeadMajorReversed) a.prep_order = order;
  }
  a.varlen = s.varlen, a.scalar_gate = s.scalar_gate;
  a.scale = s.scale;
  const KdaOptions& o = p.options;
  a.qk_l2norm = o.qk_l2norm, a.beta_sigmoid = o.beta_sigmoid, a.gate_in_kernel = o.gate_in_kernel;
  a.beta_factor = o.allow_neg_eigval ? 2.f : 1.f;
  a.lower_bound = o.lower_bound;

  char* ws = static_cast<char*>(p.workspace);
  a.w = ws + l.w, a.u = ws + l.u, a.kg = ws + l.kg, a.qg = ws + l.qg, a.P = ws + l.P;
  a.decay = reinterpret_cast<float*>(ws + l.decay);
  a.chunks = reinterpret_cast<detail::KdaChunk*>(ws + l.chunks);
  a.seq_chunk_begin = reinterpret_cast<int*>(ws + l.seq_chunk_begin);
  a.seq_order = reinterpret_cast<int*>(ws + l.seq_order);
  return a;
}

struct BackwardPlan {
  detail::KdaShape shape;
  int64_t max_chunks = 0;
  detail::KdaBwdWorkspaceLayout layout;
};

Status plan_backward(const KdaBackwardParams& p, BackwardPlan* plan) {
  FLARE_RETURN_IF_ERROR(detail::validate_kda_backward(p, DeviceKind::kCUDA, &plan->shape));
  const detail::KdaShape& s = plan->shape;
  FLARE_RETURN_IF_ERROR(check_gpu_head_dims(s, "KDA backward"));
  plan->max_chunks = max_chunks_of(s);
  plan->layout = backward_layout(s, plan->max_chunks, p.q.dtype, p.options);
  return Status::Ok();
}

}  // namespace

Status kda_forward_workspace_size(const KdaForwardParams& params, size_t* bytes) {
  if (bytes == nullptr) return Status::InvalidArgument("bytes", "null pointer");
  ForwardPlan plan;
  FLARE_RETURN_IF_ERROR(plan_forward(params, &plan));
  *bytes = plan.total;
  return Status::Ok();
}

Status kda_forward(const KdaForwardParams& p) {
  ForwardPlan plan;
  FLARE_RETURN_IF_ERROR(plan_forward(p, &plan));
  FLARE_RETURN_IF_ERROR(check_workspace(p.workspace, p.workspace_bytes, plan.total, "kda_forward_workspace_size"));
  detail::KdaFwdArgs a = input_args(p, plan.shape, plan.max_chunks, plan.layout);
  if (p.keep_for_backward) a.A_inv = static_cast<char*>(p.workspace) + plan.A_inv;
  if (plan.segments.count > 1) {
    a.state_segments = plan.segments.count, a.segment_chunks = plan.segments.chunks;
    a.first_segment_chunks = plan.segments.first;
    a.seg_transition = reinterpret_cast<float*>(static_cast<char*>(p.workspace) + plan.seg_transition);
    a.seg_start = reinterpret_cast<float*>(static_cast<char*>(p.workspace) + plan.seg_start);
  }
  a.out = p.out.data, a.out_st = row_strides(p.out);
  a.final_state = p.final_state.defined() ? p.final_state.ptr<float>() : nullptr;
  return detail::launch_kda_forward(a, p.q.dtype, p.stream);
}

Status kda_backward_workspace_size(const KdaBackwardParams& params, size_t* bytes) {
  if (bytes == nullptr) return Status::InvalidArgument("bytes", "null pointer");
  BackwardPlan plan;
  FLARE_RETURN_IF_ERROR(plan_backward(params, &plan));
  *bytes = plan.layout.total;
  return Status::Ok();
}

Status kda_backward(const KdaBackwardParams& p) {
  detail::KdaBwdArgs b;
  FLARE_RETURN_IF_ERROR(detail::kda_backward_args(p, &b));
  return detail::launch_kda_backward(b, p.q.dtype, p.stream);
}

namespace detail {

Status kda_backward_args(const KdaBackwardParams& p, KdaBwdArgs* out) {
  BackwardPlan plan;
  FLARE_RETURN_IF_ERROR(plan_backward(p, &plan));
  const KdaBwdWorkspaceLayout& l = plan.layout;
  FLARE_RETURN_IF_ERROR(check_workspace(p.workspace, p.workspace_bytes, l.total, "kda_backward_workspace_size"));
  KdaBwdArgs b{};
  b.fwd = input_args(p, plan.shape, plan.max_chunks, l.fwd);
  char* ws = static_cast<char*>(p.workspace);
  b.fwd.A_inv = ws + l.A_inv;
  b.prep_done = p.workspace_from_forward;
  b.dout = p.dout.data, b.dout_st = row_strides(p.dout);
  b.d_final_state = p.d_final_state.defined() ? p.d_final_state.ptr<const float>() : nullptr;
  b.dq = p.dq.data, b.dk = p.dk.data, b.dv = p.dv.data, b.dg = p.dg.data, b.dbeta = p.dbeta.data;
  b.dq_st = row_strides(p.dq), b.dk_st = row_strides(p.dk), b.dv_st = row_strides(p.dv);
  b.dg_st = row_strides(p.dg), b.dbeta_st = row_strides(p.dbeta);
  b.dg_fp32 = p.dg.dtype == DType::kFloat32;
  b.dbeta_fp32 = p.dbeta.dtype == DType::kFloat32;
  b.d_initial_state = p.d_initial_state.defined() ? p.d_initial_state.ptr<float>() : nullptr;
  b.dA_log = p.dA_log.defined() ? p.dA_log.ptr<float>() : nullptr;
  b.ddt_bias = p.ddt_bias.defined() ? p.ddt_bias.ptr<float>() : nullptr;
  b.h = ws + l.h, b.dh = ws + l.dh, b.vnew = ws + l.vnew, b.dvnew = ws + l.dvnew;
  b.gate_partial = l.gate_partial ? reinterpret_cast<float*>(ws + l.gate_partial) : nullptr;
  b.A_log_partial = l.gate_partial ? reinterpret_cast<float*>(ws + l.A_log_partial) : nullptr;
  b.dq_heads = l.dq_heads ? reinterpret_cast<float*>(ws + l.dq_heads) : nullptr;
  b.dk_heads = l.dk_heads ? reinterpret_cast<float*>(ws + l.dk_heads) : nullptr;
  *out = b;
  return Status::Ok();
}

}  // namespace detail
}  // namespace flare
