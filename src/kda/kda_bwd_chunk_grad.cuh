// KDA backward, stage 3 of 3: the gradients of one 64-token chunk of one value head, all chunks
// in parallel, from what the two state passes stored (h: the state at the chunk's start, dh: the
// gradient w.r.t. the state at its end, vnew, dvnew) and A = (I + L)^-1 from the prep. Gates are
// in log2 units (exp -> exp2); gradients are w.r.t. the natural-log cumulative gate Gam (the
// ln 2 factors cancel). With X = beta k 2^Gam and e_ij = 2^(Gam_i - Gam_j) per channel:
//
//   phase 1 (inter)  dP = scale dO vnew^T (j <= i)
//                    dq = scale 2^Gam (dO h^T),  dk = 2^(Gam_last - Gam) (vnew dh^T),  dw = -dvnew h^T
//   phase 2 (WY)     dA = dvnew (beta v)^T + dw X^T (strictly lower)
//                    dY = A^T dvnew -> dv = beta dY;  dX = A^T dw -> dk += beta 2^Gam dX
//                    dL = -(A^T dA) A^T (strictly lower)
//   phase 3 (intra)  dq_i += sum_j dP_ij e_ij k_j
//                    dk_i += beta_i sum_j dL_ij e_ij k_j  +  sum_m e_mi (dP_mi q_m + dL_mi beta_m k_m)
//   dbeta = dY . v + (k 2^Gam) . dX + k . (sum_j dL_ij e_ij k_j)
//   dGam  = q . dq - k . dk_inter + X . dX + (row terms of L) - (column terms of P and L), and on
//           the last row sum_i k_i . dk_inter_i + decay . rowsum(h . dh); dg = reverse cumsum of dGam
//   epilogue         the chain rule through the in-kernel options (l2norm, beta sigmoid, gate)
//
// One CTA of 8 warps per (chunk, value head). Warp (I, hc) = (warp % 4, warp / 4) owns rows
// [16 I, 16 I + 16) and the key (or value) columns of half hc of every chunk x K (x V) result, so
// dq, dk and dGam stay in its registers through all phases; 64 x 64 results are split the same
// way by column blocks J in {2 hc, 2 hc + 1}. Operands live in shared memory, the phases' scratch
// in one union.
//
// Safe exponents (as the prep): e_ij is split at the references m_I = Gam at row 16 I + 7 of each
// 16-row sub-chunk: q 2^(Gam - m_I), k 2^(Gam - m_I), k 2^(m_I - Gam) carry at most 8 rows of
// gate, and the factors 2^(m_I - m_J) (J < I) are <= 1.
#pragma once

#include "src/kda/kda_bwd_params.h"
#include "src/kda/kda_bwd_state_pass.cuh"
#include "src/kda/kda_chunk_prep.cuh"
#include "src/kda/kda_tiles.cuh"

namespace flare::kda {

template <int K, int V>
struct GradConfig {
  static_assert((K == 64 || K == 128) && (V == 64 || V == 128), "K and V in {64, 128}");
  static constexpr int kWarps = 8;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kSubChunks = kKdaChunk / kKdaSubChunk;
  static constexpr int kLdK = K + 8;  // 16-bit rows padded by 16 bytes: conflict-free ldmatrix
  static constexpr int kLdV = V + 8;
  static constexpr int kLdC = kKdaChunk + 8;
  static constexpr int kLdG = K + 4;
  static constexpr int kKW = K / 2;  // key columns of a warp's tile
  static constexpr int kVW = V / 2;  // value columns of a warp's tile
  // An sm_90 SM's opt-in shared memory per block (K = V = 128 needs 225 KiB; sm_80 has 163 KiB,
  // enough for K = 64).
  static constexpr size_t kMaxSmem = 227 * 1024;
};

template <typename T, int K, int V>
struct GradSmem {
  using C = GradConfig<K, V>;
  T q[kKdaChunk][C::kLdK];      // activated q
  T k[kKdaChunk][C::kLdK];      // activated k
  T dvnew[V][C::kLdC];          // dvnew^T
  T A[kKdaChunk][C::kLdC];      // (I + L)^-1
  T dP[kKdaChunk][C::kLdC];     // scale dO vnew^T, j <= i
  T dL[kKdaChunk][C::kLdC];     // dA (strictly lower), then dL in place
  float gam[kKdaChunk][C::kLdG];  // cumulative gate (log2); in the epilogue dGam, then dg
  union {
    struct {
      T h[V][C::kLdK];   // h^T
      T dh[V][C::kLdK];  // dh^T
      T dO[kKdaChunk][C::kLdV];
      T vnew[V][C::kLdC];  // vnew^T
    } inter;
    struct {
      T dw[kKdaChunk][C::kLdK];
      T X[kKdaChunk][C::kLdK];  // beta k 2^Gam
      T T1[kKdaChunk][C::kLdC]; // A^T dA
      T v[kKdaChunk][C::kLdV];
    } wy;
    struct {
      T kb[kKdaChunk][C::kLdK];  // k 2^(m_I - Gam)
      T qa[kKdaChunk][C::kLdK];  // q 2^(Gam - m_I)
      T kr[kKdaChunk][C::kLdK];  // k 2^(Gam - m_I)
    } intra;
    struct {
      float dq[kKdaChunk][C::kLdG];
      float dk[kKdaChunk][C::kLdG];
      // The raw gate again, for the gate's chain rule (layer mode): loaded during phase 3, so it
      // lies past the intra operands (static_assert in the kernel).
      union {
        float f32[kKdaChunk][K];
        T b16[kKdaChunk][K];
      } g_raw;
    } out;
  } ph;
  float ref[C::kSubChunks][K];      // m_I
  float cross[6][K];                // 2^(m_I - m_J), J < I (sub_pair order)
  float dgam_last[C::kSubChunks][K];  // per row block: sum_i k_i . dk_inter_i
  float decay_term[K];              // decay . rowsum_V(h . dh)
  float scratch[C::kThreads];
  float beta[kKdaChunk], beta_raw[kKdaChunk], rstd_q[kKdaChunk], rstd_k[kKdaChunk], gate_raw[kKdaChunk];
  float dbeta_part[2][kKdaChunk];
};

// The raw gate's derivatives (as flare::ref): d value / d g (= d / d dt_bias) and d value / d A_log.
struct GateDerivative {
  float d_g, d_A_log;
};
// ... for one channel of one value head: its parameters read once (GateActivation's twin).
struct GateChain {
  float bias, coef, lower_bound;
  bool has_A_log;
  __device__ GateChain(const KdaFwdArgs& a, int hv, int channel) {
    bias = a.dt_bias ? a.dt_bias[a.scalar_gate ? hv : hv * a.key_dim + channel] : 0.f;
    coef = a.A_log ? __expf(a.A_log[hv]) : 1.f;
    has_A_log = a.A_log != nullptr;
    lower_bound = a.lower_bound;
  }
  __device__ GateDerivative operator()(float g) const {
    const float z = g + bias;
    if (lower_bound < 0.f) {  // lower_bound * sigmoid(coef z)
      const float u = coef * z, s = sigmoidf(u), d_u = lower_bound * s * (1.f - s);
      return {d_u * coef, has_A_log ? d_u * u : 0.f};
    }
    const Softplus sp = softplus_with_slope(z);  // -coef softplus(z): d/dz = -coef sigmoid(z)
    return {-coef * sp.slope, -coef * sp.value};
  }
};

// A dense [ROWS][D] workspace tile into a padded shared tile, with 16-byte cp.async.
template <typename T, int ROWS, int D, int LD>
__device__ __forceinline__ void load_tile(T (*dst)[LD], const T* src) {
  constexpr int kVecs = D * sizeof(T) / 16;
  for (int idx = threadIdx.x; idx < ROWS * kVecs; idx += blockDim.x) {
    const int i = idx / kVecs, c = (idx % kVecs) * (16 / sizeof(T));
    cp_async_16(&dst[i][c], src + i * D + c, true);
  }
}

// B fragments of a [k][n] tile scaled per column n (both k halves of a register share a column).
template <typename T>
__device__ __forceinline__ void scale_b_cols(uint32_t (&b)[4], float f0, float f1) {
  b[0] = scale2<T>(b[0], make_float2(f0, f0)), b[1] = scale2<T>(b[1], make_float2(f0, f0));
  b[2] = scale2<T>(b[2], make_float2(f1, f1)), b[3] = scale2<T>(b[3], make_float2(f1, f1));
}

// Calls f(r, i, c) for the accumulator elements of a warp tile: row i = row0 + g (+8), column
// c = col0 + 8 nt + 2 t (+1); r = {nt, e}.
template <int N8, typename F>
__device__ __forceinline__ void for_each_element(int row0, int col0, F f) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
#pragma unroll
  for (int nt = 0; nt < N8; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) f(nt, e, row0 + g + (e / 2) * 8, col0 + nt * 8 + 2 * t + e % 2);
}

// A 16 x 16 block pair (n8 tiles 2 nt, 2 nt + 1) written as T pairs, masked by keep(i, j).
template <typename T, typename Keep>
__device__ __forceinline__ void store_block(T* tile, int ld, int row0, int col0, const float (&acc)[2][4], float s,
                                            Keep keep) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
#pragma unroll
  for (int nt = 0; nt < 2; ++nt)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int i = row0 + g + half * 8, j = col0 + nt * 8 + 2 * t;
      const float x0 = keep(i, j) ? s * acc[nt][2 * half] : 0.f;
      const float x1 = keep(i, j + 1) ? s * acc[nt][2 * half + 1] : 0.f;
      *reinterpret_cast<uint32_t*>(tile + i * ld + j) = pack2<T>(x0, x1);
    }
}

// Code size: every CTA runs this kernel's code once, straight through, with two warps per SM
// sub-partition; when it was fully unrolled (10.4k instructions, 167 KB) more than half of the
// warps' stall samples were instruction fetch (ncu stall_no_inst). Loops whose trip count depends
// on the warp's sub-chunk are therefore kept rolled (#pragma unroll 1).
template <typename T, int K, int V>
__global__ void __launch_bounds__(GradConfig<K, V>::kThreads, 1) kda_chunk_grad_kernel(const KdaBwdArgs b) {
  using C = GradConfig<K, V>;
  static_assert(sizeof(GradSmem<T, K, V>) <= C::kMaxSmem, "shared memory of one CTA");
  constexpr int kNK = C::kKW / 8, kNV = C::kVW / 8;  // n8 tiles of a warp's key / value columns
  extern __shared__ __align__(16) unsigned char smem_raw[];
  auto& s = *reinterpret_cast<GradSmem<T, K, V>*>(smem_raw);
  const KdaFwdArgs& a = b.fwd;

  const int chunk = blockIdx.x, hv = blockIdx.y;
  const KdaChunk ch = chunk_at(a, chunk);
  if (ch.len <= 0) return;
  const int len = ch.len, last = len - 1;
  const int h = hv / (a.heads_v / a.heads);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, t = lane % 4;
  const int I = warp % C::kSubChunks, hc = warp / C::kSubChunks;
  const int kc0 = hc * C::kKW, vc0 = hc * C::kVW, row0 = I * 16;
  const int64_t slot = static_cast<int64_t>(chunk) * a.heads_v + hv;

  // ---- load -----------------------------------------------------------------------------------
  const int64_t g_base = ch.batch * a.g_st.batch + ch.t0 * a.g_st.token + hv * a.g_st.head;
  {
    const T* q = static_cast<const T*>(a.q) + ch.batch * a.q_st.batch + ch.t0 * a.q_st.token + h * a.q_st.head;
    const T* k = static_cast<const T*>(a.k) + ch.batch * a.k_st.batch + ch.t0 * a.k_st.token + h * a.k_st.head;
    const T* dO = static_cast<const T*>(b.dout) + ch.batch * b.dout_st.batch + ch.t0 * b.dout_st.token +
                  hv * b.dout_st.head;
    load_rows<T, K>(s.q, q, a.q_st.token, len);
    load_rows<T, K>(s.k, k, a.k_st.token, len);
    if (!a.scalar_gate && a.g_fp32)  // the raw gate, into gam
      load_rows<float, K>(s.gam, static_cast<const float*>(a.g) + g_base, a.g_st.token, len);
    cp_async_commit();  // what the prologue needs; the rest arrives meanwhile
    load_rows<T, V>(s.ph.inter.dO, dO, b.dout_st.token, len);
    load_tile<T, V, K>(s.ph.inter.h, static_cast<const T*>(b.h) + slot * V * K);
    load_tile<T, V, K>(s.ph.inter.dh, static_cast<const T*>(b.dh) + slot * V * K);
    load_tile<T, V, kKdaChunk>(s.ph.inter.vnew, static_cast<const T*>(b.vnew) + slot * V * kKdaChunk);
    load_tile<T, V, kKdaChunk>(s.dvnew, static_cast<const T*>(b.dvnew) + slot * V * kKdaChunk);
    load_tile<T, kKdaChunk, kKdaChunk>(s.A, static_cast<const T*>(a.A_inv) + slot * kKdaChunk * kKdaChunk);
    cp_async_commit();
  }
  // A GDN gate (one value per row) or a 16-bit gate (into gam, as fp32) and beta, by plain loads.
  if (a.scalar_gate) {
    if (tid < kKdaChunk) s.gate_raw[tid] = tid < len ? load_scalar<T>(a.g, a.g_fp32, g_base + tid * a.g_st.token) : 0.f;
  } else if (!a.g_fp32) {
    for (int idx = tid; idx < len * K; idx += C::kThreads) {
      const int i = idx / K, c = idx % K;
      s.gam[i][c] = load_scalar<T>(a.g, a.g_fp32, g_base + i * a.g_st.token + c);
    }
  }
  if (tid < kKdaChunk) {
    float raw = 0.f;
    if (tid < len)
      raw = load_scalar<T>(a.beta, a.beta_fp32, ch.batch * a.beta_st.batch + (ch.t0 + tid) * a.beta_st.token +
                                                    hv * a.beta_st.head);
    s.beta_raw[tid] = raw;
    s.beta[tid] = tid < len && a.beta_sigmoid ? a.beta_factor * sigmoidf(raw) : raw;
  }
  cp_async_wait<1>();
  __syncthreads();

  // ---- prologue: l2norm, activated and cumulated gate, sub-chunk references -----------------------
  if (a.qk_l2norm) {
    constexpr int kRows = kKdaChunk / C::kWarps;
    l2norm_rows<T, K, kRows>(s.q, warp * kRows, s.rstd_q);
    l2norm_rows<T, K, kRows>(s.k, warp * kRows, s.rstd_k);
  }
  if (a.scalar_gate)
    cumulate_gate_compact<K, C::kThreads>(s.gam, a, hv, len, [&](int i, int) { return s.gate_raw[i]; });
  else
    cumulate_gate_compact<K, C::kThreads>(s.gam, a, hv, len, [&](int i, int c) { return s.gam[i][c]; });
  for (int c = tid; c < K; c += C::kThreads) {
    float m[C::kSubChunks];
#pragma unroll
    for (int J = 0; J < C::kSubChunks; ++J) s.ref[J][c] = m[J] = s.gam[J * kKdaSubChunk + kKdaSubChunk / 2 - 1][c];
#pragma unroll
    for (int J1 = 1; J1 < C::kSubChunks; ++J1)
#pragma unroll
      for (int J0 = 0; J0 < J1; ++J0) s.cross[sub_pair(J1, J0)][c] = exp2_clamped(m[J1] - m[J0]);
  }
  cp_async_wait<0>();
  __syncthreads();

  // Persistent accumulators of this warp's tile (rows row0.., key columns kc0..).
  float dq[kNK][4], dk[kNK][4], dgam[kNK][4];
  float dbeta_acc[2] = {0.f, 0.f};  // rows row0 + g, row0 + g + 8 (partial over this thread's columns)
  auto add_dbeta = [&](int e, float x) { dbeta_acc[e / 2] += x; };

  // ---- phase 1: dP and the inter-chunk terms --------------------------------------------------
  {
    auto& in = s.ph.inter;
#pragma unroll 1
    for (int jb = 0; jb < 2; ++jb) {
      const int J = 2 * hc + jb;
      if (J > I) continue;
      float acc[2][4];
      zero(acc);
#pragma unroll
      for (int ee = 0; ee < V / 16; ++ee) {
        uint32_t aO[4], bv[4];
        load_a(aO, &in.dO[0][0], C::kLdV, row0, ee * 16);
        load_b_cols(bv, &in.vnew[0][0], C::kLdC, ee * 16, J * 16);
        mma_pair<T>(acc[0], acc[1], aO, bv);
      }
      store_block<T>(&s.dP[0][0], C::kLdC, row0, J * 16, acc, a.scale, [](int i, int j) { return j <= i; });
    }

    float dw[kNK][4];
    zero(dq), zero(dk), zero(dw);
#pragma unroll 2
    for (int ee = 0; ee < V / 16; ++ee) {
      uint32_t aO[4], aVn[4], aDv[4];
      load_a(aO, &in.dO[0][0], C::kLdV, row0, ee * 16);
      load_a_trans(aVn, &in.vnew[0][0], C::kLdC, row0, ee * 16);
      load_a_trans(aDv, &s.dvnew[0][0], C::kLdC, row0, ee * 16);
#pragma unroll
      for (int np = 0; np < kNK / 2; ++np) {
        uint32_t bh[4], bdh[4];
        load_b_cols(bh, &in.h[0][0], C::kLdK, ee * 16, kc0 + np * 16);
        load_b_cols(bdh, &in.dh[0][0], C::kLdK, ee * 16, kc0 + np * 16);
        mma_pair<T>(dq[2 * np], dq[2 * np + 1], aO, bh);
        mma_pair<T>(dk[2 * np], dk[2 * np + 1], aVn, bdh);
        mma_pair<T>(dw[2 * np], dw[2 * np + 1], aDv, bh);
      }
    }
    float col_sum[kNK][2];  // sum over this thread's two rows of k . dk_inter
    for_each_element<kNK>(row0, kc0, [&](int nt, int e, int i, int c) {
      const float G = s.gam[i][c];
      dq[nt][e] *= a.scale * exp2_clamped(G);
      dk[nt][e] *= exp2_clamped(s.gam[kKdaChunk - 1][c] - G);
      const float kdk = to_float(s.k[i][c]) * dk[nt][e];
      dgam[nt][e] = to_float(s.q[i][c]) * dq[nt][e] - kdk;
      if (e < 2) col_sum[nt][e] = kdk;
      else col_sum[nt][e - 2] += kdk;
    });
#pragma unroll
    for (int nt = 0; nt < kNK; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float x = col_sum[nt][e];
#pragma unroll
        for (int off = 4; off < 32; off *= 2) x += __shfl_xor_sync(0xffffffffu, x, off);
        if (lane < 4) s.dgam_last[I][kc0 + nt * 8 + 2 * t + e] = x;
      }

    // decay . rowsum_V(h . dh), per key channel: threads split the value rows in 256 / K parts.
    {
      constexpr int kParts = C::kThreads / K;
      const int c = tid % K, part = tid / K;
      float acc = 0.f;
      for (int e = part * (V / kParts); e < (part + 1) * (V / kParts); ++e)
        acc += to_float(in.h[e][c]) * to_float(in.dh[e][c]);
      s.scratch[tid] = acc;
      __syncthreads();
      if (tid < K) {
        float sum = 0.f;
#pragma unroll
        for (int p = 0; p < kParts; ++p) sum += s.scratch[p * K + tid];
        s.decay_term[tid] = exp2_clamped(s.gam[kKdaChunk - 1][tid]) * sum;
      }
    }
    __syncthreads();  // phase 1's operands are dead: the union turns into phase 2's

    // dw (negated) to shared memory
#pragma unroll
    for (int nt = 0; nt < kNK; ++nt) {
      const int i = row0 + lane / 4, c = kc0 + nt * 8 + 2 * t;
      *reinterpret_cast<uint32_t*>(&s.ph.wy.dw[i][c]) = pack2<T>(-dw[nt][0], -dw[nt][1]);
      *reinterpret_cast<uint32_t*>(&s.ph.wy.dw[i + 8][c]) = pack2<T>(-dw[nt][2], -dw[nt][3]);
    }
  }

  // ---- phase 2: back through w = A X, u = A (beta v) and A = (I + L)^-1 -------------------------
  {
    auto& wy = s.ph.wy;
    const T* v = static_cast<const T*>(a.v) + ch.batch * a.v_st.batch + ch.t0 * a.v_st.token + hv * a.v_st.head;
    load_rows<T, V>(wy.v, v, a.v_st.token, len);
    cp_async_commit();
    for (int idx = tid; idx < kKdaChunk * K / 8; idx += C::kThreads) {
      const int i = idx / (K / 8), c0 = (idx % (K / 8)) * 8;
      alignas(16) T kv[8], x[8];
      *reinterpret_cast<uint4*>(kv) = *reinterpret_cast<const uint4*>(&s.k[i][c0]);
#pragma unroll
      for (int e = 0; e < 8; ++e) x[e] = from_float<T>(s.beta[i] * to_float(kv[e]) * exp2_clamped(s.gam[i][c0 + e]));
      *reinterpret_cast<uint4*>(&wy.X[i][c0]) = *reinterpret_cast<const uint4*>(x);
    }
    cp_async_wait<0>();
    __syncthreads();

    // dA = dvnew (beta v)^T + dw X^T, strictly lower (into dL)
#pragma unroll 1
    for (int jb = 0; jb < 2; ++jb) {
      const int J = 2 * hc + jb;
      if (J > I) continue;
      float acc[2][4];
      zero(acc);
      const float b0 = s.beta[J * 16 + lane / 4], b1 = s.beta[J * 16 + 8 + lane / 4];
#pragma unroll
      for (int ee = 0; ee < V / 16; ++ee) {
        uint32_t aDv[4], bv[4];
        load_a_trans(aDv, &s.dvnew[0][0], C::kLdC, row0, ee * 16);
        load_b_rows(bv, &wy.v[0][0], C::kLdV, J * 16, ee * 16);
        scale_b_cols<T>(bv, b0, b1);
        mma_pair<T>(acc[0], acc[1], aDv, bv);
      }
#pragma unroll
      for (int cc = 0; cc < K / 16; ++cc) {
        uint32_t aw[4], bx[4];
        load_a(aw, &wy.dw[0][0], C::kLdK, row0, cc * 16);
        load_b_rows(bx, &wy.X[0][0], C::kLdK, J * 16, cc * 16);
        mma_pair<T>(acc[0], acc[1], aw, bx);
      }
      store_block<T>(&s.dL[0][0], C::kLdC, row0, J * 16, acc, 1.f, [](int i, int j) { return j < i; });
    }

    // dY = A^T dvnew (rows of block I, value columns of half hc): dv = beta dY, dbeta += dY . v
    {
      float dY[kNV][4];
      zero(dY);
#pragma unroll 1
      for (int II = I; II < C::kSubChunks; ++II) {
        uint32_t aAt[4];
        load_a_trans(aAt, &s.A[0][0], C::kLdC, row0, II * 16);
#pragma unroll
        for (int np = 0; np < kNV / 2; ++np) {
          uint32_t bd[4];
          load_b_rows(bd, &s.dvnew[0][0], C::kLdC, vc0 + np * 16, II * 16);
          mma_pair<T>(dY[2 * np], dY[2 * np + 1], aAt, bd);
        }
      }
      T* dv = static_cast<T*>(b.dv) + ch.batch * b.dv_st.batch + ch.t0 * b.dv_st.token + hv * b.dv_st.head;
#pragma unroll
      for (int nt = 0; nt < kNV; ++nt)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int j = row0 + lane / 4 + half * 8, e = vc0 + nt * 8 + 2 * t;
          const float y0 = dY[nt][2 * half], y1 = dY[nt][2 * half + 1];
          dbeta_acc[half] += y0 * to_float(wy.v[j][e]) + y1 * to_float(wy.v[j][e + 1]);
          if (j < len)
            *reinterpret_cast<uint32_t*>(dv + j * b.dv_st.token + e) = pack2<T>(s.beta[j] * y0, s.beta[j] * y1);
        }
    }

    // dX = A^T dw: dk += beta 2^Gam dX, dbeta += k 2^Gam . dX, dGam += X . dX
    {
      float dX[kNK][4];
      zero(dX);
#pragma unroll 1
      for (int II = I; II < C::kSubChunks; ++II) {
        uint32_t aAt[4];
        load_a_trans(aAt, &s.A[0][0], C::kLdC, row0, II * 16);
#pragma unroll
        for (int np = 0; np < kNK / 2; ++np) {
          uint32_t bw[4];
          load_b_cols(bw, &wy.dw[0][0], C::kLdK, II * 16, kc0 + np * 16);
          mma_pair<T>(dX[2 * np], dX[2 * np + 1], aAt, bw);
        }
      }
      for_each_element<kNK>(row0, kc0, [&](int nt, int e, int j, int c) {
        const float up = exp2_clamped(s.gam[j][c]), kup = to_float(s.k[j][c]) * up, x = dX[nt][e];
        dk[nt][e] += s.beta[j] * up * x;
        add_dbeta(e, kup * x);
        dgam[nt][e] += s.beta[j] * kup * x;
      });
    }
    __syncthreads();

    // T1 = A^T dA (lower blocks)
#pragma unroll 1
    for (int jb = 0; jb < 2; ++jb) {
      const int J = 2 * hc + jb;
      if (J > I) continue;
      float acc[2][4];
      zero(acc);
#pragma unroll 1
      for (int AA = I; AA < C::kSubChunks; ++AA) {
        uint32_t aAt[4], bA[4];
        load_a_trans(aAt, &s.A[0][0], C::kLdC, row0, AA * 16);
        load_b_cols(bA, &s.dL[0][0], C::kLdC, AA * 16, J * 16);
        mma_pair<T>(acc[0], acc[1], aAt, bA);
      }
      store_block<T>(&wy.T1[0][0], C::kLdC, row0, J * 16, acc, 1.f, [](int, int) { return true; });
    }
    __syncthreads();

    // dL = -T1 A^T, strictly lower (over dA, which is dead)
#pragma unroll 1
    for (int jb = 0; jb < 2; ++jb) {
      const int J = 2 * hc + jb;
      if (J > I) continue;
      float acc[2][4];
      zero(acc);
#pragma unroll 1
      for (int BB = 0; BB <= J; ++BB) {
        uint32_t aT[4], bA[4];
        load_a(aT, &wy.T1[0][0], C::kLdC, row0, BB * 16);
        load_b_rows(bA, &s.A[0][0], C::kLdC, J * 16, BB * 16);
        mma_pair<T>(acc[0], acc[1], aT, bA);
      }
      store_block<T>(&s.dL[0][0], C::kLdC, row0, J * 16, acc, -1.f, [](int i, int j) { return j < i; });
    }
    __syncthreads();
  }

  // ---- phase 3: the intra-chunk terms through P and L ------------------------------------------
  // The epilogue's raw gate (layer mode) arrives meanwhile, past the intra operands.
  static_assert(offsetof(decltype(s.ph.out), g_raw) >= sizeof(s.ph.intra), "g_raw clear of phase 3's operands");
  const bool gate_chain = a.gate_in_kernel && !a.scalar_gate;
  if (gate_chain) {
    if (a.g_fp32) load_rows<float, K>(s.ph.out.g_raw.f32, static_cast<const float*>(a.g) + g_base, a.g_st.token, len);
    else load_rows<T, K>(s.ph.out.g_raw.b16, static_cast<const T*>(a.g) + g_base, a.g_st.token, len);
    cp_async_commit();
  }
  {
    auto& in = s.ph.intra;
    for (int idx = tid; idx < kKdaChunk * K / 8; idx += C::kThreads) {
      const int i = idx / (K / 8), c0 = (idx % (K / 8)) * 8, Ii = i / kKdaSubChunk;
      alignas(16) T qv[8], kv[8], qa[8], kr[8], kb[8];
      *reinterpret_cast<uint4*>(qv) = *reinterpret_cast<const uint4*>(&s.q[i][c0]);
      *reinterpret_cast<uint4*>(kv) = *reinterpret_cast<const uint4*>(&s.k[i][c0]);
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const float x = s.gam[i][c0 + e] - s.ref[Ii][c0 + e];
        const float up = exp2_clamped(x), down = exp2_clamped(-x);
        qa[e] = from_float<T>(to_float(qv[e]) * up);
        kr[e] = from_float<T>(to_float(kv[e]) * up);
        kb[e] = from_float<T>(to_float(kv[e]) * down);
      }
      *reinterpret_cast<uint4*>(&in.qa[i][c0]) = *reinterpret_cast<const uint4*>(qa);
      *reinterpret_cast<uint4*>(&in.kr[i][c0]) = *reinterpret_cast<const uint4*>(kr);
      *reinterpret_cast<uint4*>(&in.kb[i][c0]) = *reinterpret_cast<const uint4*>(kb);
    }
    __syncthreads();

    // Rows i of block I against the keys of blocks J <= I: Q = dP e k, R = dL e k (the factor
    // 2^(Gam_i - m_I) applied after the sum, 2^(m_I - m_J) on the B operand).
    auto row_product = [&](const T* lhs, float (&acc)[kNK][4]) {
      zero(acc);
#pragma unroll 1
      for (int J = 0; J <= I; ++J) {
        uint32_t aL[4];
        load_a(aL, lhs, C::kLdC, row0, J * 16);
#pragma unroll
        for (int np = 0; np < kNK / 2; ++np) {
          uint32_t bk[4];
          load_b_cols(bk, &in.kb[0][0], C::kLdK, J * 16, kc0 + np * 16);
          if (J < I) {
            const float* cr = s.cross[sub_pair(I, J)] + kc0 + np * 16 + lane / 4;
            scale_b_cols<T>(bk, cr[0], cr[8]);
          }
          mma_pair<T>(acc[2 * np], acc[2 * np + 1], aL, bk);
        }
      }
    };
    float acc[kNK][4];
    row_product(&s.dP[0][0], acc);
    for_each_element<kNK>(row0, kc0, [&](int nt, int e, int i, int c) {
      const float x = acc[nt][e];
      dq[nt][e] += exp2_clamped(s.gam[i][c] - s.ref[I][c]) * x;
      dgam[nt][e] += to_float(in.qa[i][c]) * x;
    });
    row_product(&s.dL[0][0], acc);
    for_each_element<kNK>(row0, kc0, [&](int nt, int e, int i, int c) {
      const float x = acc[nt][e], kr = to_float(in.kr[i][c]);
      dk[nt][e] += s.beta[i] * exp2_clamped(s.gam[i][c] - s.ref[I][c]) * x;
      add_dbeta(e, kr * x);
      dgam[nt][e] += s.beta[i] * kr * x;
    });

    // Columns j of block I against the rows of blocks M >= I: sum_m e_mj (dP_mj q_m + dL_mj beta_m k_m)
    // (the factor 2^(m_I - Gam_j) applied after the sum).
    zero(acc);
#pragma unroll 1
    for (int M = I; M < C::kSubChunks; ++M) {
      uint32_t aPt[4], aLt[4];
      load_a_trans(aPt, &s.dP[0][0], C::kLdC, row0, M * 16);
      load_a_trans(aLt, &s.dL[0][0], C::kLdC, row0, M * 16);
      const int m0 = M * 16 + 2 * t;
      const float2 beta_lo = make_float2(s.beta[m0], s.beta[m0 + 1]);
      const float2 beta_hi = make_float2(s.beta[m0 + 8], s.beta[m0 + 9]);
#pragma unroll
      for (int np = 0; np < kNK / 2; ++np) {
        uint32_t bq[4], bk[4];
        load_b_cols(bq, &in.qa[0][0], C::kLdK, M * 16, kc0 + np * 16);
        load_b_cols(bk, &in.kr[0][0], C::kLdK, M * 16, kc0 + np * 16);
        float c0 = 1.f, c1 = 1.f;
        if (M > I) {
          const float* cr = s.cross[sub_pair(M, I)] + kc0 + np * 16 + lane / 4;
          c0 = cr[0], c1 = cr[8];
          scale_b_cols<T>(bq, c0, c1);
        }
        bk[0] = scale2<T>(bk[0], make_float2(beta_lo.x * c0, beta_lo.y * c0));
        bk[1] = scale2<T>(bk[1], make_float2(beta_hi.x * c0, beta_hi.y * c0));
        bk[2] = scale2<T>(bk[2], make_float2(beta_lo.x * c1, beta_lo.y * c1));
        bk[3] = scale2<T>(bk[3], make_float2(beta_hi.x * c1, beta_hi.y * c1));
        mma_pair<T>(acc[2 * np], acc[2 * np + 1], aPt, bq);
        mma_pair<T>(acc[2 * np], acc[2 * np + 1], aLt, bk);
      }
    }
    for_each_element<kNK>(row0, kc0, [&](int nt, int e, int j, int c) {
      const float x = acc[nt][e];
      dk[nt][e] += exp2_clamped(s.ref[I][c] - s.gam[j][c]) * x;
      dgam[nt][e] -= to_float(in.kb[j][c]) * x;
    });
    __syncthreads();  // the gate and phase 3's operands are dead
  }

  // ---- epilogue: dbeta, dg (reverse cumsum of dGam, gate chain rule), dq and dk ----------------
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    float x = dbeta_acc[half];
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    x += __shfl_xor_sync(0xffffffffu, x, 2);
    if (t == 0) s.dbeta_part[hc][row0 + lane / 4 + half * 8] = x;
  }
  for_each_element<kNK>(row0, kc0, [&](int nt, int e, int i, int c) {
    s.gam[i][c] = dgam[nt][e];
    s.ph.out.dq[i][c] = dq[nt][e];
    s.ph.out.dk[i][c] = dk[nt][e];
  });
  if (gate_chain) cp_async_wait<0>();
  __syncthreads();

  if (tid < len) {
    float d = s.dbeta_part[0][tid] + s.dbeta_part[1][tid];
    if (a.beta_sigmoid) {
      const float sg = sigmoidf(s.beta_raw[tid]);
      d *= a.beta_factor * sg * (1.f - sg);
    }
    const int64_t at = ch.batch * b.dbeta_st.batch + (ch.t0 + tid) * b.dbeta_st.token + hv * b.dbeta_st.head;
    if (b.dbeta_fp32) static_cast<float*>(b.dbeta)[at] = d;
    else static_cast<T*>(b.dbeta)[at] = from_float<T>(d);
  }
  if (tid < K) {  // dg = reverse cumsum of dGam, with the last row's terms
    float sum = s.decay_term[tid];
#pragma unroll
    for (int J = 0; J < C::kSubChunks; ++J) sum += s.dgam_last[J][tid];
    float run = sum;
    for (int i = last; i >= 0; --i) {
      run += s.gam[i][tid];
      s.gam[i][tid] = run;
    }
  }
  __syncthreads();

  // The gate: d raw g = dg d(activated)/d(raw); per-chunk sums for ddt_bias and dA_log.
  const bool gate_partials = b.gate_partial != nullptr;
  float dA_log_acc = 0.f;
  auto write_dg = [&](int i, int c, float d) {
    const int64_t at = ch.batch * b.dg_st.batch + (ch.t0 + i) * b.dg_st.token + hv * b.dg_st.head + c;
    if (b.dg_fp32) static_cast<float*>(b.dg)[at] = d;
    else static_cast<T*>(b.dg)[at] = from_float<T>(d);
  };
  if (a.scalar_gate) {
    if (tid < len) {
      float d = 0.f;
      for (int c = 0; c < K; ++c) d += s.gam[tid][c];
      if (a.gate_in_kernel) {
        const GateDerivative gd = GateChain(a, hv, 0)(s.gate_raw[tid]);
        dA_log_acc = d * gd.d_A_log;
        d *= gd.d_g;
      }
      write_dg(tid, 0, d);
      s.scratch[tid] = d;
    }
  } else {
    const int c = tid % K;  // a thread keeps its channel: K divides the CTA's threads
    if (gate_chain) {
      const GateChain chain(a, hv, c);
      for (int i = tid / K; i < len; i += C::kThreads / K) {
        const float raw = a.g_fp32 ? s.ph.out.g_raw.f32[i][c] : to_float(s.ph.out.g_raw.b16[i][c]);
        const GateDerivative gd = chain(raw);
        const float d = s.gam[i][c];
        dA_log_acc += d * gd.d_A_log;
        s.gam[i][c] = d * gd.d_g;
        write_dg(i, c, d * gd.d_g);
      }
    } else {
      for (int i = tid / K; i < len; i += C::kThreads / K) write_dg(i, c, s.gam[i][c]);
    }
  }
  if (gate_partials) {
    __syncthreads();
    if (a.scalar_gate) {
      if (tid == 0) {
        float sum = 0.f;
        for (int i = 0; i < len; ++i) sum += s.scratch[i];
        b.gate_partial[slot * K] = sum;
      }
    } else if (tid < K) {
      float sum = 0.f;
      for (int i = 0; i < len; ++i) sum += s.gam[i][tid];
      b.gate_partial[slot * K + tid] = sum;
    }
    float x = dA_log_acc;
#pragma unroll
    for (int off = 16; off > 0; off /= 2) x += __shfl_xor_sync(0xffffffffu, x, off);
    __syncthreads();  // the scalar gate's sum has read scratch
    if (lane == 0) s.scratch[warp] = x;
    __syncthreads();
    if (tid == 0) {
      float sum = 0.f;
#pragma unroll
      for (int w = 0; w < C::kWarps; ++w) sum += s.scratch[w];
      b.A_log_partial[slot] = sum;
    }
  }

  // dq, dk: back through the l2norm (dx = (dy - y (y . dy)) rstd), then out (or per value head).
  const int64_t token = static_cast<int64_t>(ch.batch) * a.seqlen + ch.t0;
  auto finish_rows = [&](float (*d)[C::kLdG], const T (*y)[C::kLdK], const float* rstd, float* heads, void* out,
                         const detail::RowStrides& st) {
    for (int i = warp; i < len; i += C::kWarps) {
      float x[K / 32];
#pragma unroll
      for (int m = 0; m < K / 32; ++m) x[m] = d[i][lane + 32 * m];
      if (a.qk_l2norm) {
        float dot = 0.f;
#pragma unroll
        for (int m = 0; m < K / 32; ++m) dot += to_float(y[i][lane + 32 * m]) * x[m];
#pragma unroll
        for (int off = 16; off > 0; off /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, off);
#pragma unroll
        for (int m = 0; m < K / 32; ++m) x[m] = (x[m] - to_float(y[i][lane + 32 * m]) * dot) * rstd[i];
      }
      if (heads != nullptr) {
        float* row = heads + ((token + i) * a.heads_v + hv) * K;
#pragma unroll
        for (int m = 0; m < K / 32; ++m) row[lane + 32 * m] = x[m];
      } else {
        T* row = static_cast<T*>(out) + ch.batch * st.batch + (ch.t0 + i) * st.token + h * st.head;
#pragma unroll
        for (int m = 0; m < K / 32; ++m) row[lane + 32 * m] = from_float<T>(x[m]);
      }
    }
  };
  finish_rows(s.ph.out.dq, s.q, s.rstd_q, b.dq_heads, b.dq, b.dq_st);
  finish_rows(s.ph.out.dk, s.k, s.rstd_k, b.dk_heads, b.dk, b.dk_st);
}

}  // namespace flare::kda
