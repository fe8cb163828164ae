// The Hopper forward's launchers. hopper_forward_check says whether a problem can run on it (an
// sm_90 device, a build with the Hopper kernels, operands TMA can address); the definitions of
// launch_hopper_fwd live in the generated per-(head dim, dtype) translation units.
#pragma once

#include "src/attention/fwd_params.h"

namespace flare::hopper {

template <int kHeadDim, typename T>
Status launch_hopper_fwd(const detail::FwdKernelParams& p, Stream stream);

// Ok when the Hopper kernel can run this problem on the current device, else why not.
Status hopper_forward_check(const detail::FwdKernelParams& p, DType dtype);

// Launches the kernel of the smallest instantiated head dim >= p.head_dim, for a problem that
// hopper_forward_check accepted.
Status hopper_attention_forward(const detail::FwdKernelParams& p, DType dtype, Stream stream);

}  // namespace flare::hopper
