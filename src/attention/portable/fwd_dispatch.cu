#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <string>

#include "src/attention/portable/fwd_launch.h"
#include "src/attention/portable/head_dims.h"

namespace flare::portable {

Status portable_attention_forward(const detail::FwdKernelParams& p, DType dtype, Stream stream) {
  return visit_instantiation(p.head_dim, dtype, [&](auto hd, auto elem) {
    return launch_portable_fwd<decltype(hd)::value, decltype(elem)>(p, stream);
  });
}

Status portable_attention_forward_sparse(const detail::FwdKernelParams& p, const block_sparse::BlockSparseParams& bs,
                                         DType dtype, Stream stream) {
  return visit_instantiation(p.head_dim, dtype, [&](auto hd, auto elem) {
    return launch_portable_fwd_sparse<decltype(hd)::value, decltype(elem)>(p, bs, stream);
  });
}

}  // namespace flare::portable

