#include "src/kda/kda_args.h"

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <string>
#include <utility>

#include "src/common/tensor_checks.h"

namespace flare::detail {
namespace {

constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();

std::string str(int64_t x) { return std::to_string(x); }

// How a kernel reads an operand: in 16-byte vectors and TMA tiles along a head dim (q, k, v, a
// per-channel gate, outputs, states), or one element per (token, head) or per index (beta, a
// per-head gate, A_log, dt_bias, cu_seqlens). The second needs only natural alignment: 16-byte
// rows would reject, say, a bf16 beta with HV = 4.
enum class Access { kTiled, kElementwise };

Status check_layout(const TensorView& t, const char* name, int rank, DeviceKind device, Access access) {
  return access == Access::kTiled ? check_operand(t, name, rank, device)
                                  : check_elementwise_operand(t, name, rank, device);
}

Status check_head_dim(int64_t dim, const char* name, const char* what) {
  if (dim < kKdaHeadDimMultiple || dim > kKdaMaxHeadDim || dim % kKdaHeadDimMultiple != 0)
    return Status::InvalidArgument(name, std::string(what) + " " + str(dim) + " not supported: must be a multiple of " +
                                             str(kKdaHeadDimMultiple) + " in [" + str(kKdaHeadDimMultiple) + ", " +
                                             str(kKdaMaxHeadDim) + "]");
  return Status::Ok();
}

// fp32, or `other` (the input's dtype for a gradient, q's for a gate or beta).
Status check_fp32_or(const TensorView& t, const char* name, DType other) {
  if (other == DType::kFloat32) return check_dtype(t, name, {DType::kFloat32});
  return check_dtype(t, name, {DType::kFloat32, other});
}

// States (initial, final and their gradients): fp32 [N, HV, K, V], dense, since the kernels
// address a (sequence, head) state as one [K, V] block.
Status check_state(const TensorView& t, const char* name, const KdaShape& s, DeviceKind device) {
  FLARE_RETURN_IF_ERROR(check_operand(t, name, 4, device));
  FLARE_RETURN_IF_ERROR(check_dtype(t, name, {DType::kFloat32}));
  FLARE_RETURN_IF_ERROR(check_shape(t, name, {s.num_seqs, s.heads_v, s.key_dim, s.value_dim}));
  if (!t.is_contiguous()) return Status::InvalidArgument(name, "must be contiguous ([N, HV, K, V] row-major)");
  return Status::Ok();
}

// For a CPU view: starts at 0, non-decreasing, ends at the T packed tokens.
Status check_cu_seqlens_values(const TensorView& cu, int64_t num_seqs, int64_t tokens) {
  auto entry = [&cu](int64_t i) -> int64_t {
    const int64_t at = i * cu.stride[0];
    return cu.dtype == DType::kInt64 ? cu.ptr<int64_t>()[at] : cu.ptr<int32_t>()[at];
  };
  if (entry(0) != 0) return Status::InvalidArgument("cu_seqlens", "must start at 0, starts at " + str(entry(0)));
  for (int64_t n = 0; n < num_seqs; ++n)
    if (entry(n + 1) < entry(n))
      return Status::InvalidArgument("cu_seqlens", "must be non-decreasing: entry " + str(n + 1) + " (" +
                                                       str(entry(n + 1)) + ") < entry " + str(n) + " (" +
                                                       str(entry(n)) + ")");
  if (entry(num_seqs) != tokens)
    return Status::InvalidArgument("cu_seqlens", "must end at T = " + str(tokens) + " (the packed tokens), ends at " +
                                                     str(entry(num_seqs)));
  return Status::Ok();
}

Status check_options(const KdaOptions& o) {
  if (!(o.scale >= 0.f) || !std::isfinite(o.scale))
    return Status::InvalidArgument("options.scale", "must be finite and >= 0 (0 means K^-0.5)");
  if (!(o.lower_bound <= 0.f) || !std::isfinite(o.lower_bound))
    return Status::InvalidArgument("options.lower_bound",
                                   "must be finite and <= 0 (negative: the gate's lower bound; 0: unset), got " +
                                       std::to_string(o.lower_bound));
  if (o.allow_neg_eigval && !o.beta_sigmoid)
    return Status::InvalidArgument("options.allow_neg_eigval",
                                   "requires options.beta_sigmoid: it widens the in-kernel sigmoid to "
                                   "2 * sigmoid(beta); a beta computed outside is used as given");
  return Status::Ok();
}

// The inputs forward and backward share.
struct KdaInputs {
  const TensorView &q, &k, &v, &g, &beta, &A_log, &dt_bias, &initial_state, &cu_seqlens;
  const KdaOptions& options;
};

Status validate_inputs(const KdaInputs& a, DeviceKind device, KdaShape* s) {
  *s = KdaShape{};
  FLARE_RETURN_IF_ERROR(check_operand(a.q, "q", 4, device));
  FLARE_RETURN_IF_ERROR(check_dtype(a.q, "q", {DType::kFloat16, DType::kBFloat16}));
  s->batch = static_cast<int>(a.q.size(0));
  s->seqlen = static_cast<int>(a.q.size(1));
  s->heads = static_cast<int>(a.q.size(2));
  s->key_dim = static_cast<int>(a.q.size(3));
  if (s->batch < 1) return Status::InvalidArgument("q", "batch B must be >= 1, got " + shape_string(a.q));
  if (s->heads < 1) return Status::InvalidArgument("q", "heads H must be >= 1, got " + shape_string(a.q));
  FLARE_RETURN_IF_ERROR(check_head_dim(s->key_dim, "q", "key dim K"));

  FLARE_RETURN_IF_ERROR(check_operand(a.k, "k", 4, device));
  FLARE_RETURN_IF_ERROR(check_same_dtype(a.k, "k", a.q, "q"));
  FLARE_RETURN_IF_ERROR(check_same_shape(a.k, "k", a.q, "q"));

  FLARE_RETURN_IF_ERROR(check_operand(a.v, "v", 4, device));
  FLARE_RETURN_IF_ERROR(check_same_dtype(a.v, "v", a.q, "q"));
  if (a.v.size(0) != s->batch || a.v.size(1) != s->seqlen)
    return Status::InvalidArgument("v", "expected shape [B = " + str(s->batch) + ", T = " + str(s->seqlen) +
                                            ", HV, V], got " + shape_string(a.v));
  s->heads_v = static_cast<int>(a.v.size(2));
  s->value_dim = static_cast<int>(a.v.size(3));
  if (s->heads_v < 1 || s->heads_v % s->heads != 0)
    return Status::InvalidArgument("v", "value heads HV (" + str(s->heads_v) + ") must be a positive multiple of " +
                                            "the q/k heads H (" + str(s->heads) + ")");
  FLARE_RETURN_IF_ERROR(check_head_dim(s->value_dim, "v", "value dim V"));
  // (token, value head) rows are indexed with 32-bit grid coordinates.
  const int64_t rows = int64_t{s->batch} * s->seqlen * s->heads_v;
  if (rows > kInt32Max)
    return Status::InvalidArgument("v", "B x T x HV = " + str(rows) + " overflows 32-bit indexing");

  const int64_t B = s->batch, T = s->seqlen, HV = s->heads_v, K = s->key_dim;
  FLARE_RETURN_IF_ERROR(check_defined(a.g, "g"));
  if (a.g.rank != 3 && a.g.rank != 4)
    return Status::InvalidArgument("g", "expected shape [B, T, HV, K] (KDA) or [B, T, HV] (GDN), got " +
                                            shape_string(a.g));
  s->scalar_gate = a.g.rank == 3;
  FLARE_RETURN_IF_ERROR(
      check_layout(a.g, "g", a.g.rank, device, s->scalar_gate ? Access::kElementwise : Access::kTiled));
  FLARE_RETURN_IF_ERROR(check_fp32_or(a.g, "g", a.q.dtype));
  if (s->scalar_gate) FLARE_RETURN_IF_ERROR(check_shape(a.g, "g", {B, T, HV}));
  else FLARE_RETURN_IF_ERROR(check_shape(a.g, "g", {B, T, HV, K}));

  FLARE_RETURN_IF_ERROR(check_layout(a.beta, "beta", 3, device, Access::kElementwise));
  FLARE_RETURN_IF_ERROR(check_fp32_or(a.beta, "beta", a.q.dtype));
  FLARE_RETURN_IF_ERROR(check_shape(a.beta, "beta", {B, T, HV}));

  s->varlen = a.cu_seqlens.defined();
  s->num_seqs = s->batch;
  if (s->varlen) {
    const TensorView& cu = a.cu_seqlens;
    FLARE_RETURN_IF_ERROR(check_layout(cu, "cu_seqlens", 1, device, Access::kElementwise));
    FLARE_RETURN_IF_ERROR(check_dtype(cu, "cu_seqlens", {DType::kInt32, DType::kInt64}));
    if (cu.size(0) < 2)
      return Status::InvalidArgument("cu_seqlens", "expected shape [N + 1] with N >= 1, got " + shape_string(cu));
    if (s->batch != 1)
      return Status::InvalidArgument("cu_seqlens", "requires B == 1 (sequences packed along T), got B = " +
                                                       str(s->batch));
    s->num_seqs = static_cast<int>(cu.size(0) - 1);
    if (device == DeviceKind::kCPU) FLARE_RETURN_IF_ERROR(check_cu_seqlens_values(cu, s->num_seqs, T));
  }
  if (a.initial_state.defined()) FLARE_RETURN_IF_ERROR(check_state(a.initial_state, "initial_state", *s, device));

  const KdaOptions& o = a.options;
  FLARE_RETURN_IF_ERROR(check_options(o));
  s->scale = o.scale > 0.f ? o.scale : 1.f / std::sqrt(static_cast<float>(s->key_dim));
  // Only the in-kernel gate reads A_log and dt_bias: given without it, they would be ignored silently.
  if (a.A_log.defined()) {
    if (!o.gate_in_kernel)
      return Status::InvalidArgument("A_log", "given without options.gate_in_kernel, the only thing that reads it");
    FLARE_RETURN_IF_ERROR(check_layout(a.A_log, "A_log", 1, device, Access::kElementwise));
    FLARE_RETURN_IF_ERROR(check_dtype(a.A_log, "A_log", {DType::kFloat32}));
    FLARE_RETURN_IF_ERROR(check_shape(a.A_log, "A_log", {HV}));
  } else if (o.gate_in_kernel && o.lower_bound == 0.f) {
    return Status::InvalidArgument("A_log", "required by options.gate_in_kernel unless options.lower_bound is set");
  }
  if (a.dt_bias.defined()) {
    if (!o.gate_in_kernel)
      return Status::InvalidArgument("dt_bias", "given without options.gate_in_kernel, the only thing that reads it");
    FLARE_RETURN_IF_ERROR(check_layout(a.dt_bias, "dt_bias", 1, device, Access::kElementwise));
    FLARE_RETURN_IF_ERROR(check_dtype(a.dt_bias, "dt_bias", {DType::kFloat32}));
    FLARE_RETURN_IF_ERROR(check_shape(a.dt_bias, "dt_bias", {s->scalar_gate ? HV : HV * K}));
  }
  return Status::Ok();
}

// A gradient that exists exactly when its input does (and, for dA_log / ddt_bias, the gate is in-kernel).
Status check_paired_grad(const TensorView& grad, const char* name, bool wanted, const char* when) {
  if (wanted && !grad.defined()) return Status::InvalidArgument(name, std::string("required when ") + when);
  if (!wanted && grad.defined()) return Status::InvalidArgument(name, std::string("given, but only allowed when ") + when);
  return Status::Ok();
}

}  // namespace

Status validate_kda_forward(const KdaForwardParams& p, DeviceKind device, KdaShape* s) {
  FLARE_RETURN_IF_ERROR(validate_inputs(
      {p.q, p.k, p.v, p.g, p.beta, p.A_log, p.dt_bias, p.initial_state, p.cu_seqlens, p.options}, device, s));
  FLARE_RETURN_IF_ERROR(check_operand(p.out, "out", 4, device));
  FLARE_RETURN_IF_ERROR(check_same_dtype(p.out, "out", p.q, "q"));
  FLARE_RETURN_IF_ERROR(check_same_shape(p.out, "out", p.v, "v"));
  if (p.final_state.defined()) FLARE_RETURN_IF_ERROR(check_state(p.final_state, "final_state", *s, device));
  return Status::Ok();
}

Status validate_kda_backward(const KdaBackwardParams& p, DeviceKind device, KdaShape* s) {
  FLARE_RETURN_IF_ERROR(validate_inputs(
      {p.q, p.k, p.v, p.g, p.beta, p.A_log, p.dt_bias, p.initial_state, p.cu_seqlens, p.options}, device, s));
  FLARE_RETURN_IF_ERROR(check_operand(p.dout, "dout", 4, device));
  FLARE_RETURN_IF_ERROR(check_same_dtype(p.dout, "dout", p.q, "q"));
  FLARE_RETURN_IF_ERROR(check_same_shape(p.dout, "dout", p.v, "v"));
  if (p.d_final_state.defined()) FLARE_RETURN_IF_ERROR(check_state(p.d_final_state, "d_final_state", *s, device));

  FLARE_RETURN_IF_ERROR(check_like(p.dq, "dq", p.q, "q", device));
  FLARE_RETURN_IF_ERROR(check_like(p.dk, "dk", p.k, "k", device));
  FLARE_RETURN_IF_ERROR(check_like(p.dv, "dv", p.v, "v", device));
  FLARE_RETURN_IF_ERROR(
      check_layout(p.dg, "dg", p.g.rank, device, s->scalar_gate ? Access::kElementwise : Access::kTiled));
  FLARE_RETURN_IF_ERROR(check_fp32_or(p.dg, "dg", p.g.dtype));
  FLARE_RETURN_IF_ERROR(check_same_shape(p.dg, "dg", p.g, "g"));
  FLARE_RETURN_IF_ERROR(check_layout(p.dbeta, "dbeta", 3, device, Access::kElementwise));
  FLARE_RETURN_IF_ERROR(check_fp32_or(p.dbeta, "dbeta", p.beta.dtype));
  FLARE_RETURN_IF_ERROR(check_same_shape(p.dbeta, "dbeta", p.beta, "beta"));

  FLARE_RETURN_IF_ERROR(check_paired_grad(p.d_initial_state, "d_initial_state", p.initial_state.defined(),
                                          "initial_state is given"));
  if (p.d_initial_state.defined())
    FLARE_RETURN_IF_ERROR(check_state(p.d_initial_state, "d_initial_state", *s, device));
  const bool gate = p.options.gate_in_kernel;
  FLARE_RETURN_IF_ERROR(check_paired_grad(p.dA_log, "dA_log", gate && p.A_log.defined(),
                                          "options.gate_in_kernel is set and A_log is given"));
  if (p.dA_log.defined()) {
    FLARE_RETURN_IF_ERROR(check_layout(p.dA_log, "dA_log", 1, device, Access::kElementwise));
    FLARE_RETURN_IF_ERROR(check_dtype(p.dA_log, "dA_log", {DType::kFloat32}));
    FLARE_RETURN_IF_ERROR(check_same_shape(p.dA_log, "dA_log", p.A_log, "A_log"));
  }
  FLARE_RETURN_IF_ERROR(check_paired_grad(p.ddt_bias, "ddt_bias", gate && p.dt_bias.defined(),
                                          "options.gate_in_kernel is set and dt_bias is given"));
  if (p.ddt_bias.defined()) {
    FLARE_RETURN_IF_ERROR(check_layout(p.ddt_bias, "ddt_bias", 1, device, Access::kElementwise));
    FLARE_RETURN_IF_ERROR(check_dtype(p.ddt_bias, "ddt_bias", {DType::kFloat32}));
    FLARE_RETURN_IF_ERROR(check_same_shape(p.ddt_bias, "ddt_bias", p.dt_bias, "dt_bias"));
  }
  return Status::Ok();
}

}  // namespace flare::detail
