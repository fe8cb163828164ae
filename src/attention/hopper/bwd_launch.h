// The Hopper backward's launchers (definitions in the generated per-(head dim, dtype) units).
#pragma once

#include "src/attention/bwd_params.h"
#include "src/attention/hopper/bwd_config.h"
#include "src/block_sparse/block_sparse_params.h"
#include "src/block_sparse/dq_write_order.h"

namespace flare::hopper {

template <int kHeadDim, typename T>
Status launch_hopper_bwd(const detail::BwdKernelParams& p, Stream stream);
template <int kHeadDim, typename T>
Status launch_hopper_bwd_sparse(const detail::BwdKernelParams& p, const block_sparse::BlockSparseParams& bs,
                                const block_sparse::DqPlanView* dq_plan, Stream stream);

// Ok when the Hopper backward can run this problem (sm_90, head dim <= 256, no soft-capping, no
// block mask, TMA-addressable operands), else why not. `head_dim` is the instantiated one.
Status hopper_backward_check(const AttentionBackwardParams& p, int head_dim);

// Query rows of the workspace's blocks (row statistics, dQ tiles, semaphores) and of the
// block-sparse kernel's steps; the dense d64 tiling steps over two at a time (hopper_bwd_block_m).
// Keys per CTA: hopper_bwd_block_n in bwd_config.h. Both size the workspace.
inline constexpr int kHopperBwdBlockM = 64;

Status hopper_attention_backward(const detail::BwdKernelParams& p, DType dtype, Stream stream);

// The block-sparse backward (p.block_mask set): Ok when the Hopper kernel can run it (as
// hopper_backward_check, and head dim <= 128, q blocks a multiple of 64 rows, kv blocks a multiple
// of 128 keys), else why not. Deterministic mode takes the mask's plan (`dq_plan`, else null).
Status hopper_backward_sparse_check(const AttentionBackwardParams& p, int head_dim);
Status hopper_attention_backward_sparse(const detail::BwdKernelParams& p, const block_sparse::BlockSparseParams& bs,
                                        const block_sparse::DqPlanView* dq_plan, DType dtype, Stream stream);

}  // namespace flare::hopper
