// CUDA error handling inside the library: errors become Status, never exceptions or aborts.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "flare/status.h"

namespace flare::detail {

inline Status cuda_status(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return Status::Ok();
  return Status::CudaError(std::string(what) + ": " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")");
}

}  // namespace flare::detail

#define FLARE_CUDA_RETURN(expr) FLARE_RETURN_IF_ERROR(::flare::detail::cuda_status((expr), #expr))
