// The simple attention forward: one CTA per (query row, head, sequence), fp32 arithmetic,
// keys in chunks with an online softmax. Slow and obviously right: the large-size reference.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cfloat>

#include "src/attention/fwd_params.h"
#include "src/common/cuda_check.h"

namespace flare::detail {
namespace {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kChunk = 1024;  // keys scored per round
constexpr int kChannelsPerThread = kMaxHeadDim / kThreads;

__device__ float to_float(__half x) { return __half2float(x); }
__device__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T> __device__ T from_float(float x);
template <> __device__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

template <typename Op>
__device__ float block_reduce(float x, float* scratch, Op op) {
  for (int o = 16; o > 0; o >>= 1) x = op(x, __shfl_xor_sync(0xffffffffu, x, o));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();  // scratch may still be read from the previous reduction
  if (lane == 0) scratch[warp] = x;
  __syncthreads();
  float r = scratch[0];
  for (int w = 1; w < kWarps; ++w) r = op(r, scratch[w]);
  return r;
}

template <typename T>
__global__ void __launch_bounds__(kThreads) naive_fwd_kernel(FwdKernelParams p) {
  const int i = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const SeqInfo s = seq_info(p, b);
  if (i >= s.seqlen_q) return;
  const int hk = h / p.group, d = p.head_dim;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __shared__ float q_row[kMaxHeadDim];
  __shared__ float scores[kChunk];
  __shared__ float scratch[kWarps];

  const T* q = static_cast<const T*>(p.q) + row_offset(p.q_str, b, s.q_start + i, h);
  for (int c = threadIdx.x; c < d; c += kThreads) q_row[c] = to_float(q[c]);
  const T* k = static_cast<const T*>(p.k);
  const T* v = static_cast<const T*>(p.v);

  const sched::Band band = band_of(p, s);
  const int lo = band.row_lo(i), hi = band.row_hi(i, s.seqlen_k);
  const float sink = p.sinks ? p.sinks[h] : -INFINITY;
  float m = sink, l = p.sinks ? 1.f : 0.f;  // running max and denominator (natural log units)
  float acc[kChannelsPerThread] = {};
  __syncthreads();

  for (int start = lo; start < hi; start += kChunk) {
    const int n = min(kChunk, hi - start);
    for (int jj = warp; jj < n; jj += kWarps) {
      const T* kr = k + row_offset(p.k_str, b, s.k_start + start + jj, hk);
      float dot = 0.f;
      for (int c = lane; c < d; c += 32) dot += q_row[c] * to_float(kr[c]);
      for (int o = 16; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
      float x = dot * p.scale;
      if (p.softcap > 0.f) x = p.softcap * tanhf(x / p.softcap);
      if (lane == 0) scores[jj] = x;
    }
    __syncthreads();
    float cm = -INFINITY;
    for (int jj = threadIdx.x; jj < n; jj += kThreads) cm = fmaxf(cm, scores[jj]);
    cm = block_reduce(cm, scratch, [](float a, float c) { return fmaxf(a, c); });
    const float m_new = fmaxf(m, cm);
    const float alpha = m == -INFINITY ? 0.f : expf(m - m_new);
    float sum = 0.f;
    for (int jj = threadIdx.x; jj < n; jj += kThreads) {
      float e = expf(scores[jj] - m_new);
      scores[jj] = e;
      sum += e;
    }
    sum = block_reduce(sum, scratch, [](float a, float c) { return a + c; });  // also syncs scores
    l = l * alpha + sum;
    m = m_new;
#pragma unroll
    for (int t = 0; t < kChannelsPerThread; ++t) {
      const int c = threadIdx.x + t * kThreads;
      if (c >= d) continue;
      float a = acc[t] * alpha;
      for (int jj = 0; jj < n; ++jj) a += scores[jj] * to_float(v[row_offset(p.v_str, b, s.k_start + start + jj, hk) + c]);
      acc[t] = a;
    }
    __syncthreads();
  }

  const bool seen = hi > lo || p.sinks != nullptr;
  T* out = static_cast<T*>(p.out) + row_offset(p.out_str, b, s.q_start + i, h);
#pragma unroll
  for (int t = 0; t < kChannelsPerThread; ++t) {
    const int c = threadIdx.x + t * kThreads;
    if (c < d) out[c] = from_float<T>(seen && l > 0.f ? acc[t] / l : 0.f);
  }
  if (p.lse != nullptr && threadIdx.x == 0)
    p.lse[b * p.lse_batch_stride + h * p.lse_head_stride + s.q_start + i] = seen ? m + logf(l) : INFINITY;
}

}  // namespace

Status naive_attention_forward(const FwdKernelParams& p, DType dtype, Stream stream) {
  if (p.seqlen_q == 0 || p.batch == 0) return Status::Ok();
  dim3 grid(p.seqlen_q, p.heads, p.batch);
  if (dtype == DType::kBFloat16) naive_fwd_kernel<__nv_bfloat16><<<grid, kThreads, 0, stream>>>(p);
  else naive_fwd_kernel<__half><<<grid, kThreads, 0, stream>>>(p);
  return cuda_status(cudaGetLastError(), "naive attention forward launch");
}

}  // namespace flare::detail
