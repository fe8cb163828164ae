// Facts of the current CUDA device that launches are sized from (SM count, L2 size), read once
// per device and thread rather than per launch.
#pragma once

namespace flare::detail {

struct DeviceFacts {
  int device = -1, num_sms = 0, l2_bytes = 0;
  int cc_major = 0, cc_minor = 0;  // compute capability
  int smem_optin = 0;               // the most dynamic shared memory a block may opt in to (bytes)
};

// The current device's facts; queried again only when the current device changes.
DeviceFacts current_device_facts();

}  // namespace flare::detail
