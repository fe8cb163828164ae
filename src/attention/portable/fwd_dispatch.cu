#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <string>

#include "src/attention/portable/fwd_kernel.h"
#include "src/attention/portable/fwd_launch.h"
#include "src/attention/portable/head_dims.h"

namespace flare::portable {

Status portable_attention_forward(const detail::FwdKernelParams& p, DType dtype, Stream stream) {
  const int d = p.head_dim;
  if (instantiated_head_dim(d) == 0)
    return Status::NotSupported("head dim " + std::to_string(d) +
                                ": no kernel instantiated for it in this build (see FLARE_HEAD_DIMS)");
  if (dtype == DType::kBFloat16) {
#ifdef FLARE_HAS_DTYPE_bf16
    return visit_head_dim(d, [&](auto hd) { return launch_portable_fwd<decltype(hd)::value, __nv_bfloat16>(p, stream); });
#endif
  } else {
#ifdef FLARE_HAS_DTYPE_fp16
    return visit_head_dim(d, [&](auto hd) { return launch_portable_fwd<decltype(hd)::value, __half>(p, stream); });
#endif
  }
  return Status::NotSupported(std::string("dtype ") + dtype_name(dtype) +
                              ": no kernel instantiated for it in this build (see FLARE_DTYPES)");
}

}  // namespace flare::portable

namespace flare::portable {

DeviceFacts current_device_facts() {
  static thread_local DeviceFacts cached;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return cached;
  if (device != cached.device) {
    DeviceFacts f;
    f.device = device;
    cudaDeviceGetAttribute(&f.num_sms, cudaDevAttrMultiProcessorCount, device);
    cudaDeviceGetAttribute(&f.l2_bytes, cudaDevAttrL2CacheSize, device);
    cached = f;
  }
  return cached;
}

}  // namespace flare::portable
