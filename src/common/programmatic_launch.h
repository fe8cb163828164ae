// Host side of launches with attributes: programmatic dependent launch (src/common/grid_dependency.h
// has the device side: a kernel launch whose grid may start before the kernel ahead of it on the
// stream has finished) and thread-block clusters.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

namespace flare::detail {

// kernel<<<grid, block, smem, stream>>>(args...) with the launch attributes `attrs` (n of them).
// Returns the launch's error, or the one cudaGetLastError reports after it (which also clears a
// failed launch's error for later launches).
template <typename... Params, typename... Args>
cudaError_t launch_with_attributes(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                                   cudaLaunchAttribute* attrs, unsigned n, const Args&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = attrs;
  config.numAttrs = n;
  const cudaError_t e = cudaLaunchKernelEx(&config, kernel, args...);
  const cudaError_t last = cudaGetLastError();
  return e != cudaSuccess ? e : last;
}

// kernel<<<grid, block, smem, stream>>>(args...), as the programmatic dependent of the kernel
// before it on `stream` when `programmatic` (sm_90+; the caller decides), plainly otherwise.
template <typename... Params, typename... Args>
cudaError_t launch_maybe_programmatic(bool programmatic, void (*kernel)(Params...), dim3 grid, dim3 block,
                                      size_t smem, cudaStream_t stream, const Args&... args) {
  cudaLaunchAttribute attribute = {};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  return launch_with_attributes(kernel, grid, block, smem, stream, &attribute, programmatic ? 1u : 0u, args...);
}

// The launch attribute of clusters of cluster_x x 1 x 1 CTAs (for launches and occupancy queries).
inline cudaLaunchAttribute cluster_attribute(int cluster_x) {
  cudaLaunchAttribute attribute = {};
  attribute.id = cudaLaunchAttributeClusterDimension;
  attribute.val.clusterDim.x = static_cast<unsigned>(cluster_x);
  attribute.val.clusterDim.y = 1;
  attribute.val.clusterDim.z = 1;
  return attribute;
}

// kernel<<<grid, block, smem, stream>>>(args...) in clusters of cluster_x x 1 x 1 CTAs (sm_90+;
// grid.x a multiple of cluster_x).
template <typename... Params, typename... Args>
cudaError_t launch_cluster(void (*kernel)(Params...), dim3 grid, dim3 block, int cluster_x, size_t smem,
                           cudaStream_t stream, const Args&... args) {
  cudaLaunchAttribute attribute = cluster_attribute(cluster_x);
  return launch_with_attributes(kernel, grid, block, smem, stream, &attribute, 1u, args...);
}

}  // namespace flare::detail
