// KDA backward, stage 2 of 3: the sequential pass in reverse, carrying the fp32 gradient dS of
// the state at the END of the current chunk, from d_final_state (or zero) at the last chunk of a
// sequence back to d_initial_state. One CTA per (sequence, value head, BV-wide value slice); warp w
// owns the 16 value columns [16 w, 16 w + 16) of the slice and keeps dS^T [16 values x K keys] in
// MMA accumulators. Per chunk, with qg and P carrying the scale:
//   dh^T     = dS^T                              stored (what the chunk's dk, dg need)
//   dvnew^T  = dO^T P + dS^T kg^T                stored
//   dS^T     = dS^T Diag(decay) + dO^T qg - dvnew^T w
// None of this needs the forward's states: the recurrence is linear in S.
#pragma once

#include "src/kda/kda_bwd_params.h"
#include "src/kda/kda_bwd_state_record.cuh"
#include "src/kda/kda_chunk_prep.cuh"
#include "src/kda/kda_tiles.cuh"

namespace flare::kda {

template <int K, int BV>
struct BwdStateConfig {
  static_assert(BV % 16 == 0 && BV <= 64, "BV: 16, 32 or 64 value columns");
  static constexpr int kWarps = BV / 16;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kStages = 3;
  static constexpr int kLdK = K + 8;
  static constexpr int kLdP = kKdaChunk + 8;
  static constexpr int kLdO = BV + 8;
};

template <typename T, int K, int BV>
struct BwdStateStage {
  using C = BwdStateConfig<K, BV>;
  T w[kKdaChunk][C::kLdK];
  T qg[kKdaChunk][C::kLdK];
  T kg[kKdaChunk][C::kLdK];
  T P[kKdaChunk][C::kLdP];
  T dO[kKdaChunk][C::kLdO];  // this CTA's value slice of dout; rows past the chunk are zeros
  float decay[K];
};

template <typename T, int K, int V, int BV>
__device__ __forceinline__ void load_bwd_chunk(BwdStateStage<T, K, BV>& st, const KdaBwdArgs& b, int chunk, int hv,
                                               int v0) {
  constexpr int kThreads = BwdStateConfig<K, BV>::kThreads;
  const KdaFwdArgs& a = b.fwd;
  const int64_t slot = static_cast<int64_t>(chunk) * a.heads_v + hv;
  const T* w = static_cast<const T*>(a.w) + slot * kKdaChunk * K;
  const T* qg = static_cast<const T*>(a.qg) + slot * kKdaChunk * K;
  const T* kg = static_cast<const T*>(a.kg) + slot * kKdaChunk * K;
  const T* P = static_cast<const T*>(a.P) + slot * kKdaChunk * kKdaChunk;
  using C = BwdStateConfig<K, BV>;
  load_rows<T, K, C::kLdK, kThreads, true>(st.w, w, K);
  load_rows<T, K, C::kLdK, kThreads, true>(st.qg, qg, K);
  load_rows<T, K, C::kLdK, kThreads, true>(st.kg, kg, K);
  load_rows<T, kKdaChunk, C::kLdP, kThreads, true, true>(st.P, P, kKdaChunk);  // P: its lower blocks
  const KdaChunk ch = chunk_at(a, chunk);
  const T* dO = static_cast<const T*>(b.dout) + ch.batch * b.dout_st.batch + ch.t0 * b.dout_st.token +
                hv * b.dout_st.head + v0;
  load_rows<T, BV, C::kLdO, kThreads>(st.dO, dO, b.dout_st.token, ch.len);
  const float* decay = a.decay + slot * K;
  for (int idx = threadIdx.x; idx < K / 4; idx += kThreads) cp_async_16(&st.decay[idx * 4], decay + idx * 4, true);
}

// The A fragment of the 16x16 block (rows m0.., k-columns k0..) of the TRANSPOSE of a tile stored
// [k][m] (m contiguous), via ldmatrix.trans.
template <typename T>
__device__ __forceinline__ void load_a_trans(uint32_t (&a)[4], const T* tile, int ld, int m0, int k0) {
  const int lane = threadIdx.x % 32;
  ldmatrix_x4_trans(a, tile + (k0 + lane % 8 + (lane / 16) * 8) * ld + m0 + ((lane / 8) % 2) * 8);
}

template <typename T, int K, int V, int BV>
__global__ void __launch_bounds__(BwdStateConfig<K, BV>::kThreads) kda_bwd_state_pass_kernel(const KdaBwdArgs b) {
  using C = BwdStateConfig<K, BV>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  auto* stages = reinterpret_cast<BwdStateStage<T, K, BV>*>(smem_raw);
  const KdaFwdArgs& a = b.fwd;

  const int n = sequence_of_row(a, blockIdx.z), hv = blockIdx.y, v0 = blockIdx.x * BV;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int vw = warp * 16;
  const auto [begin, end] = chunk_range(a, n);

  float dS[K / 8][4];  // dS^T: rows v = v0 + vw + g (+8), columns c = 8 nt + 2 t (+1)
  const int64_t state_base = (static_cast<int64_t>(n) * a.heads_v + hv) * K * V + v0 + vw + g;
  load_state_frag<K>(dS, b.d_final_state ? b.d_final_state + state_base : nullptr, V, t);

  // Chunks in reverse: the s-th stage loaded holds chunk end - 1 - s.
#pragma unroll
  for (int s = 0; s < C::kStages; ++s) {
    if (end - 1 - s >= begin) load_bwd_chunk<T, K, V, BV>(stages[s], b, end - 1 - s, hv, v0);
    cp_async_commit();
  }

  for (int chunk = end - 1; chunk >= begin; --chunk) {
    const int stage = (end - 1 - chunk) % C::kStages;
    const BwdStateStage<T, K, BV>& st = stages[stage];
    const int64_t slot = static_cast<int64_t>(chunk) * a.heads_v + hv;
    cp_async_wait<C::kStages - 1>();
    __syncthreads();

    // dh^T = dS^T (as the MMA operand below rounds it)
    store_rows<T>(static_cast<T*>(b.dh) + slot * V * K, K, v0 + vw, dS);

    // dO^T as A operands: rows v (this warp's 16), k-steps over the chunk's tokens
    uint32_t aO[kKdaChunk / 16][4];
#pragma unroll
    for (int ii = 0; ii < kKdaChunk / 16; ++ii) load_a_trans(aO[ii], &st.dO[0][0], C::kLdO, vw, ii * 16);

    // dvnew^T = dO^T P + dS^T kg^T   (P lower triangular: column block jj sees row blocks ii >= jj)
    float dvnew[kKdaChunk / 8][4];
    zero(dvnew);
#pragma unroll
    for (int jj = 0; jj < kKdaChunk / 16; ++jj)
#pragma unroll
      for (int ii = jj; ii < kKdaChunk / 16; ++ii) {
        uint32_t bp[4];
        load_b_cols(bp, &st.P[0][0], C::kLdP, ii * 16, jj * 16);
        mma_pair<T>(dvnew[2 * jj], dvnew[2 * jj + 1], aO[ii], bp);
      }
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk) {
      uint32_t s_a[4];
      to_a<T>(s_a, dS, kk);
#pragma unroll
      for (int jj = 0; jj < kKdaChunk / 16; ++jj) {
        uint32_t bk[4];
        load_b_rows(bk, &st.kg[0][0], C::kLdK, jj * 16, kk * 16);
        mma_pair<T>(dvnew[2 * jj], dvnew[2 * jj + 1], s_a, bk);
      }
    }
    store_rows<T>(static_cast<T*>(b.dvnew) + slot * V * kKdaChunk, kKdaChunk, v0 + vw, dvnew);

    // dS^T <- dS^T Diag(decay) + dO^T qg - dvnew^T w
    uint32_t aV[kKdaChunk / 16][4];
#pragma unroll
    for (int jj = 0; jj < kKdaChunk / 16; ++jj) {
      to_a<T>(aV[jj], dvnew, jj);
#pragma unroll
      for (int r = 0; r < 4; ++r) aV[jj][r] = neg2(aV[jj][r]);
    }
    decay_state_frag<K>(dS, st.decay, t);
#pragma unroll
    for (int ii = 0; ii < kKdaChunk / 16; ++ii)
#pragma unroll
      for (int np = 0; np < K / 16; ++np) {
        uint32_t bq[4], bw[4];
        load_b_cols(bq, &st.qg[0][0], C::kLdK, ii * 16, np * 16);
        load_b_cols(bw, &st.w[0][0], C::kLdK, ii * 16, np * 16);
        mma_pair<T>(dS[2 * np], dS[2 * np + 1], aO[ii], bq);
        mma_pair<T>(dS[2 * np], dS[2 * np + 1], aV[ii], bw);
      }

    __syncthreads();  // every warp is done with this stage
    if (chunk - C::kStages >= begin) load_bwd_chunk<T, K, V, BV>(stages[stage], b, chunk - C::kStages, hv, v0);
    cp_async_commit();
  }

  store_state_frag<K>(dS, b.d_initial_state ? b.d_initial_state + state_base : nullptr, V, t);
}

}  // namespace flare::kda
