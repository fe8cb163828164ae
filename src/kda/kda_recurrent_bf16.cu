// KDA recurrent step kernels for bf16 (K, V in {64, 128}, slices of 16/32/64 value columns):
// one translation unit per dtype.
#include "src/kda/kda_recurrent_step.cuh"

namespace flare::kda {

cudaError_t launch_recurrent_bf16(const KdaRecurrentArgs& a, int bv, cudaStream_t stream) {
  return launch_recurrent_for_dims<__nv_bfloat16>(a, bv, stream);
}

}  // namespace flare::kda
