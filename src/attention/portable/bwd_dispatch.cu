#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <string>

#include "src/attention/portable/bwd_config.h"
#include "src/attention/portable/bwd_launch.h"
#include "src/attention/portable/head_dims.h"

namespace flare::portable {

BwdBlocks portable_bwd_blocks(int head_dim) {
  if (instantiated_head_dim(head_dim) == 0) return {};
  return visit_head_dim(head_dim, [](auto d) {
    using Cfg = typename BwdConfigFor<decltype(d)::value>::type;
    return BwdBlocks{Cfg::kBlockM, Cfg::kBlockN, decltype(d)::value};
  });
}

Status portable_attention_backward(const detail::BwdKernelParams& p, DType dtype, Stream stream) {
  const int d = p.fwd.head_dim;
  if (instantiated_head_dim(d) == 0)
    return Status::NotSupported("head dim " + std::to_string(d) +
                                ": no kernel instantiated for it in this build (see FLARE_HEAD_DIMS)");
  if (dtype == DType::kBFloat16) {
#ifdef FLARE_HAS_DTYPE_bf16
    return visit_head_dim(d, [&](auto hd) { return launch_portable_bwd<decltype(hd)::value, __nv_bfloat16>(p, stream); });
#endif
  } else {
#ifdef FLARE_HAS_DTYPE_fp16
    return visit_head_dim(d, [&](auto hd) { return launch_portable_bwd<decltype(hd)::value, __half>(p, stream); });
#endif
  }
  return Status::NotSupported(std::string("dtype ") + dtype_name(dtype) +
                              ": no kernel instantiated for it in this build (see FLARE_DTYPES)");
}

}  // namespace flare::portable
