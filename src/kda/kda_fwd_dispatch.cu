// Picks the forward instantiation for (dtype, K).
#include <cuda_runtime.h>

#include "src/kda/kda_fwd_params.h"

namespace flare::kda {
Status launch_forward_bf16_k64(const detail::KdaFwdArgs& a, cudaStream_t stream);
Status launch_forward_bf16_k128(const detail::KdaFwdArgs& a, cudaStream_t stream);
Status launch_forward_fp16_k64(const detail::KdaFwdArgs& a, cudaStream_t stream);
Status launch_forward_fp16_k128(const detail::KdaFwdArgs& a, cudaStream_t stream);
}  // namespace flare::kda

namespace flare::detail {

Status launch_kda_forward(const KdaFwdArgs& a, DType dtype, Stream stream) {
  const bool bf16 = dtype == DType::kBFloat16;
  if (a.key_dim == 64) return bf16 ? kda::launch_forward_bf16_k64(a, stream) : kda::launch_forward_fp16_k64(a, stream);
  if (a.key_dim == 128)
    return bf16 ? kda::launch_forward_bf16_k128(a, stream) : kda::launch_forward_fp16_k128(a, stream);
  return Status::NotSupported("KDA forward: key dim K must be 64 or 128");
}

}  // namespace flare::detail
