// Picks the Hopper backward's instantiation, after checking that the problem suits it.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <string>

#include "src/attention/hopper/bwd_config.h"
#include "src/attention/hopper/bwd_launch.h"
#include "src/attention/hopper/operand_checks.h"
#include "src/attention/portable/head_dims.h"

namespace flare::hopper {

namespace {

// What the dense and the block-sparse kernels both need: sm_90, no soft-capping, TMA-addressable
// operands.
Status check_device_and_operands(const AttentionBackwardParams& p) {
  FLARE_RETURN_IF_ERROR(check_sm90());
  if (p.softcap > 0.f) return Status::NotSupported("softcap: the Hopper backward does not soft-cap yet");
  const bool varlen = p.cu_seqlens_q.data != nullptr;
  FLARE_RETURN_IF_ERROR(check_tma_operand("q", p.q.data, detail::row_strides(p.q, varlen), varlen));
  FLARE_RETURN_IF_ERROR(check_tma_operand("k", p.k.data, detail::row_strides(p.k, varlen), varlen));
  FLARE_RETURN_IF_ERROR(check_tma_operand("v", p.v.data, detail::row_strides(p.v, varlen), varlen));
  FLARE_RETURN_IF_ERROR(check_tma_operand("dout", p.dout.data, detail::row_strides(p.dout, varlen), varlen));
  FLARE_RETURN_IF_ERROR(check_pair_output("dk", p.dk.data, detail::row_strides(p.dk, varlen)));
  return check_pair_output("dv", p.dv.data, detail::row_strides(p.dv, varlen));
}

}  // namespace

Status hopper_backward_check(const AttentionBackwardParams& p, int head_dim) {
  if (p.block_mask != nullptr)
    return Status::NotSupported("block_mask: the dense Hopper backward has no block-sparse mask (hopper_backward_sparse_check)");
  if (!hopper_bwd_serves(head_dim))
    return Status::NotSupported("head dim: the Hopper backward serves head dims up to 128 and 256, not " +
                                std::to_string(head_dim));
  return check_device_and_operands(p);
}

Status hopper_backward_sparse_check(const AttentionBackwardParams& p, int head_dim) {
  if (p.block_mask == nullptr) return Status::InvalidArgument("block_mask", "null pointer");
  if (!hopper_bwd_sparse_serves(head_dim))
    return Status::NotSupported("head dim: the Hopper block-sparse backward serves head dims up to 128, not " +
                                std::to_string(head_dim));
  if (p.block_mask->q_block_size % kHopperBwdBlockM != 0)
    return Status::NotSupported("block_mask: q block size " + std::to_string(p.block_mask->q_block_size) +
                                ": the Hopper block-sparse backward needs a multiple of " +
                                std::to_string(kHopperBwdBlockM));
  const int block_n = hopper_bwd_block_n(head_dim);
  if (p.block_mask->kv_block_size % block_n != 0)
    return Status::NotSupported("block_mask: kv block size " + std::to_string(p.block_mask->kv_block_size) +
                                ": the Hopper block-sparse backward needs a multiple of " + std::to_string(block_n));
  return check_device_and_operands(p);
}

Status hopper_attention_backward_sparse(const detail::BwdKernelParams& p, const block_sparse::BlockSparseParams& bs,
                                        const block_sparse::DqPlanView* dq_plan, DType dtype, Stream stream) {
  return portable::visit_instantiation(p.fwd.head_dim, dtype, [&](auto hd, auto elem) {
    return launch_hopper_bwd_sparse<decltype(hd)::value, decltype(elem)>(p, bs, dq_plan, stream);
  });
}

Status hopper_attention_backward(const detail::BwdKernelParams& p, DType dtype, Stream stream) {
  return portable::visit_instantiation(p.fwd.head_dim, dtype, [&](auto hd, auto elem) {
    return launch_hopper_bwd<decltype(hd)::value, decltype(elem)>(p, stream);
  });
}

}  // namespace flare::hopper
