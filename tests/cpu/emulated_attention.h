// Pieces shared by the emulated attention tests (test_attention_emulated,
// test_block_sparse_emulated): host memory labelled as device memory, the kernels they instantiate,
// the backward's finishing kernels under the emulation, and the judgement. Include after
// tests/cpu/cuda_emu/cuda_emu.h and the kernel headers.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <type_traits>

#include "flare/attention.h"
#include "reference/host_tensor.h"
#include "src/attention/bwd_params.h"
#include "tests/gpu/attention_case.h"  // compare, within_tolerance

namespace flare::test::emu {

// The same views labelled as device memory (the emulated kernels read host memory).
template <typename P>
P on_device(P p) {
  auto label = [](TensorView& t) {
    if (t.defined()) t.device = Device{DeviceKind::kCUDA, 0};
  };
  for (TensorView* t : {&p.q, &p.k, &p.v, &p.out, &p.lse, &p.cu_seqlens_q, &p.cu_seqlens_k, &p.sinks}) label(*t);
  if constexpr (std::is_same_v<P, AttentionBackwardParams>)
    for (TensorView* t : {&p.dout, &p.dq, &p.dk, &p.dv, &p.dsinks}) label(*t);
  return p;
}

// The kernels these tests instantiate themselves (not the build's FLARE_HEAD_DIMS list): head dims
// 64 and 128, bf16 and fp16; a head dim runs on the smallest one at least as large, as the
// library's dispatch does over its list.
template <typename F>
void visit_kernel(int head_dim, DType dtype, F&& f) {
  auto with_dim = [&](auto elem) {
    if (head_dim <= 64) f(std::integral_constant<int, 64>{}, elem);
    else if (head_dim <= 128) f(std::integral_constant<int, 128>{}, elem);
    else f(std::integral_constant<int, 256>{}, elem);  // its own warp grids in the 2-D backward
  };
  ASSERT_LE(head_dim, 256);
  if (dtype == DType::kBFloat16) with_dim(__nv_bfloat16{});
  else with_dim(__half{});
}

// launch_bwd_finish after the main kernel: dQ (and with GQA dK, dV) from the fp32 accumulators.
template <typename T>
void run_bwd_finish(const detail::BwdKernelParams& P, unsigned char* smem) {
  const detail::FwdKernelParams& p = P.fwd;
  ASSERT_EQ(P.dsinks, nullptr) << "the sinks gradient kernel is not emulated";
  const int rows_q = p.seqlen_q > 0 ? std::min(p.seqlen_q, 4096) : 1;
  cuda_emu::launch(dim3(rows_q, p.heads, p.batch), 128, smem, [&] {
    portable::bwd_convert_kernel<T>(P.dq_accum, P.dq, P.dq_str, p, p.heads, true);
  });
  if (p.group > 1) {
    const int rows_k = p.seqlen_k > 0 ? std::min(p.seqlen_k, 4096) : 1;
    const dim3 grid(rows_k, p.heads_kv, p.batch);
    cuda_emu::launch(grid, 128, smem, [&] {
      portable::bwd_convert_kernel<T>(P.dk_accum, P.dk, P.dk_str, p, p.heads_kv, false);
    });
    cuda_emu::launch(grid, 128, smem, [&] {
      portable::bwd_convert_kernel<T>(P.dv_accum, P.dv, P.dv_str, p, p.heads_kv, false);
    });
  }
}

// The GPU tests' judgement, with the error also required to be > 0.
inline void expect_close(const ref::HostTensor& got, const ref::HostTensor& want, const ref::HostTensor& lowp,
                         const char* name, double k, double atol, double min_lowp = 0) {
  ErrorReport r = compare(got, want, &lowp);
  r.lowp_err = std::max(r.lowp_err, min_lowp);
  std::printf("    %s\n", r.describe(name).c_str());
  EXPECT_TRUE(within_tolerance(r, name, k, atol));
  EXPECT_GT(r.max_err, 0.0) << name << ": exactly the fp64 oracle's values from 16-bit operands";
}

}  // namespace flare::test::emu
