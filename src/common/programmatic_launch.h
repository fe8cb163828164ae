// Host side of programmatic dependent launch (src/common/grid_dependency.h has the device side):
// a kernel launch whose grid may start before the kernel ahead of it on the stream has finished.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

namespace flare::detail {

// kernel<<<grid, block, smem, stream>>>(args...), as the programmatic dependent of the kernel
// before it on `stream` when `programmatic` (sm_90+; the caller decides), plainly otherwise.
// Returns the launch's error, or the one cudaGetLastError reports after it.
template <typename... Params, typename... Args>
cudaError_t launch_maybe_programmatic(bool programmatic, void (*kernel)(Params...), dim3 grid, dim3 block,
                                      size_t smem, cudaStream_t stream, const Args&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attribute = {};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  config.attrs = &attribute;
  config.numAttrs = programmatic ? 1 : 0;
  const cudaError_t e = cudaLaunchKernelEx(&config, kernel, args...);
  return e != cudaSuccess ? e : cudaGetLastError();
}

}  // namespace flare::detail
