// Launch of the KDA forward kernels for one (dtype, K, V); instantiated by kda_fwd_*.cu.
#pragma once

#include <type_traits>
#include <utility>

#include <cuda_runtime.h>

#include <cstdlib>
#include <string>

#include "src/common/cuda_check.h"
#include "src/common/device_facts.h"
#include "src/common/programmatic_launch.h"
#include "src/kda/kda_chunk_prep.cuh"
#include "src/kda/kda_fwd_params.h"
#include "src/kda/kda_state_forms.h"
#include "src/kda/kda_state_pass.cuh"
#ifdef FLARE_WITH_HOPPER
#include "src/kda/kda_state_gmma.h"
#endif

namespace flare::kda {

// Builds the varlen chunk table (kda_chunk_table.cu).
cudaError_t launch_chunk_table(const KdaFwdArgs& a, cudaStream_t stream);

// Value columns per state-pass CTA: the widest slice that still gives (about) every SM a CTA:
// the pass is sequential along T, so CTAs, not chunks, are its parallelism, and a wider slice
// re-reads each chunk's w, qg, kg fewer times and puts more warps on an SM (shared memory holds one
// CTA per SM at every width). Measured on the H100 (B1 T32768, 32 heads): 32 columns (128 CTAs)
// 5.19 ms, 64 (64 CTAs) 5.28, 16 (256 CTAs, one per SM for shared memory) 6.75. max_bv: the
// widest slice the caller's kernels take. FLARE_KDA_STATE_BV overrides it (tuning).
inline int forced_state_slice_width(const KdaFwdArgs& a, int max_bv) {
  if (const char* env = std::getenv("FLARE_KDA_STATE_BV")) {
    const int bv = std::atoi(env);
    if ((bv == 16 || bv == 32 || bv == 64 || bv == 128) && bv <= max_bv && a.value_dim % bv == 0) return bv;
  }
  return 0;
}

inline int state_slice_width(const KdaFwdArgs& a, int num_sms, int max_bv) {
  if (const int bv = forced_state_slice_width(a, max_bv)) return bv;
  const int64_t heads = int64_t{a.num_seqs} * a.heads_v;
  auto ctas = [&](int bv) { return heads * (a.value_dim / bv); };
  // The widest slice also where it leaves a few SMs idle, if the next one would need a second wave
  // (B4 T8192, 128 heads on 132 SMs: 128 columns 1.732 ms, 64 columns in two waves 1.802).
  if (max_bv >= 128 && a.value_dim % 128 == 0 && (ctas(128) >= num_sms || ctas(64) > num_sms)) return 128;
  if (a.value_dim % 64 == 0 && ctas(64) >= num_sms) return 64;
  return ctas(32) * 2 >= num_sms ? 32 : 16;
}

// NotSupported, naming the kernel, where it needs more shared memory per block than the device
// allows (the state passes' pipelines are sized for sm_90's 227 KB; an A100 allows 163 KB): a
// clear refusal instead of a failed launch.
inline Status require_shared_memory(size_t bytes, const char* kernel) {
  const int optin = detail::current_device_facts().smem_optin;
  if (optin <= 0 || bytes <= static_cast<size_t>(optin)) return Status::Ok();
  return Status::NotSupported(std::string("KDA: the ") + kernel + " needs " + std::to_string(bytes) +
                              " bytes of shared memory per block; this device allows " + std::to_string(optin) +
                              " (the KDA kernels are sized for sm_90)");
}

// kernel<<<grid, threads, smem, stream>>>(args...) with its shared-memory limit raised to smem;
// programmatic: as the programmatic dependent of the kernel before it in the stream (it may start
// once every CTA of that kernel has allowed it; src/common/grid_dependency.h).
template <typename... Params, typename... Args>
cudaError_t launch_with(bool programmatic, void (*kernel)(Params...), dim3 grid, int threads, size_t smem,
                        cudaStream_t stream, const Args&... args) {
  const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (e != cudaSuccess) return e;
  return detail::launch_maybe_programmatic(programmatic, kernel, grid, dim3(threads), smem, stream, args...);
}

template <typename... Params, typename... Args>
cudaError_t launch(void (*kernel)(Params...), dim3 grid, int threads, size_t smem, cudaStream_t stream,
                   const Args&... args) {
  return launch_with(false, kernel, grid, threads, smem, stream, args...);
}

// The output pass over `grid` (first_segment: kda_state_pass_kernel's), on wgmma where it can.
template <typename T, int K, int V, int BV>
cudaError_t launch_output_pass(const KdaFwdArgs& a, dim3 grid, int first_segment, bool programmatic,
                               cudaStream_t stream) {
#ifdef FLARE_WITH_HOPPER
  if constexpr (BV % 64 == 0)
    if (use_state_gmma()) return launch_output_pass_gmma<T, K, V, BV>(a, grid, first_segment, programmatic, stream);
#endif
  return launch_with(programmatic, kda_state_pass_kernel<T, K, V, BV>, grid, StateConfig<K, BV>::kThreads,
                     sizeof(StateSmem<T, K, BV>), stream, a, first_segment);
}

// The segmented pass's transitions, on wgmma where it can.
template <typename T, int K, int V>
cudaError_t launch_transition_pass(const KdaFwdArgs& a, cudaStream_t stream) {
#ifdef FLARE_WITH_HOPPER
  if constexpr (transition_has_gmma(K, V))
    if (use_state_gmma()) return launch_transition_gmma<T, K, V>(a, stream);
#endif
  return launch(kda_state_transition_kernel<T, K, V>, dim3(1, a.heads_v, a.num_seqs * (a.state_segments - 2)),
                TransitionConfig<K, V>::kThreads, sizeof(TransitionSmem<T, K, V>), stream, a);
}

template <typename T, int K, int V, int BV>
cudaError_t launch_state_pass(const KdaFwdArgs& a, cudaStream_t stream) {
  return launch_output_pass<T, K, V, BV>(a, dim3(V / BV, a.heads_v, a.num_seqs), 0, false, stream);
}

// The chunk table (varlen) and every chunk's preparation: the first stages of the forward and of
// the backward.
template <typename T, int K, int V>
Status launch_chunk_prep(const KdaFwdArgs& a, cudaStream_t stream) {
  if (a.varlen) FLARE_CUDA_RETURN(launch_chunk_table(a, stream));
  if (a.max_chunks > 0)  // a 1-D grid (kda_prep_order.h)
    FLARE_CUDA_RETURN(launch(kda_chunk_prep_kernel<T, K, V>, dim3(static_cast<unsigned>(int64_t{a.max_chunks} * a.heads_v)),
                             PrepConfig<K, V>::kThreads, sizeof(PrepSmem<T, K, V>), stream, a));
  return Status::Ok();
}

// Calls launch(std::integral_constant<int, BV>) for a width bv in {16, 32, 64, 128} that divides V
// and is at most MaxBV (another width: cudaErrorInvalidValue, nothing launched).
template <int V, int MaxBV = 128, typename Launch>
cudaError_t with_width(int bv, Launch&& launch) {
  switch (bv) {
    case 128:
      if constexpr (V % 128 == 0 && MaxBV >= 128) return launch(std::integral_constant<int, 128>{});
      return cudaErrorInvalidValue;
    case 64:
      if constexpr (V % 64 == 0 && MaxBV >= 64) return launch(std::integral_constant<int, 64>{});
      return cudaErrorInvalidValue;
    case 32:
      return launch(std::integral_constant<int, 32>{});
    default:
      return launch(std::integral_constant<int, 16>{});
  }
}

// with_width at the value-slice width of the sequential state passes (state_slice_width).
template <int V, int MaxBV, typename Launch>
cudaError_t with_state_slice_width(const KdaFwdArgs& a, Launch&& launch) {
  return with_width<V, MaxBV>(state_slice_width(a, detail::current_device_facts().num_sms, MaxBV),
                              std::forward<Launch>(launch));
}

// The segmented state pass (kda_state_segments.h), four kernels:
//   transitions of segments 1 .. count-2 (one CTA of all V + K columns per sequence, head and
//     segment), and beside them, as their programmatic dependent, segment 0's output pass (from
//     the initial state; it writes segment 1's start); the rule sizes the two to fill the SMs
//     together;
//   the combine (the starts of segments 2 .. count-1);
//   the output pass of segments 1 .. count-1.
// The output passes take the widest slice (FLARE_KDA_STATE_BV overrides it).
template <typename T, int K, int V>
cudaError_t launch_segmented_state_pass(const KdaFwdArgs& a, cudaStream_t stream) {
  const int forced = forced_state_slice_width(a, 128);
  const int bv = forced != 0 ? forced : (V < 128 ? V : 128);
  const int transitions = a.state_segments - 2;
  cudaError_t e = cudaSuccess;
  if (transitions > 0) {
    e = launch_transition_pass<T, K, V>(a, stream);
    if (e != cudaSuccess) return e;
  }
  e = with_width<V>(bv, [&](auto w) {
    constexpr int BV = decltype(w)::value;
    // Without transitions the kernel ahead is the chunk prep, whose results it reads at once.
    const bool programmatic = transitions > 0 && detail::current_device_facts().cc_major >= 9;
    return launch_output_pass<T, K, V, BV>(a, dim3(V / BV, a.heads_v, a.num_seqs), 0, programmatic, stream);
  });
  if (e != cudaSuccess) return e;
  if (transitions > 0) {
    e = launch(kda_state_segment_combine_kernel<K, V>, dim3(V / kSegmentCombineCols, a.heads_v, a.num_seqs), K,
               segment_combine_smem_bytes<K>(), stream, a);
    if (e != cudaSuccess) return e;
  }
  return with_width<V>(bv, [&](auto w) {
    constexpr int BV = decltype(w)::value;
    return launch_output_pass<T, K, V, BV>(a, dim3(V / BV, a.heads_v, a.num_seqs * (a.state_segments - 1)), 1, false,
                                           stream);
  });
}

template <typename T, int K, int V>
Status launch_forward(const KdaFwdArgs& a, cudaStream_t stream) {
  // Shared memory: the prep, and the output pass at its widest slice (the transitions need less).
  FLARE_RETURN_IF_ERROR(require_shared_memory(sizeof(PrepSmem<T, K, V>), "chunk prep"));
  FLARE_RETURN_IF_ERROR(require_shared_memory(sizeof(StateSmem<T, K, (V < 128 ? V : 128)>), "state pass"));
  FLARE_RETURN_IF_ERROR((launch_chunk_prep<T, K, V>(a, stream)));
  if (a.state_segments > 1) {
    FLARE_CUDA_RETURN((launch_segmented_state_pass<T, K, V>(a, stream)));
    return Status::Ok();
  }
  FLARE_CUDA_RETURN((with_state_slice_width<V, 128>(
      a, [&](auto bv) { return launch_state_pass<T, K, V, decltype(bv)::value>(a, stream); })));
  return Status::Ok();
}

template <typename T, int K>
Status launch_forward_k(const KdaFwdArgs& a, cudaStream_t stream) {
  if (a.value_dim == 64) return launch_forward<T, K, 64>(a, stream);
  if (a.value_dim == 128) return launch_forward<T, K, 128>(a, stream);
  return Status::NotSupported("KDA forward: value dim V must be 64 or 128");
}

}  // namespace flare::kda
