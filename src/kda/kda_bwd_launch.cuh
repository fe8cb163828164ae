// Launch of the KDA backward kernels for one (dtype, K, V); instantiated by kda_bwd_*.cu.
#pragma once

#include <cuda_runtime.h>

#include <type_traits>

#include "src/common/cuda_check.h"
#include "src/common/device_facts.h"
#include "src/kda/kda_bwd_chunk_grad.cuh"
#include "src/kda/kda_bwd_params.h"
#include "src/kda/kda_bwd_state_pass.cuh"
#include "src/kda/kda_bwd_state_record.cuh"
#include "src/kda/kda_fwd_launch.cuh"

namespace flare::kda {

// The finishing kernels (kda_bwd_finish.cu): dq, dk summed over value heads; dA_log, ddt_bias.
cudaError_t launch_bwd_finish(const KdaBwdArgs& b, bool bf16, cudaStream_t stream);

// The two state passes' dynamic shared memory at slice width BV.
template <typename T, int K, int BV>
constexpr size_t record_pass_smem() {
  return RecordConfig<K, BV>::kStages * sizeof(RecordStage<T, K, BV>);
}
template <typename T, int K, int BV>
constexpr size_t bwd_state_pass_smem() {
  return BwdStateConfig<K, BV>::kStages * sizeof(BwdStateStage<T, K, BV>);
}

template <typename T, int K, int V, int BV>
cudaError_t launch_state_passes(const KdaBwdArgs& b, cudaStream_t stream) {
  const dim3 grid(V / BV, b.fwd.heads_v, b.fwd.num_seqs);
  cudaError_t e = launch(kda_state_record_kernel<T, K, V, BV>, grid, RecordConfig<K, BV>::kThreads,
                         record_pass_smem<T, K, BV>(), stream, b);
  if (e != cudaSuccess) return e;
  return launch(kda_bwd_state_pass_kernel<T, K, V, BV>, grid, BwdStateConfig<K, BV>::kThreads,
                bwd_state_pass_smem<T, K, BV>(), stream, b);
}

template <typename T, int K, int V>
Status launch_backward(const KdaBwdArgs& b, cudaStream_t stream) {
  const KdaFwdArgs& a = b.fwd;
  // Shared memory: the prep, the chunk gradient, and the state passes at their widest slice.
  constexpr int kWideBV = V < 64 ? V : 64;
  FLARE_RETURN_IF_ERROR(require_shared_memory(sizeof(PrepSmem<T, K, V>), "chunk prep"));
  FLARE_RETURN_IF_ERROR(require_shared_memory(sizeof(GradSmem<T, K, V>), "chunk gradient"));
  FLARE_RETURN_IF_ERROR(require_shared_memory(record_pass_smem<T, K, kWideBV>(), "state record pass"));
  FLARE_RETURN_IF_ERROR(require_shared_memory(bwd_state_pass_smem<T, K, kWideBV>(), "backward state pass"));
  if (!b.prep_done) FLARE_RETURN_IF_ERROR((launch_chunk_prep<T, K, V>(a, stream)));
  // The passes are sequential along T like the forward's: the same value-slice width, at most 64.
  FLARE_CUDA_RETURN((with_state_slice_width<V, 64>(
      a, [&](auto bv) { return launch_state_passes<T, K, V, decltype(bv)::value>(b, stream); })));
  if (a.max_chunks > 0)
    FLARE_CUDA_RETURN(launch(kda_chunk_grad_kernel<T, K, V>, dim3(a.max_chunks, a.heads_v),
                             GradConfig<K, V>::kThreads, sizeof(GradSmem<T, K, V>), stream, b));
  FLARE_CUDA_RETURN(launch_bwd_finish(b, std::is_same_v<T, __nv_bfloat16>, stream));
  return Status::Ok();
}

template <typename T, int K>
Status launch_backward_k(const KdaBwdArgs& b, cudaStream_t stream) {
  if (b.fwd.value_dim == 64) return launch_backward<T, K, 64>(b, stream);
  if (b.fwd.value_dim == 128) return launch_backward<T, K, 128>(b, stream);
  return Status::NotSupported("KDA backward: value dim V must be 64 or 128");
}

}  // namespace flare::kda
