#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <string>

#include "src/attention/portable/fwd_launch.h"
#include "src/attention/portable/head_dims.h"

namespace flare::portable {

Status portable_attention_forward(const detail::FwdKernelParams& p, DType dtype, Stream stream) {
  const int d = p.head_dim;
  if (instantiated_head_dim(d) == 0)
    return Status::NotSupported("head dim " + std::to_string(d) +
                                ": no kernel instantiated for it in this build (see FLARE_HEAD_DIMS)");
  if (dtype == DType::kBFloat16) {
#ifdef FLARE_HAS_DTYPE_bf16
    return visit_head_dim(d, [&](auto hd) { return launch_portable_fwd<decltype(hd)::value, __nv_bfloat16>(p, stream); });
#endif
  } else {
#ifdef FLARE_HAS_DTYPE_fp16
    return visit_head_dim(d, [&](auto hd) { return launch_portable_fwd<decltype(hd)::value, __half>(p, stream); });
#endif
  }
  return Status::NotSupported(std::string("dtype ") + dtype_name(dtype) +
                              ": no kernel instantiated for it in this build (see FLARE_DTYPES)");
}

Status portable_attention_forward_sparse(const detail::FwdKernelParams& p, const block_sparse::BlockSparseParams& bs,
                                         DType dtype, Stream stream) {
  const int d = p.head_dim;
  if (instantiated_head_dim(d) == 0)
    return Status::NotSupported("head dim " + std::to_string(d) +
                                ": no kernel instantiated for it in this build (see FLARE_HEAD_DIMS)");
  if (dtype == DType::kBFloat16) {
#ifdef FLARE_HAS_DTYPE_bf16
    return visit_head_dim(
        d, [&](auto hd) { return launch_portable_fwd_sparse<decltype(hd)::value, __nv_bfloat16>(p, bs, stream); });
#endif
  } else {
#ifdef FLARE_HAS_DTYPE_fp16
    return visit_head_dim(d, [&](auto hd) { return launch_portable_fwd_sparse<decltype(hd)::value, __half>(p, bs, stream); });
#endif
  }
  return Status::NotSupported(std::string("dtype ") + dtype_name(dtype) +
                              ": no kernel instantiated for it in this build (see FLARE_DTYPES)");
}

}  // namespace flare::portable

