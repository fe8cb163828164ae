// Definitions and instantiations of kda_state_gmma.h's launches for one dtype (included by
// kda_state_gmma_<dtype>.sm90.cu, compiled for sm_90a only).
#pragma once

#include "src/kda/kda_fwd_launch.cuh"
#include "src/kda/kda_state_gmma.h"
#include "src/kda/kda_state_pass.cuh"

namespace flare::kda {

template <typename T, int K, int V, int BV>
cudaError_t launch_output_pass_gmma(const KdaFwdArgs& a, dim3 grid, int first_segment, bool programmatic,
                                    cudaStream_t stream) {
  return launch_with(programmatic, kda_state_pass_kernel<T, K, V, BV, true>, grid, StateConfig<K, BV>::kThreads,
                     kStateSmemBytes<T, K, BV, BV, StatePass::kOutput, true>, stream, a, first_segment);
}

template <typename T, int K, int V>
cudaError_t launch_transition_gmma(const KdaFwdArgs& a, cudaStream_t stream) {
  return launch(kda_state_transition_kernel<T, K, V, true>, dim3(1, a.heads_v, a.num_seqs * (a.state_segments - 2)),
                TransitionConfig<K, V>::kThreads, kStateSmemBytes<T, K, V + K, V, StatePass::kTransition, true>,
                stream, a);
}

}  // namespace flare::kda

// Every (K, V, BV) of one dtype.
#define FLARE_KDA_STATE_GMMA_INSTANTIATE(T)                                                                       \
  namespace flare::kda {                                                                                          \
  template cudaError_t launch_output_pass_gmma<T, 64, 64, 64>(const KdaFwdArgs&, dim3, int, bool, cudaStream_t);   \
  template cudaError_t launch_output_pass_gmma<T, 64, 128, 64>(const KdaFwdArgs&, dim3, int, bool, cudaStream_t);  \
  template cudaError_t launch_output_pass_gmma<T, 64, 128, 128>(const KdaFwdArgs&, dim3, int, bool, cudaStream_t); \
  template cudaError_t launch_output_pass_gmma<T, 128, 64, 64>(const KdaFwdArgs&, dim3, int, bool, cudaStream_t);  \
  template cudaError_t launch_output_pass_gmma<T, 128, 128, 64>(const KdaFwdArgs&, dim3, int, bool, cudaStream_t); \
  template cudaError_t launch_output_pass_gmma<T, 128, 128, 128>(const KdaFwdArgs&, dim3, int, bool, cudaStream_t);\
  template cudaError_t launch_transition_gmma<T, 64, 64>(const KdaFwdArgs&, cudaStream_t);                         \
  template cudaError_t launch_transition_gmma<T, 64, 128>(const KdaFwdArgs&, cudaStream_t);                        \
  template cudaError_t launch_transition_gmma<T, 128, 64>(const KdaFwdArgs&, cudaStream_t);                        \
  }
