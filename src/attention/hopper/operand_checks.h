// What the Hopper kernels ask of their operands beyond the public argument rules: TMA reads
// 16-byte-aligned bases with strides that are multiples of 16 bytes; outputs are written in
// element pairs.
#pragma once

#include <cstdint>
#include <string>

#include "src/attention/fwd_params.h"
#include "src/common/device_facts.h"

namespace flare::hopper {

inline Status check_sm90() {
  const detail::DeviceFacts dev = detail::current_device_facts();
  if (dev.cc_major != 9 || dev.cc_minor != 0)
    return Status::NotSupported("the Hopper kernels need an sm_90 device (this one is sm_" + std::to_string(dev.cc_major) +
                                std::to_string(dev.cc_minor) + ")");
  return Status::Ok();
}

inline Status check_tma_operand(const char* name, const void* data, const detail::RowStrides& st, bool varlen) {
  const auto misaligned = [](int64_t elems) { return (elems * 2) % 16 != 0; };
  if (reinterpret_cast<uintptr_t>(data) % 16 != 0)
    return Status::NotSupported(std::string(name) + ": the Hopper kernels need a 16-byte-aligned base address");
  if (misaligned(st.row) || misaligned(st.head) || (!varlen && misaligned(st.batch)))
    return Status::NotSupported(std::string(name) +
                                ": the Hopper kernels need row, head and batch strides that are multiples of 8 elements");
  return Status::Ok();
}

inline Status check_pair_output(const char* name, const void* data, const detail::RowStrides& st) {
  if (reinterpret_cast<uintptr_t>(data) % 4 != 0 || st.row % 2 != 0 || st.head % 2 != 0 || st.batch % 2 != 0)
    return Status::NotSupported(std::string(name) +
                                ": the Hopper kernels write element pairs (4-byte alignment, even strides)");
  return Status::Ok();
}

}  // namespace flare::hopper
