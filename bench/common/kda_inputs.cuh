// Shaping random KDA benchmark inputs in place (bench_kda, bench_kda_recurrent).
#pragma once

#include <cuda_bf16.h>

#include <cmath>
#include <cstdint>

namespace flare::bench {

// Per row of kDim channels (a warp of blockDim (32, rows per block)): k to unit norm (keeps the
// delta rule contractive), g to a log decay -0.01 - 0.2 min(|g|, g_abs_max), beta into (0.1, 0.9);
// in layer mode k, g and beta stay raw (the kernel applies l2norm, the gate and the sigmoid).
template <int kDim>
__global__ void shape_kda_inputs(__nv_bfloat16* k, float* g, __nv_bfloat16* beta, int64_t rows, bool layer_mode,
                                 float g_abs_max) {
  const int64_t row = blockIdx.x * int64_t{blockDim.y} + threadIdx.y;
  if (row >= rows) return;
  const int lane = threadIdx.x;
  float x[kDim / 32], sum = 0.f;
  for (int e = 0; e < kDim / 32; ++e) {
    x[e] = __bfloat162float(k[row * kDim + lane + 32 * e]);
    sum += x[e] * x[e];
  }
  for (int off = 16; off > 0; off /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, off);
  for (int e = 0; e < kDim / 32; ++e) {
    k[row * kDim + lane + 32 * e] = __float2bfloat16(layer_mode ? x[e] : x[e] * rsqrtf(sum));
    float& ge = g[row * kDim + lane + 32 * e];
    if (!layer_mode) ge = -0.01f - 0.2f * fminf(fabsf(ge), g_abs_max);
  }
  if (lane == 0 && !layer_mode) beta[row] = __float2bfloat16(0.5f + 0.4f * tanhf(__bfloat162float(beta[row])));
}

}  // namespace flare::bench
