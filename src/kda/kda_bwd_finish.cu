// Launch of the KDA backward's finishing kernels (kda_bwd_finish.cuh).
#include <algorithm>

#include "src/kda/kda_bwd_finish.cuh"

namespace flare::kda {

cudaError_t launch_bwd_finish(const KdaBwdArgs& b, bool bf16, cudaStream_t stream) {
  const auto& a = b.fwd;
  if (b.dq_heads != nullptr) {
    const int64_t total = static_cast<int64_t>(a.batch) * a.seqlen * a.heads * a.key_dim;
    if (total > 0) {
      const int blocks = static_cast<int>(std::min<int64_t>((total + kFinishThreads - 1) / kFinishThreads, 65535));
      if (bf16) kda_sum_value_heads_kernel<__nv_bfloat16><<<blocks, kFinishThreads, 0, stream>>>(b);
      else kda_sum_value_heads_kernel<__half><<<blocks, kFinishThreads, 0, stream>>>(b);
      const cudaError_t e = cudaGetLastError();
      if (e != cudaSuccess) return e;
    }
  }
  if (b.dA_log != nullptr || b.ddt_bias != nullptr) {
    const int outputs = a.heads_v * ((a.scalar_gate ? 1 : a.key_dim) + 1);
    kda_gate_params_kernel<<<(outputs + kFinishThreads - 1) / kFinishThreads, kFinishThreads, 0, stream>>>(b);
    return cudaGetLastError();
  }
  return cudaSuccess;
}

}  // namespace flare::kda
