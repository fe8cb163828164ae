// The attention entry points: validate, build device params once, pick the kernel family.
#include "flare/attention.h"
#include "src/attention/attention_args.h"
#include "src/attention/fwd_params.h"
#include "src/attention/portable/fwd_launch.h"

namespace flare {

Status attention_forward(const AttentionForwardParams& params) {
  detail::AttentionShape shape;
  FLARE_RETURN_IF_ERROR(detail::validate_attention_forward(params, DeviceKind::kCUDA, &shape));
  if (params.block_mask != nullptr) return Status::NotSupported("block-sparse attention forward is not built yet");
  const detail::FwdKernelParams kp = detail::make_fwd_kernel_params(params, shape);
  switch (params.backend) {
    case Backend::kReference:
      return detail::naive_attention_forward(kp, params.q.dtype, params.stream);
    case Backend::kAuto:
    case Backend::kPortable:
      return portable::portable_attention_forward(kp, params.q.dtype, params.stream);
    case Backend::kHopper:
      break;
  }
  return Status::NotSupported("attention forward: requested backend is not built yet");
}

}  // namespace flare
