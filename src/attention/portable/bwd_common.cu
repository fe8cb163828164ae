// Backward pieces that do not depend on the head dim or dtype.
#include "src/attention/portable/bwd_kernel.h"

namespace flare::portable {
namespace {

constexpr int kSinkThreads = 256;

// Summed in a fixed order (strided partial sums, then a fixed tree): deterministic.
__global__ void __launch_bounds__(kSinkThreads) bwd_dsinks_kernel(const BwdKernelParams P) {
  const detail::FwdKernelParams& p = P.fwd;
  const int h = blockIdx.x;
  float acc = 0.f;
  for (int b = 0; b < p.batch; ++b) {
    const detail::SeqInfo seq = detail::seq_info(p, b);
    const int64_t base = b * p.lse_batch_stride + h * p.lse_head_stride + seq.q_start;
    for (int i = threadIdx.x; i < seq.seqlen_q; i += kSinkThreads) {
      const float lse = p.lse[base + i];
      if (lse != INFINITY) acc -= expf(p.sinks[h] - lse) * P.dpsum[base + i];
    }
  }
  __shared__ float part[kSinkThreads];
  part[threadIdx.x] = acc;
  __syncthreads();
  for (int w = kSinkThreads / 2; w > 0; w /= 2) {
    if (threadIdx.x < w) part[threadIdx.x] += part[threadIdx.x + w];
    __syncthreads();
  }
  if (threadIdx.x == 0) P.dsinks[h] = part[0];
}

}  // namespace

Status launch_bwd_dsinks(const BwdKernelParams& P, Stream stream) {
  bwd_dsinks_kernel<<<P.fwd.heads, kSinkThreads, 0, stream>>>(P);
  return detail::cuda_status(cudaGetLastError(), "attention sinks gradient launch");
}

}  // namespace flare::portable
