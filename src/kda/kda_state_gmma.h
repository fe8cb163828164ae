// The KDA forward state passes on wgmma (sm_90a): launches instantiated in kda_state_gmma_*.sm90.cu,
// called by kda_fwd_launch.cuh where the device is an sm_90 one and the build has the Hopper kernels.
#pragma once

#include <cuda_runtime.h>

#include "src/kda/kda_fwd_params.h"

namespace flare::kda {

using detail::KdaFwdArgs;

// The output pass (kda_state_pass_kernel's wgmma form) over `grid`, as launch_state_pass would
// launch the portable one; programmatic: as the programmatic dependent of the kernel before it.
// BV: 64 or 128, at most V.
template <typename T, int K, int V, int BV>
cudaError_t launch_output_pass_gmma(const KdaFwdArgs& a, dim3 grid, int first_segment, bool programmatic,
                                    cudaStream_t stream);

// The segmented pass's transitions (kda_state_transition_kernel's wgmma form) where
// transition_has_gmma(K, V) (kda_state_forms.h).
template <typename T, int K, int V>
cudaError_t launch_transition_gmma(const KdaFwdArgs& a, cudaStream_t stream);

}  // namespace flare::kda
