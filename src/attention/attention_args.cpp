#include "src/attention/attention_args.h"

#include <cmath>
#include <limits>
#include <string>

#include "src/common/tensor_checks.h"

namespace flare::detail {
namespace {

constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();

// The fields forward and backward share.
struct CommonArgs {
  const TensorView &q, &k, &v, &cu_q, &cu_k, &sinks;
  int max_seqlen_q, max_seqlen_k;
  float scale, softcap;
  const MaskParams& mask;
};

Status validate_common(const CommonArgs& a, DeviceKind device, AttentionShape* s) {
  const bool varlen = a.cu_q.defined() || a.cu_k.defined();
  const int rank = varlen ? 3 : 4;
  if (a.cu_q.defined() != a.cu_k.defined())
    return Status::InvalidArgument(a.cu_q.defined() ? "cu_seqlens_k" : "cu_seqlens_q",
                                   "cu_seqlens_q and cu_seqlens_k must be given together");
  for (auto [t, name] : {std::pair{&a.q, "q"}, {&a.k, "k"}, {&a.v, "v"}}) {
    FLARE_RETURN_IF_ERROR(check_operand(*t, name, rank, device));
    FLARE_RETURN_IF_ERROR(check_dtype(*t, name, {DType::kFloat16, DType::kBFloat16}));
  }
  FLARE_RETURN_IF_ERROR(check_same_dtype(a.k, "k", a.q, "q"));
  FLARE_RETURN_IF_ERROR(check_same_dtype(a.v, "v", a.q, "q"));

  s->varlen = varlen;
  s->heads = static_cast<int>(a.q.size(-2));
  s->heads_kv = static_cast<int>(a.k.size(-2));
  s->head_dim = static_cast<int>(a.q.size(-1));
  if (s->head_dim <= 0 || s->head_dim > kMaxHeadDim || s->head_dim % 8 != 0)
    return Status::InvalidArgument("q", "head dim " + std::to_string(s->head_dim) +
                                            " not supported: must be a multiple of 8 in [8, " +
                                            std::to_string(kMaxHeadDim) + "]");
  if (a.k.size(-1) != s->head_dim)
    return Status::InvalidArgument("k", "head dim " + std::to_string(a.k.size(-1)) + " differs from q's " +
                                            std::to_string(s->head_dim));
  if (a.v.size(-1) != s->head_dim)
    return Status::InvalidArgument("v", "head dim " + std::to_string(a.v.size(-1)) + " differs from q's " +
                                            std::to_string(s->head_dim));
  if (s->heads <= 0 || s->heads_kv <= 0 || s->heads % s->heads_kv != 0)
    return Status::InvalidArgument("k", "kv heads (" + std::to_string(s->heads_kv) + ") must divide q heads (" +
                                            std::to_string(s->heads) + ")");
  for (int d = 0; d < rank - 1; ++d)
    if (a.v.shape[d] != a.k.shape[d])
      return Status::InvalidArgument("v", "shape " + shape_string(a.v) + " must match k's " + shape_string(a.k) +
                                              " but for the head dim");

  if (varlen) {
    s->batch = static_cast<int>(a.cu_q.size(0) - 1);
    s->total_q = a.q.size(0);
    s->total_k = a.k.size(0);
    if (a.cu_q.rank != 1 || s->batch < 1)
      return Status::InvalidArgument("cu_seqlens_q", "expected shape [batch + 1] with batch >= 1, got " +
                                                         shape_string(a.cu_q));
    if (a.max_seqlen_q <= 0) return Status::InvalidArgument("max_seqlen_q", "must be > 0 with cu_seqlens");
    if (a.max_seqlen_k <= 0) return Status::InvalidArgument("max_seqlen_k", "must be > 0 with cu_seqlens");
    s->seqlen_q = a.max_seqlen_q;
    s->seqlen_k = a.max_seqlen_k;
    for (auto [t, name] : {std::pair{&a.cu_q, "cu_seqlens_q"}, {&a.cu_k, "cu_seqlens_k"}})
      FLARE_RETURN_IF_ERROR(check_device(*t, name, device));
    FLARE_RETURN_IF_ERROR(check_cu_seqlens(a.cu_q, "cu_seqlens_q", s->batch, s->total_q, a.max_seqlen_q));
    FLARE_RETURN_IF_ERROR(check_cu_seqlens(a.cu_k, "cu_seqlens_k", s->batch, s->total_k, a.max_seqlen_k));
  } else {
    s->batch = static_cast<int>(a.q.size(0));
    s->seqlen_q = static_cast<int>(a.q.size(1));
    s->seqlen_k = static_cast<int>(a.k.size(1));
    if (a.k.size(0) != s->batch)
      return Status::InvalidArgument("k", "batch " + std::to_string(a.k.size(0)) + " differs from q's " +
                                              std::to_string(s->batch));
    s->total_q = int64_t{s->batch} * s->seqlen_q;
    s->total_k = int64_t{s->batch} * s->seqlen_k;
  }
  // Rows of (batch, head, query) are indexed with 32-bit grid coordinates and LSE offsets.
  if (s->total_q * s->heads > kInt32Max)
    return Status::InvalidArgument("q", "tokens x heads = " + std::to_string(s->total_q * s->heads) +
                                            " overflows 32-bit indexing");
  if (s->total_k * s->heads_kv > kInt32Max)
    return Status::InvalidArgument("k", "tokens x heads = " + std::to_string(s->total_k * s->heads_kv) +
                                            " overflows 32-bit indexing");

  if (!(a.scale >= 0.f) || !std::isfinite(a.scale))
    return Status::InvalidArgument("softmax_scale", "must be finite and >= 0 (0 means 1/sqrt(head_dim))");
  s->softmax_scale = a.scale > 0.f ? a.scale : 1.f / std::sqrt(static_cast<float>(s->head_dim));
  if (!(a.softcap >= 0.f) || !std::isfinite(a.softcap))
    return Status::InvalidArgument("softcap", "must be finite and >= 0 (0 disables it)");
  if (a.mask.window_left < -1) return Status::InvalidArgument("mask.window_left", "must be >= -1 (-1: unbounded)");
  if (a.mask.window_right < -1) return Status::InvalidArgument("mask.window_right", "must be >= -1 (-1: unbounded)");
  if (a.mask.causal && a.mask.window_right > 0)
    return Status::InvalidArgument("mask.window_right", "must be -1 or 0 with causal (causal means 0)");
  if (a.sinks.defined()) {
    FLARE_RETURN_IF_ERROR(check_defined(a.sinks, "sinks"));
    FLARE_RETURN_IF_ERROR(check_dtype(a.sinks, "sinks", {DType::kFloat32}));
    FLARE_RETURN_IF_ERROR(check_shape(a.sinks, "sinks", {s->heads}));
    FLARE_RETURN_IF_ERROR(check_device(a.sinks, "sinks", device));
  }
  return Status::Ok();
}

Status check_lse(const TensorView& lse, const AttentionShape& s, DeviceKind device) {
  FLARE_RETURN_IF_ERROR(check_defined(lse, "lse"));
  FLARE_RETURN_IF_ERROR(check_dtype(lse, "lse", {DType::kFloat32}));
  FLARE_RETURN_IF_ERROR(check_device(lse, "lse", device));
  if (s.varlen) FLARE_RETURN_IF_ERROR(check_shape(lse, "lse", {s.heads, s.total_q}));
  else FLARE_RETURN_IF_ERROR(check_shape(lse, "lse", {s.batch, s.heads, s.seqlen_q}));
  if (!lse.is_contiguous()) return Status::InvalidArgument("lse", "must be contiguous");
  return Status::Ok();
}

}  // namespace

Status validate_attention_forward(const AttentionForwardParams& p, DeviceKind device, AttentionShape* shape) {
  FLARE_RETURN_IF_ERROR(validate_common({p.q, p.k, p.v, p.cu_seqlens_q, p.cu_seqlens_k, p.sinks, p.max_seqlen_q,
                                         p.max_seqlen_k, p.softmax_scale, p.softcap, p.mask},
                                        device, shape));
  FLARE_RETURN_IF_ERROR(check_like(p.out, "out", p.q, "q", device));
  if (p.lse.defined()) FLARE_RETURN_IF_ERROR(check_lse(p.lse, *shape, device));
  return Status::Ok();
}

Status validate_attention_backward(const AttentionBackwardParams& p, DeviceKind device, AttentionShape* shape) {
  FLARE_RETURN_IF_ERROR(validate_common({p.q, p.k, p.v, p.cu_seqlens_q, p.cu_seqlens_k, p.sinks, p.max_seqlen_q,
                                         p.max_seqlen_k, p.softmax_scale, p.softcap, p.mask},
                                        device, shape));
  FLARE_RETURN_IF_ERROR(check_like(p.out, "out", p.q, "q", device));
  FLARE_RETURN_IF_ERROR(check_like(p.dout, "dout", p.q, "q", device));
  if (!p.lse.defined()) return Status::InvalidArgument("lse", "required by the backward (from the forward)");
  FLARE_RETURN_IF_ERROR(check_lse(p.lse, *shape, device));
  FLARE_RETURN_IF_ERROR(check_like(p.dq, "dq", p.q, "q", device));
  FLARE_RETURN_IF_ERROR(check_like(p.dk, "dk", p.k, "k", device));
  FLARE_RETURN_IF_ERROR(check_like(p.dv, "dv", p.v, "v", device));
  if (p.sinks.defined() != p.dsinks.defined())
    return Status::InvalidArgument("dsinks", "required exactly when sinks are given");
  if (p.dsinks.defined()) {
    FLARE_RETURN_IF_ERROR(check_defined(p.dsinks, "dsinks"));
    FLARE_RETURN_IF_ERROR(check_dtype(p.dsinks, "dsinks", {DType::kFloat32}));
    FLARE_RETURN_IF_ERROR(check_shape(p.dsinks, "dsinks", {shape->heads}));
    FLARE_RETURN_IF_ERROR(check_device(p.dsinks, "dsinks", device));
  }
  if (p.workspace == nullptr && p.workspace_bytes != 0)
    return Status::InvalidArgument("workspace", "null with workspace_bytes != 0");
  return Status::Ok();
}

}  // namespace flare::detail
