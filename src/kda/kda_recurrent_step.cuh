// KDA / GDN recurrent step (decode): a few tokens of each sequence applied to its fp32 state,
// which is read once and written once. The step is memory-bound (the K x V fp32 state dwarfs the
// tokens), so the kernel is laid out for bandwidth:
//
//   CTA    one (sequence, value head, BV-wide value slice), BV in {16, 32, 64}; BV / 16 warps,
//          warp w owns the 16 value columns [16 w, 16 w + 16) of the slice and needs no other
//          warp's data (all reductions run over K, inside the warp).
//   lane   (row lane r = lane / 4, column lane c = lane % 4): a float4 of columns 16 w + 4 c ..
//          + 3 on the K / 8 consecutive key rows [r K / 8, (r + 1) K / 8): 64 fp32 state registers
//          for K = 128. A warp's load instruction reads 8 rows x 64 contiguous bytes (whole 32-byte
//          sectors), the CTA its K x BV slice, all of it issued before anything waits on it.
//   tokens up to 8 at a time, staged in shared memory by one warp per token (q, k after the l2
//          norm, q scaled, exp of the activated gate, beta activated, v), then applied in order
//          while the state stays in registers.
//
// One token, per thread (S_i: its float4 of row i, k_i, q_i, d_i from shared memory):
//   S_i *= d_i;  p = sum_i k_i S_i                       decayed state, prediction S'^T k
//   p = sum over the 8 row lanes (3 xor shuffles)        every lane holds the 4 column sums
//   r = beta (v - p);  S_i += k_i r;  o = sum_i q_i S_i  delta-rule update, output S^T q
//   o = sum over the 8 row lanes; row lane 0 stores 4 outputs
// Bytes moved per step: the state read and written once (2 x 4 K V per (sequence, value head)),
// plus the tokens' q, k, g, v, beta and out.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "src/kda/kda_chunk_prep.cuh"  // load_scalar, kL2NormEps
#include "src/kda/kda_recurrent_params.h"
#include "src/kda/kda_tiles.cuh"

namespace flare::kda {

using detail::KdaRecurrentArgs;

// BV: the value columns of one CTA (V / BV CTAs per (sequence, value head)); the launch picks it
// from the grid size (kda_recurrent_dispatch.cu): wide slices at large batch, narrow ones when
// there are too few (sequence, value head) pairs to fill the GPU.
template <int K, int V, int BV>
struct RecurrentConfig {
  static_assert((K == 64 || K == 128) && (V == 64 || V == 128), "K and V in {64, 128}");
  static constexpr int kWarpColumns = 16;                // value columns per warp
  static_assert(BV % kWarpColumns == 0 && BV <= V && V % BV == 0, "BV: 16, 32 or 64 value columns");
  static constexpr int kWarps = BV / kWarpColumns;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kColumnLanes = kWarpColumns / 4;  // lanes across a row, a float4 each
  static constexpr int kRowLanes = 32 / kColumnLanes;    // lanes down the rows
  static constexpr int kRows = K / kRowLanes;            // state rows per lane (16 for K = 128)
  static constexpr int kTokenGroup = 8;                  // tokens staged in shared memory at once
  static constexpr int kKeysPerLane = K / 32;            // staging: channels per lane
  static constexpr int kValueLanes = BV / 4;             // staging: lanes loading 4 values each
  // Up to 168 registers: the 64 of a K = 128 state live across the token staging and the
  // scheduler's hoisted shared-memory reads (128 spilled). 12 resident warps per SM still keep up
  // to 96 KB of state loads in flight per SM, several times what the HBM bandwidth needs.
  static constexpr int kMinBlocks = 384 / kThreads;
  static_assert(kRows % 4 == 0, "rows are read from shared memory as float4");
};

template <int K, int BV>
struct RecurrentSmem {
  static constexpr int kGroup = 8;  // RecurrentConfig::kTokenGroup
  float q[kGroup][K];      // scale * q (after the l2 norm)
  float k[kGroup][K];      // k (after the l2 norm)
  float decay[kGroup][K];  // exp(activated gate), per channel (the same for all channels in GDN)
  float v[kGroup][BV];     // this CTA's value columns
  float beta[kGroup];      // activated beta
};

// N consecutive values as one vector load (the caller guarantees N * sizeof(E) alignment).
template <typename E, int N>
struct alignas(sizeof(E) * N) Pack {
  E e[N];
};

template <typename E, int N>
__device__ __forceinline__ void load_floats(const E* p, float (&x)[N]) {
  const Pack<E, N> pack = *reinterpret_cast<const Pack<E, N>*>(p);
#pragma unroll
  for (int i = 0; i < N; ++i) x[i] = to_float(pack.e[i]);
}

template <int N>
__device__ __forceinline__ void store_floats(float* p, const float (&x)[N]) {
  Pack<float, N> pack;
#pragma unroll
  for (int i = 0; i < N; ++i) pack.e[i] = x[i];
  *reinterpret_cast<Pack<float, N>*>(p) = pack;
}

// The activated log decay of a raw gate value (flare::KdaOptions): z = g + dt_bias, then
// -exp(A_log) softplus(z), or lower_bound sigmoid(exp(A_log) z) (A_log optional there); the same
// sigmoidf / softplusf as the chunked forward's.
__device__ __forceinline__ float activate_gate(const KdaRecurrentArgs& a, float g, float bias, float a_coef) {
  if (!a.gate_in_kernel) return g;
  const float z = g + bias;
  if (a.lower_bound < 0.f) return a.lower_bound * sigmoidf(a_coef * z);
  return -a_coef * softplusf(z);
}

// Sum over the 8 row lanes that share a column lane: afterwards every lane holds the same sums
// (each butterfly level adds the same pair, in either order).
template <int N>
__device__ __forceinline__ void sum_over_row_lanes(float (&x)[N]) {
#pragma unroll
  for (int off = 4; off < 32; off *= 2)
#pragma unroll
    for (int e = 0; e < N; ++e) x[e] += __shfl_xor_sync(0xffffffffu, x[e], off);
}

// Where one sequence's tokens are: batch row `batch`, time steps [t0, t0 + len).
struct SeqTokens {
  int64_t batch, t0;
  int len;
};

__device__ __forceinline__ SeqTokens tokens_of(const KdaRecurrentArgs& a, int n) {
  if (!a.varlen) return {n, 0, a.seqlen};
  int64_t begin, end;
  if (a.cu_int64) {
    begin = static_cast<const int64_t*>(a.cu_seqlens)[n];
    end = static_cast<const int64_t*>(a.cu_seqlens)[n + 1];
  } else {
    begin = static_cast<const int32_t*>(a.cu_seqlens)[n];
    end = static_cast<const int32_t*>(a.cu_seqlens)[n + 1];
  }
  return {0, begin, static_cast<int>(end - begin)};
}

// Stages tokens [t0, t0 + count) of one (sequence, value head) in shared memory: warp w takes
// tokens w, w + kWarps, ...; lane l the channels [l K / 32, (l + 1) K / 32) and, for l < BV / 4,
// the values v0 + [4 l, 4 l + 4) of the CTA's slice.
template <typename T, int K, int V, int BV>
__device__ __forceinline__ void stage_tokens(RecurrentSmem<K, BV>& s, const KdaRecurrentArgs& a, const SeqTokens& seq,
                                             int t0, int count, int h, int hv, int v0, float a_coef) {
  using C = RecurrentConfig<K, V, BV>;
  constexpr int kKeys = C::kKeysPerLane;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int c0 = lane * kKeys, e0 = lane * 4;
#pragma unroll 1
  for (int i = warp; i < count; i += C::kWarps) {
    const int64_t t = seq.t0 + t0 + i;
    float q[kKeys], k[kKeys], g[kKeys], v[4];
    load_floats(static_cast<const T*>(a.q) + seq.batch * a.q_st.batch + t * a.q_st.token + h * a.q_st.head + c0, q);
    load_floats(static_cast<const T*>(a.k) + seq.batch * a.k_st.batch + t * a.k_st.token + h * a.k_st.head + c0, k);
    if (lane < C::kValueLanes)
      load_floats(static_cast<const T*>(a.v) + seq.batch * a.v_st.batch + t * a.v_st.token + hv * a.v_st.head + v0 + e0, v);
    const int64_t g_at = seq.batch * a.g_st.batch + t * a.g_st.token + hv * a.g_st.head;
    if (a.scalar_gate) {
      const float bias = a.gate_in_kernel && a.dt_bias ? a.dt_bias[hv] : 0.f;
      const float d = __expf(activate_gate(a, load_scalar<T>(a.g, a.g_fp32, g_at), bias, a_coef));
#pragma unroll
      for (int e = 0; e < kKeys; ++e) g[e] = d;
    } else {
      if (a.g_fp32) load_floats(static_cast<const float*>(a.g) + g_at + c0, g);
      else load_floats(static_cast<const T*>(a.g) + g_at + c0, g);
#pragma unroll
      for (int e = 0; e < kKeys; ++e) {
        const float bias = a.gate_in_kernel && a.dt_bias ? a.dt_bias[hv * K + c0 + e] : 0.f;
        g[e] = __expf(activate_gate(a, g[e], bias, a_coef));
      }
    }
    float q_factor = a.scale, k_factor = 1.f;
    if (a.qk_l2norm) {
      float sums[2] = {0.f, 0.f};
#pragma unroll
      for (int e = 0; e < kKeys; ++e) sums[0] += q[e] * q[e], sums[1] += k[e] * k[e];
#pragma unroll
      for (int off = 16; off > 0; off /= 2)
#pragma unroll
        for (int j = 0; j < 2; ++j) sums[j] += __shfl_xor_sync(0xffffffffu, sums[j], off);
      q_factor *= rsqrtf(sums[0] + kL2NormEps);
      k_factor = rsqrtf(sums[1] + kL2NormEps);
    }
#pragma unroll
    for (int e = 0; e < kKeys; ++e) q[e] *= q_factor, k[e] *= k_factor;
    store_floats(&s.q[i][c0], q);
    store_floats(&s.k[i][c0], k);
    store_floats(&s.decay[i][c0], g);
    if (lane < C::kValueLanes) store_floats(&s.v[i][e0], v);
    if (lane == 0) {
      float beta = load_scalar<T>(a.beta, a.beta_fp32, seq.batch * a.beta_st.batch + t * a.beta_st.token + hv * a.beta_st.head);
      if (a.beta_sigmoid) beta = a.beta_factor * sigmoidf(beta);
      s.beta[i] = beta;
    }
  }
}

template <typename T, int K, int V, int BV>
__global__ void __launch_bounds__(RecurrentConfig<K, V, BV>::kThreads, RecurrentConfig<K, V, BV>::kMinBlocks)
    kda_recurrent_step_kernel(const KdaRecurrentArgs a) {
  using C = RecurrentConfig<K, V, BV>;
  constexpr int R = C::kRows, kSlices = V / BV;
  static_assert(RecurrentSmem<K, BV>::kGroup == C::kTokenGroup, "one staged token group");
  __shared__ __align__(16) RecurrentSmem<K, BV> s;

  // CTA (n, hv, slice): consecutive CTAs share a sequence's tokens (and, with GVA, its q and k).
  const int head = blockIdx.x / kSlices, v0 = (blockIdx.x % kSlices) * BV;
  const int n = head / a.heads_v, hv = head % a.heads_v;
  const int h = hv / (a.heads_v / a.heads);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int row0 = (lane / C::kColumnLanes) * R;                             // first of this lane's rows
  const int vcol = warp * C::kWarpColumns + (lane % C::kColumnLanes) * 4;    // its 4 columns in the slice
  const int col = v0 + vcol;                                                 // ... in the head
  const bool row_leader = lane < C::kColumnLanes;                             // row lane 0: stores outputs

  const SeqTokens seq = tokens_of(a, n);
  const int slot = a.state == nullptr ? -1 : a.state_indices ? a.state_indices[n] : n;
  T* out = static_cast<T*>(a.out) + seq.batch * a.out_st.batch + seq.t0 * a.out_st.token + hv * a.out_st.head + col;

  const int64_t head_offset = (static_cast<int64_t>(hv) * K + row0) * V + col;
  float* final_state =
      a.final_state ? a.final_state + static_cast<int64_t>(n) * a.heads_v * K * V + head_offset : nullptr;

  // An index beyond the pool is never dereferenced: NaN outputs (and final state) show the bug.
  if (slot >= a.num_slots && a.state != nullptr) {
    const float nan = __int_as_float(0x7fffffff);
    if (row_leader)
      for (int t = 0; t < seq.len; ++t)
        *reinterpret_cast<uint2*>(out + t * a.out_st.token) = make_uint2(pack2<T>(nan, nan), pack2<T>(nan, nan));
    if (final_state != nullptr)
      for (int i = 0; i < R; ++i) *reinterpret_cast<float4*>(final_state + i * V) = make_float4(nan, nan, nan, nan);
    return;
  }
  // No token: the pool slot stays as it is; only a separate final_state needs writing.
  if (seq.len == 0 && a.final_state == nullptr) return;

  // ---- the state: every load issued before the tokens are staged ------------------------------
  float S[R][4];
  if (slot >= 0) {
    const float* src = a.state + slot * a.slot_stride + head_offset;
#pragma unroll
    for (int i = 0; i < R; ++i) {
      const float4 x = __ldcs(reinterpret_cast<const float4*>(src + i * V));
      S[i][0] = x.x, S[i][1] = x.y, S[i][2] = x.z, S[i][3] = x.w;
    }
  } else {
#pragma unroll
    for (int i = 0; i < R; ++i) S[i][0] = S[i][1] = S[i][2] = S[i][3] = 0.f;
  }

  const float a_coef = a.gate_in_kernel && a.A_log ? __expf(a.A_log[hv]) : 1.f;
#pragma unroll 1
  for (int t0 = 0; t0 < seq.len; t0 += C::kTokenGroup) {
    const int count = min(C::kTokenGroup, seq.len - t0);
    if (t0 > 0) __syncthreads();  // the previous group is consumed
    stage_tokens<T, K, V, BV>(s, a, seq, t0, count, h, hv, v0, a_coef);
    __syncthreads();

#pragma unroll 1
    for (int i = 0; i < count; ++i) {
      const float* keys = &s.k[i][row0];
      const float* decay = &s.decay[i][row0];
      const float* queries = &s.q[i][row0];
      // S <- Diag(decay) S;  p = S^T k
      float p[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int r4 = 0; r4 < R; r4 += 4) {
        const float4 d4 = *reinterpret_cast<const float4*>(decay + r4);
        const float4 k4 = *reinterpret_cast<const float4*>(keys + r4);
        const float d[4] = {d4.x, d4.y, d4.z, d4.w}, kk[4] = {k4.x, k4.y, k4.z, k4.w};
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            S[r4 + j][e] *= d[j];
            p[e] = fmaf(kk[j], S[r4 + j][e], p[e]);
          }
      }
      sum_over_row_lanes(p);
      // r = beta (v - p);  S <- S + k r^T;  o = S^T q
      const float beta = s.beta[i];
      const float4 v4 = *reinterpret_cast<const float4*>(&s.v[i][vcol]);
      const float r[4] = {beta * (v4.x - p[0]), beta * (v4.y - p[1]), beta * (v4.z - p[2]), beta * (v4.w - p[3])};
      float o[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int r4 = 0; r4 < R; r4 += 4) {
        const float4 k4 = *reinterpret_cast<const float4*>(keys + r4);
        const float4 q4 = *reinterpret_cast<const float4*>(queries + r4);
        const float kk[4] = {k4.x, k4.y, k4.z, k4.w}, qq[4] = {q4.x, q4.y, q4.z, q4.w};
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            S[r4 + j][e] = fmaf(kk[j], r[e], S[r4 + j][e]);
            o[e] = fmaf(qq[j], S[r4 + j][e], o[e]);
          }
      }
      sum_over_row_lanes(o);
      if (row_leader)
        *reinterpret_cast<uint2*>(out + (t0 + i) * a.out_st.token) = make_uint2(pack2<T>(o[0], o[1]), pack2<T>(o[2], o[3]));
    }
  }

  // ---- the state, once: to final_state[n], or back to its pool slot ----------------------------
  float* dst = final_state ? final_state : slot >= 0 ? a.state + slot * a.slot_stride + head_offset : nullptr;
  if (dst != nullptr) {
#pragma unroll
    for (int i = 0; i < R; ++i) __stcs(reinterpret_cast<float4*>(dst + i * V), make_float4(S[i][0], S[i][1], S[i][2], S[i][3]));
  }
}

template <typename T, int K, int V, int BV>
cudaError_t launch_recurrent(const KdaRecurrentArgs& a, cudaStream_t stream) {
  const int ctas = a.num_seqs * a.heads_v * (V / BV);
  kda_recurrent_step_kernel<T, K, V, BV><<<ctas, RecurrentConfig<K, V, BV>::kThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

template <typename T, int K, int V>
cudaError_t launch_recurrent_for_width(const KdaRecurrentArgs& a, int bv, cudaStream_t stream) {
  if (bv == 16) return launch_recurrent<T, K, V, 16>(a, stream);
  if (bv == 32) return launch_recurrent<T, K, V, 32>(a, stream);
  return launch_recurrent<T, K, V, 64>(a, stream);
}

// `bv`: 16, 32 or 64 value columns per CTA (recurrent_slice_width).
template <typename T>
cudaError_t launch_recurrent_for_dims(const KdaRecurrentArgs& a, int bv, cudaStream_t stream) {
  if (a.key_dim == 64)
    return a.value_dim == 64 ? launch_recurrent_for_width<T, 64, 64>(a, bv, stream)
                             : launch_recurrent_for_width<T, 64, 128>(a, bv, stream);
  return a.value_dim == 64 ? launch_recurrent_for_width<T, 128, 64>(a, bv, stream)
                           : launch_recurrent_for_width<T, 128, 128>(a, bv, stream);
}

}  // namespace flare::kda
