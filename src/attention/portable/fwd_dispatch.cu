#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <string>

#include "flare_instantiated.h"
#include "src/attention/portable/fwd_launch.h"

namespace flare::portable {
namespace {

template <typename T>
Status dispatch_head_dim(const detail::FwdKernelParams& p, Stream stream) {
  const int d = p.head_dim;
#ifdef FLARE_HAS_HEAD_DIM_64
  if (d <= 64) return launch_portable_fwd<64, T>(p, stream);
#endif
#ifdef FLARE_HAS_HEAD_DIM_96
  if (d <= 96) return launch_portable_fwd<96, T>(p, stream);
#endif
#ifdef FLARE_HAS_HEAD_DIM_128
  if (d <= 128) return launch_portable_fwd<128, T>(p, stream);
#endif
#ifdef FLARE_HAS_HEAD_DIM_192
  if (d <= 192) return launch_portable_fwd<192, T>(p, stream);
#endif
#ifdef FLARE_HAS_HEAD_DIM_256
  if (d <= 256) return launch_portable_fwd<256, T>(p, stream);
#endif
  return Status::NotSupported("head dim " + std::to_string(d) +
                              ": no kernel instantiated for it in this build (see FLARE_HEAD_DIMS)");
}

}  // namespace

Status portable_attention_forward(const detail::FwdKernelParams& p, DType dtype, Stream stream) {
  if (dtype == DType::kBFloat16) {
#ifdef FLARE_HAS_DTYPE_bf16
    return dispatch_head_dim<__nv_bfloat16>(p, stream);
#endif
  } else {
#ifdef FLARE_HAS_DTYPE_fp16
    return dispatch_head_dim<__half>(p, stream);
#endif
  }
  return Status::NotSupported(std::string("dtype ") + dtype_name(dtype) +
                              ": no kernel instantiated for it in this build (see FLARE_DTYPES)");
}

}  // namespace flare::portable
