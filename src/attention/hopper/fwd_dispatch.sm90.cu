// Picks the Hopper forward's instantiation, after checking that the problem suits it.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <string>

#include "src/attention/hopper/fwd_launch.h"
#include "src/attention/portable/head_dims.h"
#include "src/common/device_facts.h"

namespace flare::hopper {

namespace {

// TMA reads 16-byte-aligned bases with strides that are multiples of 16 bytes.
Status check_tma_operand(const char* name, const void* data, const detail::RowStrides& st, bool varlen) {
  const auto misaligned = [](int64_t elems) { return (elems * 2) % 16 != 0; };
  if (reinterpret_cast<uintptr_t>(data) % 16 != 0)
    return Status::NotSupported(std::string(name) + ": the Hopper kernel needs a 16-byte-aligned base address");
  if (misaligned(st.row) || misaligned(st.head) || (!varlen && misaligned(st.batch)))
    return Status::NotSupported(std::string(name) +
                                ": the Hopper kernel needs row, head and batch strides that are multiples of 8 elements");
  return Status::Ok();
}

}  // namespace

Status hopper_forward_check(const detail::FwdKernelParams& p, DType dtype) {
  const detail::DeviceFacts dev = detail::current_device_facts();
  if (dev.cc_major != 9 || dev.cc_minor != 0)
    return Status::NotSupported("the Hopper kernels need an sm_90 device (this one is sm_" +
                                std::to_string(dev.cc_major) + std::to_string(dev.cc_minor) + ")");
  if (portable::instantiated_head_dim(p.head_dim) == 0)
    return Status::NotSupported("head dim " + std::to_string(p.head_dim) +
                                ": no kernel instantiated for it in this build (see FLARE_HEAD_DIMS)");
#ifndef FLARE_HAS_DTYPE_bf16
  if (dtype == DType::kBFloat16) return Status::NotSupported("dtype bf16: not instantiated in this build (see FLARE_DTYPES)");
#endif
#ifndef FLARE_HAS_DTYPE_fp16
  if (dtype == DType::kFloat16) return Status::NotSupported("dtype fp16: not instantiated in this build (see FLARE_DTYPES)");
#endif
  const bool varlen = p.cu_seqlens_q != nullptr;
  FLARE_RETURN_IF_ERROR(check_tma_operand("q", p.q, p.q_str, varlen));
  FLARE_RETURN_IF_ERROR(check_tma_operand("k", p.k, p.k_str, varlen));
  FLARE_RETURN_IF_ERROR(check_tma_operand("v", p.v, p.v_str, varlen));
  if (reinterpret_cast<uintptr_t>(p.out) % 4 != 0 || p.out_str.row % 2 != 0 || p.out_str.head % 2 != 0 ||
      p.out_str.batch % 2 != 0)
    return Status::NotSupported("out: the Hopper kernel writes element pairs (4-byte alignment, even strides)");
  return Status::Ok();
}

Status hopper_attention_forward(const detail::FwdKernelParams& p, DType dtype, Stream stream) {
  FLARE_RETURN_IF_ERROR(hopper_forward_check(p, dtype));
  if (dtype == DType::kBFloat16) {
#ifdef FLARE_HAS_DTYPE_bf16
    return portable::visit_head_dim(p.head_dim, [&](auto hd) { return launch_hopper_fwd<decltype(hd)::value, __nv_bfloat16>(p, stream); });
#endif
  } else {
#ifdef FLARE_HAS_DTYPE_fp16
    return portable::visit_head_dim(p.head_dim, [&](auto hd) { return launch_hopper_fwd<decltype(hd)::value, __half>(p, stream); });
#endif
  }
  return Status::NotSupported(std::string("dtype ") + dtype_name(dtype) + ": no kernel instantiated for it in this build");
}

}  // namespace flare::hopper
