#include "src/common/device_facts.h"

#include <cuda_runtime.h>

namespace flare::detail {

DeviceFacts current_device_facts() {
  static thread_local DeviceFacts cached;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return cached;
  if (device != cached.device) {
    DeviceFacts f;
    f.device = device;
    cudaDeviceGetAttribute(&f.num_sms, cudaDevAttrMultiProcessorCount, device);
    cudaDeviceGetAttribute(&f.l2_bytes, cudaDevAttrL2CacheSize, device);
    cudaDeviceGetAttribute(&f.cc_major, cudaDevAttrComputeCapabilityMajor, device);
    cudaDeviceGetAttribute(&f.cc_minor, cudaDevAttrComputeCapabilityMinor, device);
    cudaDeviceGetAttribute(&f.smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
    cached = f;
  }
  return cached;
}

}  // namespace flare::detail
