// KDA forward kernels for fp16, K = 128 (V = 64 and 128): one translation unit per (dtype, K).
#include "src/kda/kda_fwd_launch.cuh"

namespace flare::kda {

Status launch_forward_fp16_k128(const KdaFwdArgs& a, cudaStream_t stream) {
  return launch_forward_k<__half, 128>(a, stream);
}

}  // namespace flare::kda
