// Shared set-up of the forward tile-shape sweeps (tune_portable_fwd, tune_hopper_fwd): the
// benchmark's bf16 inputs (16k tokens, hidden 2048) and the kernel params of one (head dim,
// seqlen, causal) run over them.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>
#include <cstdlib>

#include "bench/common/bench_common.h"
#include "src/attention/attention_args.h"
#include "src/attention/fwd_params.h"

namespace flare::bench {

struct Env {
  __nv_bfloat16 *q, *k, *v, *out, *ref;
  cudaStream_t stream;
  Args args;
  Table table;
};

// Arguments, the device check, the stream and the inputs (random q, k, v; out and ref unset).
inline void setup_fwd_tuning(Env& e, int argc, char** argv) {
  e.args = parse_args_or_exit(argc, argv);
  require_cuda_device_or_exit();
  FLARE_BENCH_CHECK(cudaStreamCreate(&e.stream));
  const int64_t n = int64_t{16384} * 2048;
  for (__nv_bfloat16** p : {&e.q, &e.k, &e.v, &e.out, &e.ref}) FLARE_BENCH_CHECK(cudaMalloc(p, n * 2));
  fill_normal_bf16(e.q, n, 1, e.stream);
  fill_normal_bf16(e.k, n, 2, e.stream);
  fill_normal_bf16(e.v, n, 3, e.stream);
}

// Batch 16384 / s, heads 2048 / d, writing `out`.
inline flare::detail::FwdKernelParams params_for(const Env& e, int d, int s, bool causal, void* out) {
  AttentionForwardParams p;
  const int b = 16384 / s, h = 2048 / d;
  auto view = [&](void* ptr) { return TensorView::contiguous(ptr, DType::kBFloat16, {b, s, h, d}); };
  p.q = view(e.q);
  p.k = view(e.k);
  p.v = view(e.v);
  p.out = view(out);
  p.mask.causal = causal;
  flare::detail::AttentionShape shape;
  if (!flare::detail::validate_attention_forward(p, DeviceKind::kCUDA, &shape).ok()) std::abort();
  return flare::detail::make_fwd_kernel_params(p, shape);
}

}  // namespace flare::bench
