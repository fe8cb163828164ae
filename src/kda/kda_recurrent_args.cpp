// Validation of the recurrent step's params. The inputs shared with the chunked forward go through
// validate_kda_forward (same rules, same messages); the state pool, its indices and the optional
// final_state are checked here.
#include <cstdint>
#include <limits>
#include <string>

#include "src/common/tensor_checks.h"
#include "src/kda/kda_recurrent_params.h"

namespace flare::detail {
namespace {

std::string str(int64_t x) { return std::to_string(x); }

// The pool: fp32 [P, HV, K, V], each slot a dense [HV, K, V] block; slots may sit any 16-byte
// multiple apart (a slice of a larger cache) but must not overlap.
Status check_pool(const TensorView& t, const KdaShape& s, DeviceKind device) {
  FLARE_RETURN_IF_ERROR(check_operand(t, "state", 4, device));
  FLARE_RETURN_IF_ERROR(check_dtype(t, "state", {DType::kFloat32}));
  if (t.size(0) < 1 || t.size(1) != s.heads_v || t.size(2) != s.key_dim || t.size(3) != s.value_dim)
    return Status::InvalidArgument("state", "expected shape [P, HV = " + str(s.heads_v) + ", K = " + str(s.key_dim) +
                                                ", V = " + str(s.value_dim) + "] with P >= 1, got " + shape_string(t));
  const int64_t slot = int64_t{s.heads_v} * s.key_dim * s.value_dim;
  if (t.stride[2] != s.value_dim || t.stride[1] != int64_t{s.key_dim} * s.value_dim)
    return Status::InvalidArgument("state", "each slot [HV, K, V] must be dense (strides [*, " +
                                                str(int64_t{s.key_dim} * s.value_dim) + ", " + str(s.value_dim) +
                                                ", 1]), got strides [" + str(t.stride[0]) + ", " + str(t.stride[1]) +
                                                ", " + str(t.stride[2]) + ", " + str(t.stride[3]) + "]");
  if (t.size(0) > 1 && t.stride[0] < slot)
    return Status::InvalidArgument("state", "slots overlap: stride of dim 0 (" + str(t.stride[0]) +
                                                ") is below one slot's " + str(slot) + " elements");
  return Status::Ok();
}

// For a CPU view: every index below P (negative ones mean "no state").
Status check_index_values(const TensorView& idx, int64_t num_seqs, int64_t num_slots) {
  const int32_t* x = idx.ptr<const int32_t>();
  for (int64_t n = 0; n < num_seqs; ++n) {
    const int64_t slot = x[n * idx.stride[0]];
    if (slot >= num_slots)
      return Status::InvalidArgument("state_indices", "entry " + str(n) + " is " + str(slot) + ", beyond the " +
                                                          str(num_slots) + " slots of state");
  }
  return Status::Ok();
}

}  // namespace

Status validate_kda_recurrent(const KdaRecurrentParams& p, DeviceKind device, KdaRecurrentShape* s) {
  *s = KdaRecurrentShape{};
  KdaForwardParams inputs;
  inputs.q = p.q, inputs.k = p.k, inputs.v = p.v, inputs.g = p.g, inputs.beta = p.beta;
  inputs.A_log = p.A_log, inputs.dt_bias = p.dt_bias, inputs.cu_seqlens = p.cu_seqlens;
  inputs.out = p.out;
  inputs.options = p.options;
  FLARE_RETURN_IF_ERROR(validate_kda_forward(inputs, device, &s->base));
  const KdaShape& b = s->base;
  const int64_t N = b.num_seqs;
  // One CTA per (sequence, value head, slice of at least 16 value columns), on a 32-bit grid.
  const int64_t ctas = N * b.heads_v * (b.value_dim / 16);
  if (ctas > std::numeric_limits<int32_t>::max())
    return Status::InvalidArgument(p.cu_seqlens.defined() ? "cu_seqlens" : "q",
                                   "N x HV x V / 16 = " + str(ctas) + " overflows the 32-bit grid");

  if (p.state.defined()) {
    FLARE_RETURN_IF_ERROR(check_pool(p.state, b, device));
    s->num_slots = static_cast<int>(p.state.size(0));
  }
  if (p.state_indices.defined()) {
    if (!p.state.defined())
      return Status::InvalidArgument("state_indices", "given without state, the pool it indexes");
    FLARE_RETURN_IF_ERROR(check_elementwise_operand(p.state_indices, "state_indices", 1, device));
    FLARE_RETURN_IF_ERROR(check_dtype(p.state_indices, "state_indices", {DType::kInt32}));
    FLARE_RETURN_IF_ERROR(check_shape(p.state_indices, "state_indices", {N}));
    if (device == DeviceKind::kCPU) FLARE_RETURN_IF_ERROR(check_index_values(p.state_indices, N, s->num_slots));
    s->indexed = true;
  } else if (p.state.defined() && s->num_slots != N) {
    return Status::InvalidArgument("state", "without state_indices sequence n uses slot n: expected P = N = " +
                                                str(N) + " slots, got " + shape_string(p.state));
  }
  if (p.final_state.defined()) {
    FLARE_RETURN_IF_ERROR(check_operand(p.final_state, "final_state", 4, device));
    FLARE_RETURN_IF_ERROR(check_dtype(p.final_state, "final_state", {DType::kFloat32}));
    FLARE_RETURN_IF_ERROR(check_shape(p.final_state, "final_state", {N, b.heads_v, b.key_dim, b.value_dim}));
    if (!p.final_state.is_contiguous())
      return Status::InvalidArgument("final_state", "must be contiguous ([N, HV, K, V] row-major)");
  }
  return Status::Ok();
}

}  // namespace flare::detail
