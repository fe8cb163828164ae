// KDA backward kernels for fp16, K = 64 (V = 64 and 128): one translation unit per (dtype, K).
#include "src/kda/kda_bwd_launch.cuh"

namespace flare::kda {

Status launch_backward_fp16_k64(const KdaBwdArgs& b, cudaStream_t stream) {
  return launch_backward_k<__half, 64>(b, stream);
}

}  // namespace flare::kda
