// flare::kda_recurrent_step: validate, build the device args once, launch. No allocation, no host
// synchronization (CUDA-graph capturable).
#include <string>

#include "flare/kda.h"
#include "src/kda/kda_recurrent_params.h"

namespace flare {
namespace {

detail::RowStrides row_strides(const TensorView& t) {
  return {t.stride[0], t.stride[1], t.rank > 2 ? t.stride[2] : 0};
}

}  // namespace

Status kda_recurrent_step(const KdaRecurrentParams& p) {
  detail::KdaRecurrentShape shape;
  FLARE_RETURN_IF_ERROR(detail::validate_kda_recurrent(p, DeviceKind::kCUDA, &shape));
  const detail::KdaShape& s = shape.base;
  for (int dim : {s.key_dim, s.value_dim})
    if (dim != 64 && dim != 128)
      return Status::NotSupported("KDA recurrent step: K and V must be 64 or 128, got K = " +
                                  std::to_string(s.key_dim) + ", V = " + std::to_string(s.value_dim));

  detail::KdaRecurrentArgs a{};
  a.q = p.q.data, a.k = p.k.data, a.v = p.v.data, a.g = p.g.data, a.beta = p.beta.data;
  a.A_log = p.A_log.defined() ? p.A_log.ptr<const float>() : nullptr;
  a.dt_bias = p.dt_bias.defined() ? p.dt_bias.ptr<const float>() : nullptr;
  a.cu_seqlens = p.cu_seqlens.defined() ? p.cu_seqlens.data : nullptr;
  a.q_st = row_strides(p.q), a.k_st = row_strides(p.k), a.v_st = row_strides(p.v);
  a.g_st = row_strides(p.g), a.beta_st = row_strides(p.beta);
  a.g_fp32 = p.g.dtype == DType::kFloat32;
  a.beta_fp32 = p.beta.dtype == DType::kFloat32;
  a.cu_int64 = p.cu_seqlens.defined() && p.cu_seqlens.dtype == DType::kInt64;
  a.state = p.state.defined() ? p.state.ptr<float>() : nullptr;
  a.slot_stride = p.state.defined() ? p.state.stride[0] : 0;
  a.state_indices = p.state_indices.defined() ? p.state_indices.ptr<const int32_t>() : nullptr;
  a.final_state = p.final_state.defined() ? p.final_state.ptr<float>() : nullptr;
  a.out = p.out.data, a.out_st = row_strides(p.out);

  a.seqlen = s.seqlen, a.heads = s.heads, a.heads_v = s.heads_v, a.num_seqs = s.num_seqs;
  a.num_slots = shape.num_slots;
  a.key_dim = s.key_dim, a.value_dim = s.value_dim;
  a.varlen = s.varlen, a.scalar_gate = s.scalar_gate;
  a.scale = s.scale;
  const KdaOptions& o = p.options;
  a.qk_l2norm = o.qk_l2norm, a.beta_sigmoid = o.beta_sigmoid, a.gate_in_kernel = o.gate_in_kernel;
  a.beta_factor = o.allow_neg_eigval ? 2.f : 1.f;
  a.lower_bound = o.lower_bound;
  return detail::launch_kda_recurrent(a, p.q.dtype, p.stream);
}

}  // namespace flare
