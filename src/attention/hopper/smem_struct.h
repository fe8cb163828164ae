// The kernel's shared-memory struct at the first 1024-byte boundary of the dynamic shared memory
// (swizzled TMA/GMMA tiles need it; the launch asks for 1024 bytes more than the struct).
// The offset is added to the __shared__ array itself, so the compiler still knows every member
// is shared memory and emits LDS/STS, not generic loads and stores.
#pragma once

#include <cstdint>

namespace flare::hopper {

template <typename S>
__device__ __forceinline__ S& smem_struct(unsigned char* dynamic_smem) {
  const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(dynamic_smem));
  return *reinterpret_cast<S*>(dynamic_smem + ((1024u - (base & 1023u)) & 1023u));
}

}  // namespace flare::hopper
