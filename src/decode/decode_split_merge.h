// Decode's split-KV merges inside the attention kernel (decode_key_groups_kernel.h's header says
// when each runs): the in-kernel combine, where the last CTA of a (sequence, head block) merges
// every split's partial states through L2, and the cluster combine, where the CTAs of a cluster
// merge their states through distributed shared memory; both weigh the states by their LSE as
// merge_states_kernel (decode_kernel.cu) does.
#pragma once

#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "src/common/named_barrier.h"
#include "src/decode/decode_kernel.h"
#include "src/decode/decode_schedule.h"
#include "src/decode/decode_timeline.h"

// A timeline stamp (FLARE_DECODE_TIMELINE builds; decode_timeline.h), nothing otherwise.
#if FLARE_DECODE_TIMELINE
#define FLARE_DECODE_MARK(cond, mark) \
  do {                                \
    if (cond) decode_mark(p.timeline, mark); \
  } while (0)
#else
#define FLARE_DECODE_MARK(cond, mark) \
  do {                                \
  } while (0)
#endif

namespace flare::decode {

namespace device {

// A barrier of the consumer warps only (the producer warp has returned by then).
__device__ __forceinline__ void consumer_sync(int threads) { ::flare::device::named_sync<1>(threads); }

// kVec consecutive floats (2, 4 or 8, 8-byte aligned or better) read through L2 only: partial
// states written by other SMs during this kernel must not come from a stale L1 line.
template <int kVec>
__device__ __forceinline__ void load_l2(const float* src, float (&x)[kVec]) {
  if constexpr (kVec == 2) {
    const float2 v = __ldcg(reinterpret_cast<const float2*>(src));
    x[0] = v.x, x[1] = v.y;
  } else {
#pragma unroll
    for (int i = 0; i < kVec; i += 4) {
      const float4 v = __ldcg(reinterpret_cast<const float4*>(src + i));
      x[i] = v.x, x[i + 1] = v.y, x[i + 2] = v.z, x[i + 3] = v.w;
    }
  }
}

template <typename T, int kVec>
__device__ __forceinline__ void store_row_piece(T* dst, const float (&x)[kVec]) {
  if constexpr (kVec == 2) {
    *reinterpret_cast<uint32_t*>(dst) = ElemTraits<T>::pack(x[0], x[1]);
  } else {
#pragma unroll
    for (int i = 0; i < kVec; i += 4) {
      uint2 packed;
      packed.x = ElemTraits<T>::pack(x[i], x[i + 1]);
      packed.y = ElemTraits<T>::pack(x[i + 2], x[i + 3]);
      *reinterpret_cast<uint2*>(dst + i) = packed;
    }
  }
}

// The in-kernel combine of one CTA: its hpc x p.rows rows (row rr: KV head hk0 + rr / p.rows,
// packed row rr % p.rows), each the merge of num_splits partial states by their LSE, as
// merge_states_kernel (decode_kernel.cu) computes it: lse = M + log(sum_s exp(lse_s - M)),
// out = sum_s exp(lse_s - lse) partial_s, states of weight 0 never read; a row whose states all
// have LSE -inf (it saw no key) gets out = 0 and lse = +inf, as the standard kernel writes.
// wpr warps share a row (states s = sub, sub + wpr, ...; kLoads loads in flight per warp); each
// warp keeps the row's weights in its own slice of `scratch`, and the row's warps add their sums
// through it. scratch: kWarps x (kHeadDim + kCombineMaxStates) floats of shared memory. Called
// by every consumer thread (it has consumer barriers).
template <int kHeadDim, typename T, int kWarps>
__device__ __forceinline__ void combine_splits(const DecodeKernelParams& p, int b, int hk0, int hpc, float* scratch) {
  constexpr int kVec = kHeadDim / 32;  // columns per lane
  constexpr int kLoads = 8;            // states in flight per warp
  constexpr float kLog2e = 1.4426950408889634f;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int total = hpc * p.rows, S = p.num_splits;
  const int wpr = combine_warps_per_row(kWarps, total);
  const int rows_per_pass = kWarps / wpr, slot = warp / wpr, sub = warp % wpr;
  float* const red = scratch;                                                // [kWarps][kHeadDim]
  float* const weights = scratch + kWarps * kHeadDim + warp * kCombineMaxStates;  // this warp's
  for (int base = 0; base < total; base += rows_per_pass) {  // the same trip count in every warp
    const int rr = base + slot;
    const bool active = rr < total;
    float acc[kVec];
#pragma unroll
    for (int i = 0; i < kVec; ++i) acc[i] = 0.f;
    float lse = INFINITY;
    int64_t qrow = 0;
    int tq = 0, h = 0;
    __syncwarp();  // the previous pass's reads of `weights` are done
    if (active) {  // warp-uniform
      const int r = rr % p.rows;
      tq = r / p.group;
      h = (hk0 + rr / p.rows) * p.group + r % p.group;
      qrow = (int64_t{b} * p.heads_q + h) * p.q_len + tq;
      const float* lse_in = p.partial_lse + qrow * S;
      const float* states = p.partial_out + qrow * S * kHeadDim + lane * kVec;
      float m = -INFINITY;
      for (int s = lane; s < S; s += 32) {
        weights[s] = __ldcg(lse_in + s);
        m = fmaxf(m, weights[s]);
      }
#pragma unroll
      for (int o = 16; o > 0; o /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
      if (m != -INFINITY) {  // warp-uniform; else the row saw no key: out 0, lse +inf
        float sum = 0.f;
        for (int s = lane; s < S; s += 32) sum += exp2f((weights[s] - m) * kLog2e);
#pragma unroll
        for (int o = 16; o > 0; o /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, o);
        lse = m + logf(sum);
        for (int s = lane; s < S; s += 32) weights[s] = exp2f((weights[s] - lse) * kLog2e);  // 0 for -inf
        __syncwarp();
        for (int s0 = sub; s0 < S; s0 += wpr * kLoads) {
          float x[kLoads][kVec], wt[kLoads];
#pragma unroll
          for (int u = 0; u < kLoads; ++u) {
            const int s = s0 + wpr * u;
            wt[u] = s < S ? weights[s] : 0.f;
            if (wt[u] != 0.f) {
              load_l2<kVec>(states + int64_t{s} * kHeadDim, x[u]);
            } else {
#pragma unroll
              for (int i = 0; i < kVec; ++i) x[u][i] = 0.f;
            }
          }
#pragma unroll
          for (int u = 0; u < kLoads; ++u)
#pragma unroll
            for (int i = 0; i < kVec; ++i) acc[i] = fmaf(wt[u], x[u][i], acc[i]);
        }
      }
    }
    if (wpr > 1) {  // the row's warps add their sums (uniform: every warp takes the barriers)
      consumer_sync(32 * kWarps);  // the previous pass's reads of red are done
      if (active) {
#pragma unroll
        for (int i = 0; i < kVec; ++i) red[warp * kHeadDim + lane * kVec + i] = acc[i];
      }
      consumer_sync(32 * kWarps);
      if (active && sub == 0) {
        for (int k = 1; k < wpr; ++k)
#pragma unroll
          for (int i = 0; i < kVec; ++i) acc[i] += red[(warp + k) * kHeadDim + lane * kVec + i];
      }
    }
    if (active && sub == 0) {
      T* dst = static_cast<T*>(p.out) + b * p.out_stride_b + tq * p.out_stride_t + h * p.out_stride_h + lane * kVec;
      store_row_piece<T, kVec>(dst, acc);
      if (lane == 0 && p.lse != nullptr) p.lse[qrow] = lse;
    }
  }
}

// The cluster barrier in two halves. The arrive is a release (ptxas: a GPU-scope fence and the
// wait for the thread's distributed-shared-memory transactions), so it costs little where no global
// store is in flight and about 0.3 us after the output's stores (session 22's timeline). A relaxed
// arrive skips both and faulted: a peer may then leave while its shared memory is still read.
__device__ __forceinline__ void cluster_arrive() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void cluster_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.wait;\n" ::: "memory");
#endif
}

// The cluster combine's merge (decode_key_groups_kernel.h's header): called by every consumer
// thread of every CTA of the cluster (the producer warps take the two cluster barriers alone),
// after each CTA's consumers left their states in `states` (fp32 [hpc][16][stride]: head h_local's
// row r at (h_local * 16 + r) * stride) and `state_lse` ([hpc][16], natural log, -inf for a split
// that saw no key). Piece i (of hpc x rows x head_dim / 4) belongs to CTA rank i % num_splits,
// thread i / num_splits (strided by `threads`). A thread first loads its piece from every split
// (all the distributed-shared-memory loads in flight at once: one round trip, not one per split),
// then weighs them by exp(lse - max lse); out 0 and lse +inf for a row no split saw, as
// combine_splits. The last cluster barrier keeps every CTA's shared memory alive until its peers
// have read it; where a thread has at most one piece it arrives before storing its piece.
template <int kHeadDim, typename T>
__device__ __forceinline__ void cluster_merge(const DecodeKernelParams& p, int b, int hk0, int hpc, const float* states,
                                              int stride, const float* state_lse, int threads) {
  namespace cg = cooperative_groups;
  constexpr int kPieces = kHeadDim / 4;
  cg::cluster_group cluster = cg::this_cluster();
  cluster.sync();  // every split's states are in its shared memory (a release arrive: a GPU-scope fence)
  FLARE_DECODE_MARK(threadIdx.x == 0, kDecodeMarkClusterIn);
  const int S = p.num_splits, rank = static_cast<int>(cluster.block_rank());
  const int total = hpc * p.rows * kPieces;
  // Merges piece idx; `loaded` runs once its reads of the peers' shared memory are done.
  auto merge_piece = [&](int idx, auto&& loaded) {
    const int col = (idx % kPieces) * 4, head_row = idx / kPieces;
    const int r = head_row % p.rows, h_local = head_row / p.rows;
    const int slot = h_local * 16 + r;
    float l[kDecodeMaxClusterSplits];
    float4 x[kDecodeMaxClusterSplits];
#pragma unroll
    for (int s = 0; s < kDecodeMaxClusterSplits; ++s) {
      if (s < S) {
        l[s] = *cluster.map_shared_rank(state_lse + slot, s);
        x[s] = *reinterpret_cast<const float4*>(cluster.map_shared_rank(states + slot * stride + col, s));
      }
    }
    float m = -INFINITY;
#pragma unroll
    for (int s = 0; s < kDecodeMaxClusterSplits; ++s)
      if (s < S) m = fmaxf(m, l[s]);
    float sum = 0.f;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    if (m != -INFINITY) {
#pragma unroll
      for (int s = 0; s < kDecodeMaxClusterSplits; ++s) {
        if (s < S) {
          const float w = __expf(l[s] - m);  // 0 for a split that saw no key (its state is 0)
          sum += w;
          acc.x = fmaf(w, x[s].x, acc.x), acc.y = fmaf(w, x[s].y, acc.y);
          acc.z = fmaf(w, x[s].z, acc.z), acc.w = fmaf(w, x[s].w, acc.w);
        }
      }
    }
    loaded();
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
    const int tq = r / p.group, h = (hk0 + h_local) * p.group + r % p.group;
    uint2 packed;
    packed.x = ElemTraits<T>::pack(acc.x * inv, acc.y * inv);
    packed.y = ElemTraits<T>::pack(acc.z * inv, acc.w * inv);
    T* dst = static_cast<T*>(p.out) + b * p.out_stride_b + tq * p.out_stride_t + h * p.out_stride_h + col;
    *reinterpret_cast<uint2*>(dst) = packed;
    if (col == 0 && p.lse != nullptr) {
      const int64_t qrow = (int64_t{b} * p.heads_q + h) * p.q_len + tq;
      p.lse[qrow] = sum > 0.f ? m + logf(sum) : INFINITY;
    }
  };
  if (total <= S * threads) {  // at most one piece a thread (uniform over the cluster)
    const int idx = rank + S * static_cast<int>(threadIdx.x);
    if (idx < total)
      merge_piece(idx, cluster_arrive);
    else
      cluster_arrive();
  } else {
    for (int idx = rank + S * static_cast<int>(threadIdx.x); idx < total; idx += S * threads) merge_piece(idx, [] {});
    cluster_arrive();
  }
  FLARE_DECODE_MARK(threadIdx.x == 0, kDecodeMarkClusterMerged);
  cluster_wait();
}

}  // namespace device

}  // namespace flare::decode
