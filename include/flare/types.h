// Small types shared by the op headers.
#pragma once

#include <cstdint>

struct CUstream_st;

namespace flare {

// cudaStream_t without pulling in the CUDA runtime header. nullptr is the legacy default stream.
using Stream = CUstream_st*;

// Which kernel family runs an op. kAuto picks Hopper kernels on sm_90 and the portable
// (mma.sync, sm_80+) kernels elsewhere; the others force a family (tests use them).
// kReference is a simple fp32-arithmetic GPU kernel: slow, used as a large-size reference.
enum class Backend : uint8_t { kAuto, kPortable, kHopper, kReference };

}  // namespace flare
