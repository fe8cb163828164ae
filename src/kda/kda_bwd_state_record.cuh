// KDA backward, stage 1 of 3 after the prep: the forward's sequential pass again, recording what
// the per-chunk gradients need instead of the output. One CTA per (sequence, value head, BV-wide
// value slice); warp w owns the 16 value columns [16 w, 16 w + 16) of the slice, with the state
// kept transposed, S^T [16 values x K keys], in MMA accumulators (as kda_state_pass.cuh):
//   h^T    = S^T                       stored per chunk, rounded as the forward's MMA operand
//   vnew^T = u^T - S^T w^T              stored per chunk
//   S^T    = S^T Diag(decay) + vnew^T kg
// Both stored tiles are [V][K] / [V][64] per (chunk, value head): transposed, as the
// accumulators hold them.
#pragma once

#include "src/kda/kda_bwd_params.h"
#include "src/kda/kda_chunk_prep.cuh"
#include "src/kda/kda_tiles.cuh"

namespace flare::kda {

using detail::KdaBwdArgs;

template <int K, int BV>
struct RecordConfig {
  static_assert(BV % 16 == 0 && BV <= 64, "BV: 16, 32 or 64 value columns");
  static constexpr int kWarps = BV / 16;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kStages = 3;
  static constexpr int kLdK = K + 8;  // 16-byte padding: conflict-free ldmatrix
  static constexpr int kLdU = BV + 8;
};

template <typename T, int K, int BV>
struct RecordStage {
  using C = RecordConfig<K, BV>;
  T w[kKdaChunk][C::kLdK];
  T kg[kKdaChunk][C::kLdK];
  T u[kKdaChunk][C::kLdU];  // this CTA's value slice
  float decay[K];
};

template <typename T, int K, int V, int BV>
__device__ __forceinline__ void load_record_chunk(RecordStage<T, K, BV>& st, const KdaFwdArgs& a, int chunk, int hv,
                                                  int v0) {
  constexpr int kThreads = RecordConfig<K, BV>::kThreads;
  const int64_t slot = static_cast<int64_t>(chunk) * a.heads_v + hv;
  const T* w = static_cast<const T*>(a.w) + slot * kKdaChunk * K;
  const T* kg = static_cast<const T*>(a.kg) + slot * kKdaChunk * K;
  const T* u = static_cast<const T*>(a.u) + slot * kKdaChunk * V + v0;
  using C = RecordConfig<K, BV>;
  load_rows<T, K, C::kLdK, kThreads, true>(st.w, w, K);
  load_rows<T, K, C::kLdK, kThreads, true>(st.kg, kg, K);
  load_rows<T, BV, C::kLdU, kThreads, true>(st.u, u, V);
  const float* decay = a.decay + slot * K;
  for (int idx = threadIdx.x; idx < K / 4; idx += kThreads) cp_async_16(&st.decay[idx * 4], decay + idx * 4, true);
}

// The rows this thread holds of a transposed accumulator block X^T[16 x 8 * N8] (rows r0 + g and
// r0 + g + 8, columns 8 nt + 2 t and + 1), rounded to T, into a row-major [rows][ld] tile.
template <typename T, int N8>
__device__ __forceinline__ void store_rows(T* tile, int ld, int r0, const float (&acc)[N8][4]) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
#pragma unroll
  for (int nt = 0; nt < N8; ++nt) {
    T* p = tile + (r0 + g) * ld + nt * 8 + 2 * t;
    *reinterpret_cast<uint32_t*>(p) = pack2<T>(acc[nt][0], acc[nt][1]);
    *reinterpret_cast<uint32_t*>(p + 8 * ld) = pack2<T>(acc[nt][2], acc[nt][3]);
  }
}

template <typename T, int K, int V, int BV>
__global__ void __launch_bounds__(RecordConfig<K, BV>::kThreads) kda_state_record_kernel(const KdaBwdArgs b) {
  using C = RecordConfig<K, BV>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  auto* stages = reinterpret_cast<RecordStage<T, K, BV>*>(smem_raw);
  const KdaFwdArgs& a = b.fwd;

  const int n = sequence_of_row(a, blockIdx.z), hv = blockIdx.y, v0 = blockIdx.x * BV;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int vw = warp * 16;
  const auto [begin, end] = chunk_range(a, n);

  float S[K / 8][4];  // S^T: rows v = v0 + vw + g (+8), columns c = 8 nt + 2 t (+1)
  const int64_t state_base = (static_cast<int64_t>(n) * a.heads_v + hv) * K * V + v0 + vw + g;
  load_state_frag<K>(S, a.initial_state ? a.initial_state + state_base : nullptr, V, t);

#pragma unroll
  for (int s = 0; s < C::kStages; ++s) {
    if (begin + s < end) load_record_chunk<T, K, V, BV>(stages[s], a, begin + s, hv, v0);
    cp_async_commit();
  }

  for (int chunk = begin; chunk < end; ++chunk) {
    const int stage = (chunk - begin) % C::kStages;
    const RecordStage<T, K, BV>& st = stages[stage];
    const int64_t slot = static_cast<int64_t>(chunk) * a.heads_v + hv;
    cp_async_wait<C::kStages - 1>();
    __syncthreads();

    // h^T = S^T (as the MMA operand rounds it)
    store_rows<T>(static_cast<T*>(b.h) + slot * V * K, K, v0 + vw, S);

    // vnew^T = u^T - S^T w^T
    float vnew[kKdaChunk / 8][4];
    load_frag_t<kKdaChunk>(vnew, st.u, vw, g, t);
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk) {
      uint32_t s_a[4];
      to_a<T>(s_a, S, kk);
      const uint32_t neg_s[4] = {neg2(s_a[0]), neg2(s_a[1]), neg2(s_a[2]), neg2(s_a[3])};
#pragma unroll
      for (int np = 0; np < kKdaChunk / 16; ++np) {
        uint32_t bw[4];
        load_b_rows(bw, &st.w[0][0], C::kLdK, np * 16, kk * 16);
        mma_pair<T>(vnew[2 * np], vnew[2 * np + 1], neg_s, bw);
      }
    }
    store_rows<T>(static_cast<T*>(b.vnew) + slot * V * kKdaChunk, kKdaChunk, v0 + vw, vnew);

    // S^T <- S^T Diag(decay) + vnew^T kg
    uint32_t aV[kKdaChunk / 16][4];
#pragma unroll
    for (int jj = 0; jj < kKdaChunk / 16; ++jj) to_a<T>(aV[jj], vnew, jj);
    decay_state_frag<K>(S, st.decay, t);
    add_chunk_product<T, K>(S, aV, &st.kg[0][0], C::kLdK);

    __syncthreads();  // every warp is done with this stage
    if (chunk + C::kStages < end) load_record_chunk<T, K, V, BV>(stages[stage], a, chunk + C::kStages, hv, v0);
    cp_async_commit();
  }
}

}  // namespace flare::kda
