// Picks the backward instantiation for (dtype, K).
#include <cuda_runtime.h>

#include "src/kda/kda_bwd_params.h"

namespace flare::kda {
Status launch_backward_bf16_k64(const detail::KdaBwdArgs& b, cudaStream_t stream);
Status launch_backward_bf16_k128(const detail::KdaBwdArgs& b, cudaStream_t stream);
Status launch_backward_fp16_k64(const detail::KdaBwdArgs& b, cudaStream_t stream);
Status launch_backward_fp16_k128(const detail::KdaBwdArgs& b, cudaStream_t stream);
}  // namespace flare::kda

namespace flare::detail {

Status launch_kda_backward(const KdaBwdArgs& b, DType dtype, Stream stream) {
  const bool bf16 = dtype == DType::kBFloat16;
  if (b.fwd.key_dim == 64) return bf16 ? kda::launch_backward_bf16_k64(b, stream) : kda::launch_backward_fp16_k64(b, stream);
  if (b.fwd.key_dim == 128)
    return bf16 ? kda::launch_backward_bf16_k128(b, stream) : kda::launch_backward_fp16_k128(b, stream);
  return Status::NotSupported("KDA backward: key dim K must be 64 or 128");
}

}  // namespace flare::detail
