// KDA forward kernels for fp16, K = 64 (V = 64 and 128): one translation unit per (dtype, K).
#include "src/kda/kda_fwd_launch.cuh"

namespace flare::kda {

Status launch_forward_fp16_k64(const KdaFwdArgs& a, cudaStream_t stream) {
  return launch_forward_k<__half, 64>(a, stream);
}

}  // namespace flare::kda
