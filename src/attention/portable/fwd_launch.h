// Declarations of the portable forward's launchers; definitions and explicit instantiations
// live in the generated per-(head dim, dtype) translation units.
#pragma once

#include "src/attention/fwd_params.h"
#include "src/block_sparse/block_sparse_params.h"

namespace flare::portable {

template <int kHeadDim, typename T>
Status launch_portable_fwd(const detail::FwdKernelParams& p, Stream stream);

template <int kHeadDim, typename T>
Status launch_portable_fwd_sparse(const detail::FwdKernelParams& p, const block_sparse::BlockSparseParams& bs,
                                  Stream stream);

// Picks the smallest instantiated head dim >= p.head_dim and the dtype's kernel.
Status portable_attention_forward(const detail::FwdKernelParams& p, DType dtype, Stream stream);
// The same for the block-sparse forward (fwd_sparse_kernel.h).
Status portable_attention_forward_sparse(const detail::FwdKernelParams& p, const block_sparse::BlockSparseParams& bs,
                                         DType dtype, Stream stream);

}  // namespace flare::portable
