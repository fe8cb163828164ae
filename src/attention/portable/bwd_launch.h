// Declarations of the portable backward's launchers (definitions in the generated units).
#pragma once

#include "src/attention/bwd_params.h"
#include "src/block_sparse/block_sparse_params.h"
#include "src/block_sparse/dq_write_order.h"

namespace flare::portable {

template <int kHeadDim, typename T>
Status launch_portable_bwd(const detail::BwdKernelParams& p, Stream stream);

template <int kHeadDim, typename T>
Status launch_portable_bwd_sparse(const detail::BwdKernelParams& p, const block_sparse::BlockSparseParams& bs,
                                  const block_sparse::DqPlanView* plan, Stream stream);

// The block sizes the backward uses for a head dim (they size the semaphore workspace).
struct BwdBlocks {
  int block_m = 0, block_n = 0, head_dim = 0;  // head_dim: the instantiated one serving it
};
BwdBlocks portable_bwd_blocks(int head_dim);

Status portable_attention_backward(const detail::BwdKernelParams& p, DType dtype, Stream stream);
// The same for the block-sparse backward (bwd_sparse_kernel.h); `plan`: the deterministic mode's
// (its data on the device), null for the ordinary mode.
Status portable_attention_backward_sparse(const detail::BwdKernelParams& p, const block_sparse::BlockSparseParams& bs,
                                          const block_sparse::DqPlanView* plan, DType dtype, Stream stream);

}  // namespace flare::portable
