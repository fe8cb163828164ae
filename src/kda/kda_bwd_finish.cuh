// KDA backward, the finishing reductions after the per-chunk kernel (deterministic, no atomics):
//   dq, dk of a q/k head = the sum of its HV / H value heads' (GVA only: the per-chunk kernel
//   writes them per value head in fp32), in q's dtype;
//   dA_log[hv], ddt_bias = the per-chunk partial sums of the gate's gradient, summed over chunks.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "src/kda/kda_bwd_params.h"
#include "src/kda/kda_tiles.cuh"

namespace flare::kda {

using detail::KdaBwdArgs;

constexpr int kFinishThreads = 256;

template <typename T>
__global__ void __launch_bounds__(kFinishThreads) kda_sum_value_heads_kernel(const KdaBwdArgs b) {
  const auto& a = b.fwd;
  const int group = a.heads_v / a.heads, K = a.key_dim;
  const int64_t total = static_cast<int64_t>(a.batch) * a.seqlen * a.heads * K;
  for (int64_t idx = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; idx < total;
       idx += int64_t{gridDim.x} * blockDim.x) {
    const int c = static_cast<int>(idx % K);
    const int h = static_cast<int>((idx / K) % a.heads);
    const int64_t token = idx / (int64_t{K} * a.heads);  // batch * T + t
    const int64_t batch = token / a.seqlen, t = token % a.seqlen;
    const int64_t from = (token * a.heads_v + int64_t{h} * group) * K + c;
    float dq = 0.f, dk = 0.f;
    for (int r = 0; r < group; ++r) dq += b.dq_heads[from + r * K], dk += b.dk_heads[from + r * K];
    static_cast<T*>(b.dq)[batch * b.dq_st.batch + t * b.dq_st.token + h * b.dq_st.head + c] = from_float<T>(dq);
    static_cast<T*>(b.dk)[batch * b.dk_st.batch + t * b.dk_st.token + h * b.dk_st.head + c] = from_float<T>(dk);
  }
}

// One thread per output: ddt_bias entries first, then dA_log, each summed over the chunks in order.
// (static: a header kernel, included by the library and the CPU emulation test)
static __global__ void __launch_bounds__(kFinishThreads) kda_gate_params_kernel(const KdaBwdArgs b) {
  const auto& a = b.fwd;
  const int chunks = a.varlen ? a.seq_chunk_begin[a.num_seqs] : a.max_chunks;
  const int per_head = a.scalar_gate ? 1 : a.key_dim;
  const int dt_count = b.ddt_bias ? a.heads_v * per_head : 0;
  const int idx = blockIdx.x * blockDim.x + threadIdx.x;
  if (idx < dt_count) {
    const int hv = idx / per_head, c = idx % per_head;
    float sum = 0.f;
    for (int chunk = 0; chunk < chunks; ++chunk)
      sum += b.gate_partial[(static_cast<int64_t>(chunk) * a.heads_v + hv) * a.key_dim + c];
    b.ddt_bias[idx] = sum;
  } else if (b.dA_log && idx < dt_count + a.heads_v) {
    const int hv = idx - dt_count;
    float sum = 0.f;
    for (int chunk = 0; chunk < chunks; ++chunk) sum += b.A_log_partial[static_cast<int64_t>(chunk) * a.heads_v + hv];
    b.dA_log[hv] = sum;
  }
}

}  // namespace flare::kda
