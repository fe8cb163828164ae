// KDA forward, stage 1: the WY form of one 64-token chunk of one value head (KDA.md section (b)).
// One CTA of 8 warps per (chunk, value head), in the order of kda_prep_order.h; every chunk is
// independent. Warps I and I + 4 own the rows of sub-chunk I, [16 I, 16 I + 16): the first computes
// P and w, the second L and u.
// All gates are in log2 units (exp -> exp2).
//
//   load      the gate, then q, k, v (bulk copies on sm_90, else cp.async), beta
//   cumsum    Gam = cumulative gate; per sub-chunk the reference m_I = Gam at row 16 I + 7
//   scale     qa = scale q 2^(Gam - m_I), ka = beta k 2^(Gam - m_I), kb = k 2^(m_J - Gam) (smem)
//             qg = scale q 2^Gam, kg = k 2^(Gam_last - Gam)                        (global)
//   L, P      block (I, J <= I): P = (qa 2^(m_I - m_J)) kb^T, L = (ka 2^(m_I - m_J)) kb^T
//             (the factors 2^(m_I - m_J) applied to qa, ka's fragments: scale_a_fragment)
//   inverse   A = (I + L)^-1: 16x16 diagonal blocks by forward substitution, the rest by
//             doubling: 32x32 diagonal blocks, then the lower-left 32x32 block (fp32)
//   w, u      w = A (beta k 2^Gam), u = A Diag(beta) v                            (global)
//             (and A itself when a.A_inv is set: the backward's copy)
//
// Safe exponents. Every factor 2^x that an MMA operand carries has |x| at most the gate summed
// over 8 rows (the distance to the sub-chunk's middle row), and the factors 2^(m_I - m_J) are
// <= 1; so nothing overflows while 8 tokens of one channel decay by less than 2^126 (e^87).
// Beyond that the exponents are clamped (results degrade, never inf or NaN). qg and kg, which
// carry the state between chunks, are formed from exact exponent differences.
#pragma once

#include <type_traits>

#include "src/common/bulk_copy.h"
#include "src/kda/kda_fwd_params.h"
#include "src/kda/kda_prep_order.h"
#include "src/kda/kda_tiles.cuh"

namespace flare::kda {

// The chunks of sequence n, [begin, end): its row's chunks, or its varlen range.
struct KdaChunkRange {
  int begin, end;
};
__device__ __forceinline__ KdaChunkRange chunk_range(const detail::KdaFwdArgs& a, int n) {
  if (a.varlen) return {a.seq_chunk_begin[n], a.seq_chunk_begin[n + 1]};
  return {n * a.chunks_per_row, n * a.chunks_per_row + a.chunks_per_row};
}

// The sequence of a state pass's CTA row z (blockIdx.z): varlen batches go longest first
// (kda_chunk_table.cu), so that the longest walks start in the first wave and the short ones fill
// in behind them (the bench's varlen batch: 130 chunk steps per SM instead of 153 in batch order).
__device__ __forceinline__ int sequence_of_row(const detail::KdaFwdArgs& a, int z) {
  return a.varlen ? a.seq_order[z] : z;
}

using detail::KdaChunk;
using detail::KdaFwdArgs;
using detail::kKdaChunk;
using detail::kKdaSubChunk;

constexpr float kL2NormEps = 1e-6f;

template <int K, int V>
struct PrepConfig {
  static_assert(K % 64 == 0 && V % 16 == 0 && K <= 128 && V <= 128, "K in {64, 128}, V a multiple of 16 up to 128");
  static constexpr int kSubChunks = kKdaChunk / kKdaSubChunk;
  static constexpr int kWarps = 2 * kSubChunks;  // two warps per sub-chunk
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kLdK = K + 8;  // bf16 rows padded by 16 bytes: ldmatrix rows hit distinct banks
  static constexpr int kLdV = V + 8;
  static constexpr int kLdG = K + 4;
  static constexpr int kLdA = kKdaChunk + 4;
  static constexpr int kPairs = 6;  // sub-chunk pairs J < I
};

__host__ __device__ constexpr int sub_pair(int I, int J) { return I * (I - 1) / 2 + J; }

template <typename T, int K, int V>
struct PrepSmem {
  using C = PrepConfig<K, V>;
  T q[kKdaChunk][C::kLdK];   // q -> qa
  T k[kKdaChunk][C::kLdK];   // k -> ka -> x = beta k 2^Gam
  T v[kKdaChunk][C::kLdV];   // v
  T kb[kKdaChunk][C::kLdK];  // kb; then the inverse's scratch
  union {
    float gam[kKdaChunk][C::kLdG];  // cumulative gate (log2)
    struct {
      float L[kKdaChunk][kKdaChunk];  // strictly lower, fp32
      float A[kKdaChunk][C::kLdA];    // (I + L)^-1
    } wy;
  };
  float ref[4][K];          // m_I
  float ref_exp[4][K];      // 2^m_I
  float cross[C::kPairs][K];  // 2^(m_I - m_J), J < I
  float beta[kKdaChunk];
  float scalar_gate[kKdaChunk];  // GDN: the raw scalar gate of each row
  uint64_t bar[2];                // sm_90 loads: the gate's rows, then q, k, v
};

__device__ __forceinline__ KdaChunk chunk_at(const KdaFwdArgs& a, int c) {
  if (a.varlen) return a.chunks[c];
  const int b = c / a.chunks_per_row;
  const int t0 = (c - b * a.chunks_per_row) * kKdaChunk;
  return {b, t0, min(kKdaChunk, a.seqlen - t0), b};
}

// Where row `row` of one of the prep's row inputs of chunk ch, value head hv, starts (which: 0 the
// gate as stored, 1 q, 2 k, 3 v), its bytes, and the distance in bytes to the next row; none past
// the chunk's end or for a scalar gate.
struct PrepRowSource {
  const void* src;
  uint32_t bytes;
  int64_t stride_bytes;
};
template <typename T, int K, int V>
__device__ __forceinline__ PrepRowSource prep_row_source(const KdaFwdArgs& a, const KdaChunk& ch, int hv, int which,
                                                         int row) {
  if (row >= ch.len || (which == 0 && a.scalar_gate)) return {nullptr, 0, 0};
  const int64_t t = ch.t0 + row;
  auto at = [&](const detail::RowStrides& st, int head) { return ch.batch * st.batch + t * st.token + head * st.head; };
  const int h = hv / (a.heads_v / a.heads);
  constexpr uint32_t kSize = sizeof(T);
  switch (which) {
    case 0:
      return a.g_fp32 ? PrepRowSource{static_cast<const float*>(a.g) + at(a.g_st, hv), K * 4u, a.g_st.token * 4}
                      : PrepRowSource{static_cast<const T*>(a.g) + at(a.g_st, hv), K * kSize, a.g_st.token * kSize};
    case 1:
      return {static_cast<const T*>(a.q) + at(a.q_st, h), K * kSize, a.q_st.token * kSize};
    case 2:
      return {static_cast<const T*>(a.k) + at(a.k_st, h), K * kSize, a.k_st.token * kSize};
    default:
      return {static_cast<const T*>(a.v) + at(a.v_st, hv), V * kSize, a.v_st.token * kSize};
  }
}

template <typename T>
__device__ __forceinline__ float load_scalar(const void* p, bool fp32, int64_t at) {
  return fp32 ? static_cast<const float*>(p)[at] : to_float(static_cast<const T*>(p)[at]);
}

// The activations on the fast units (MUFU exp2, log2, reciprocal), without IEEE division or the
// libm log1pf: their relative error (a few 1e-6) is far below the 16-bit operands they feed, and
// in the layer mode's kernels the accurate forms took a quarter of the time.
// 1 / (1 + e^-x): 0 where e^-x overflows.
__device__ __forceinline__ float sigmoidf(float x) { return __fdividef(1.f, 1.f + __expf(-x)); }
// log(1 + e) for e in [0, 1]: the series to e^4 below 1/16 (relative error < e^4 / 5), else the
// MUFU log (absolute error 2^-22, relative < 4e-6 above log(17/16)).
// Both evaluated and one selected: the lanes of a warp rarely agree, and a branch ran both anyway.
__device__ __forceinline__ float log1p_unit(float e) {
  const float series = e * (1.f - e * (0.5f - e * (1.f / 3.f - e * 0.25f)));
  const float logf_ = __logf(1.f + e);
  return e < 0.0625f ? series : logf_;
}
// softplus(x) = log(1 + e^x) = max(x, 0) + log(1 + e^-|x|) and its slope sigmoid(x), from one e^-|x|.
struct Softplus {
  float value, slope;
};
__device__ __forceinline__ Softplus softplus_with_slope(float x) {
  const float e = __expf(-fabsf(x)), r = __fdividef(1.f, 1.f + e);
  return {fmaxf(x, 0.f) + log1p_unit(e), x >= 0.f ? r : e * r};
}
__device__ __forceinline__ float softplusf(float x) { return softplus_with_slope(x).value; }

// The gate activation of one key channel of one value head, as in flare::KdaOptions: its
// parameters, and the activated log decay of a raw gate value.
struct GateActivation {
  bool on;
  float bias, a_coef, lower_bound;  // z = g + dt_bias; a_coef = exp(A_log) (1 without A_log)
  __device__ GateActivation(const KdaFwdArgs& a, int hv, int channel) {
    on = a.gate_in_kernel;
    bias = on && a.dt_bias ? a.dt_bias[a.scalar_gate ? hv : hv * a.key_dim + channel] : 0.f;
    a_coef = on && a.A_log ? __expf(a.A_log[hv]) : 1.f;
    lower_bound = a.lower_bound;
  }
  // The activated gate (natural log units), the mode tested per call.
  __device__ float operator()(float g) const {
    if (!on) return g;
    if (lower_bound < 0.f) return sigmoid_gate(g);
    return -a_coef * softplusf(g + bias);
  }
  // The two activations, for callers that pick one outside their loops: the sigmoid gate in natural
  // log units, lower_bound sigmoid(a z).
  __device__ float sigmoid_gate(float g) const { return lower_bound * sigmoidf(a_coef * (g + bias)); }
  // -a softplus(z) / ln 2, the softplus gate in log2 units, as max(z, 0) log2(e) + log2(1 + 2^(-|z|
  // log2(e))): two MUFU operations and five others. Its absolute error (lg2.approx near 1: about
  // 2^-22) is below a millionth of the decay it sets; the relative accuracy of softplusf at very
  // negative z (its series) is not needed where the value only joins a cumulative sum.
  __device__ float softplus_gate_log2(float g) const {
    const float z = g + bias;
    const float e = fast_exp2(-fabsf(z) * kRcpLn2);
    return -a_coef * fmaf(fmaxf(z, 0.f), kRcpLn2, __log2f(1.f + e));
  }
};

// rows [0, 64) of a [token][dim] operand into smem with 16-byte cp.async by kThreads threads;
// rows >= len are zeros (kFull: len is 64, no row checks). Each thread keeps one 16-byte column and
// steps its row pointers (the index arithmetic of a flat loop cost some 26 instructions per copy).
// kLowerBlocks (a 64 x 64 block-lower-triangular matrix, P): only the 16 x 16 blocks on and below
// the diagonal are read from global memory (the prep does not write the others); those above are
// zeros.
template <typename T, int D, int LD, int kThreads = 256, bool kFull = false, bool kLowerBlocks = false>
__device__ __forceinline__ void load_rows(T (*dst)[LD], const T* src, int64_t token_stride, int len = kKdaChunk) {
  constexpr int kPerVec = 16 / sizeof(T), kVecs = D / kPerVec, kRowStep = kThreads / kVecs;
  static_assert(kThreads % kVecs == 0 && kKdaChunk % kRowStep == 0, "whole rows per pass");
  const int c = (threadIdx.x % kVecs) * kPerVec, r0 = threadIdx.x / kVecs;
  const T* p = src + r0 * token_stride + c;
  T* d = &dst[r0][c];
  const int64_t step = kRowStep * token_stride;
#pragma unroll 8  // (narrow CTAs have many rows per thread: unrolled fully they spilled)
  for (int n = 0; n < kKdaChunk / kRowStep; ++n) {
    const int r = r0 + n * kRowStep;
    const bool valid = (kFull || r < len) && (!kLowerBlocks || c < (r / kKdaSubChunk + 1) * kKdaSubChunk);
    cp_async_16(d, valid ? p : src, valid);
    p += step;
    d += kRowStep * LD;
  }
}

// x <- x / sqrt(sum x^2 + eps) for rows [row0, row0 + ROWS) by one warp; rstd[i] = 1 / sqrt(...)
// when given. Each lane holds K / 32 adjacent elements of a row (one 4- or 8-byte access); the
// rows' reductions are interleaved (ROWS independent shuffle chains).
template <typename T, int K, int ROWS, int LD>
__device__ __forceinline__ void l2norm_rows(T (*x)[LD], int row0, float* rstd = nullptr) {
  static_assert(K == 64 || K == 128, "two or four elements per lane");
  constexpr int kPer = K / 32;
  using Vec = std::conditional_t<kPer == 4, uint2, uint32_t>;
  const int lane = threadIdx.x % 32, c0 = lane * kPer;
  float vals[ROWS][kPer], sum[ROWS];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    alignas(8) T e[kPer];
    *reinterpret_cast<Vec*>(e) = *reinterpret_cast<const Vec*>(&x[row0 + r][c0]);
    sum[r] = 0.f;
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      vals[r][i] = to_float(e[i]);
      sum[r] += vals[r][i] * vals[r][i];
    }
  }
#pragma unroll
  for (int off = 16; off > 0; off /= 2)
#pragma unroll
    for (int r = 0; r < ROWS; ++r) sum[r] += __shfl_xor_sync(0xffffffffu, sum[r], off);
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    const float rs = rsqrtf(sum[r] + kL2NormEps);
    if (rstd != nullptr && lane == 0) rstd[row0 + r] = rs;
    alignas(8) T e[kPer];
#pragma unroll
    for (int i = 0; i < kPer; ++i) e[i] = from_float<T>(vals[r][i] * rs);
    *reinterpret_cast<Vec*>(&x[row0 + r][c0]) = *reinterpret_cast<const Vec*>(e);
  }
}

// The cumulations' middle step (rows in segments of 8, kThreads / K threads per channel): after a
// barrier, each of this thread's segments gets the total of the segments before it (their last
// rows, as the first step left them), then a barrier, so that no one adds before everyone has read.
template <int K, int kThreads, int LD, int kMine>
__device__ __forceinline__ void segment_offsets(float (*gam)[LD], float (&offset)[kMine]) {
  constexpr int kSegRows = 8, kSegs = kKdaChunk / kSegRows, kStep = kThreads / K;
  static_assert(kMine == kSegs / kStep, "one offset per segment of this thread");
  const int c = threadIdx.x % K, seg0 = threadIdx.x / K;
  __syncthreads();
  float total[kSegs - 1];
#pragma unroll
  for (int q = 0; q < kSegs - 1; ++q) total[q] = gam[q * kSegRows + kSegRows - 1][c];
#pragma unroll
  for (int m = 0; m < kMine; ++m) {
    offset[m] = 0.f;
#pragma unroll
    for (int q = 0; q < kSegs - 1; ++q)
      if (q < seg0 + m * kStep) offset[m] += total[q];
  }
  __syncthreads();
}

// The cumulations' first step, unrolled: this thread's raw gate values loaded first (so no
// shared load waits on a store), then each segment's running sums of log2_gate(x) * factor over
// rows below len, in registers; each segment's last row stored for segment_offsets.
template <int K, int kThreads, int LD, int kMine, typename Raw, typename Log2Gate>
__device__ __forceinline__ void segment_running_sums(float (&run)[kMine][8], float (*gam)[LD], int len, Raw raw,
                                                     Log2Gate log2_gate, float factor) {
  constexpr int kSegRows = 8, kStep = kThreads / K;
  const int c = threadIdx.x % K, seg0 = threadIdx.x / K;
  auto row_of = [&](int m, int r) { return (seg0 + m * kStep) * kSegRows + r; };
#pragma unroll
  for (int m = 0; m < kMine; ++m)
#pragma unroll
    for (int r = 0; r < kSegRows; ++r) run[m][r] = raw(row_of(m, r), c);
#pragma unroll
  for (int m = 0; m < kMine; ++m)
#pragma unroll
    for (int r = 0; r < kSegRows; ++r) {
      const float x = row_of(m, r) < len ? log2_gate(run[m][r]) : 0.f;
      run[m][r] = fmaf(x, factor, r > 0 ? run[m][r - 1] : 0.f);
    }
#pragma unroll
  for (int m = 0; m < kMine; ++m) gam[row_of(m, kSegRows - 1)][c] = run[m][kSegRows - 1];
}

// The cumulative activated gate (log2 units) of one chunk, in place over gam's 64 rows: row i
// holds the sum over rows j <= i, j < len (rows from len on hold the total). raw(i, c) is the gate
// as stored (it may read gam itself; callers choose the stored format outside, so raw has no
// branch); log2_gate(x) * factor is the activated gate of a raw value x in log2 units. Every thread
// works on kSegs / (kThreads / K) segments of 8 rows of one channel, then adds the totals of the
// segments before each: those are the segments' last rows, read before anyone adds (a barrier
// between). A thread loads all its raw values first and keeps the running sums in registers, so no
// shared load waits on a store (the chained form was a quarter of the chunk prep's stall samples).
// Ends with a barrier.
template <int K, int kThreads, int LD, typename Raw, typename Log2Gate>
__device__ __forceinline__ void cumulate_gate_as(float (*gam)[LD], int len, Raw raw, Log2Gate log2_gate, float factor) {
  constexpr int kSegRows = 8, kSegs = kKdaChunk / kSegRows, kStep = kThreads / K, kMine = kSegs / kStep;
  static_assert(kThreads % K == 0 && kSegs % kStep == 0, "whole segments per thread");
  const int c = threadIdx.x % K, seg0 = threadIdx.x / K;
  auto row_of = [&](int m, int r) { return (seg0 + m * kStep) * kSegRows + r; };
  float run[kMine][kSegRows];  // segment m's running sums
  segment_running_sums<K, kThreads>(run, gam, len, raw, log2_gate, factor);
  float offset[kMine];
  segment_offsets<K, kThreads>(gam, offset);
#pragma unroll
  for (int m = 0; m < kMine; ++m)
#pragma unroll
    for (int r = 0; r < kSegRows; ++r) gam[row_of(m, r)][c] = run[m][r] + offset[m];
  __syncthreads();
}

// The chunk prep's cumulative gate: cumulate_gate_as with the activation of the call (none,
// softplus or sigmoid; uniform over the CTA, so chosen once here and not per element: per element,
// its tests and branches kept the layer mode's activation a third of the prep's stall samples).
template <int K, int kThreads, int LD, typename Raw>
__device__ __forceinline__ void cumulate_gate(float (*gam)[LD], const KdaFwdArgs& a, int hv, int len, Raw raw) {
  const GateActivation act(a, hv, threadIdx.x % K);
  if (!act.on)
    cumulate_gate_as<K, kThreads>(gam, len, raw, [](float g) { return g; }, kRcpLn2);
  else if (act.lower_bound < 0.f)
    cumulate_gate_as<K, kThreads>(gam, len, raw, [act](float g) { return act.sigmoid_gate(g); }, kRcpLn2);
  else
    cumulate_gate_as<K, kThreads>(gam, len, raw, [act](float g) { return act.softplus_gate_log2(g); }, 1.f);
}

// The same sums in less code, for the backward's chunk gradient (a kernel larger than the
// instruction cache): the activated gate's rows in one rolled loop (the mode tested per element),
// the activation's accurate forms (softplusf). With cumulate_gate there, its three unrolled loops
// per stored format, that kernel ran 25 % slower in the layer mode (5.40 -> 6.72 ms, B8 T4096).
// Same cumulation order; without the activation the same code as cumulate_gate_as.
template <int K, int kThreads, int LD, typename Raw>
__device__ __forceinline__ void cumulate_gate_compact(float (*gam)[LD], const KdaFwdArgs& a, int hv, int len, Raw raw) {
  constexpr int kSegRows = 8, kSegs = kKdaChunk / kSegRows, kStep = kThreads / K, kMine = kSegs / kStep;
  static_assert(kThreads % K == 0 && kSegs % kStep == 0, "whole segments per thread");
  const int c = threadIdx.x % K, seg0 = threadIdx.x / K;
  auto row_of = [&](int m, int r) { return (seg0 + m * kStep) * kSegRows + r; };
  const GateActivation activate(a, hv, c);
  float run[kMine][kSegRows];  // plain: segment m's running sums
  if (activate.on) {
    // The segments' chains interleaved, the row loop rolled (its softplus and sigmoid are long:
    // unrolled, their copies made the code outgrow the instruction cache).
    float sum[kMine];
#pragma unroll
    for (int m = 0; m < kMine; ++m) sum[m] = 0.f;
#pragma unroll 1
    for (int r = 0; r < kSegRows; ++r)
#pragma unroll
      for (int m = 0; m < kMine; ++m) {
        const int i = row_of(m, r);
        if (i < len) sum[m] += activate(raw(i, c)) * kRcpLn2;
        gam[i][c] = sum[m];
      }
  } else {
    segment_running_sums<K, kThreads>(run, gam, len, raw, [](float g) { return g; }, kRcpLn2);
  }
  float offset[kMine];
  segment_offsets<K, kThreads>(gam, offset);
#pragma unroll
  for (int m = 0; m < kMine; ++m)
#pragma unroll
    for (int r = 0; r < kSegRows; ++r) {
      const int i = row_of(m, r);
      if (activate.on) gam[i][c] += offset[m];
      else gam[i][c] = run[m][r] + offset[m];
    }
  __syncthreads();
}

// acc[0..3] += sum over k in [k0, k1) of x[k] y[k][0..3]: x a row of fp32 in smem, y fp32 rows of
// LDY floats; k0 and k1 multiples of 4, all 16-byte aligned.
template <int LDY>
__device__ __forceinline__ void row_times_cols4(float (&acc)[4], const float* x, const float* y, int k0, int k1) {
#pragma unroll 2
  for (int k = k0; k < k1; k += 4) {
    const float4 xv = *reinterpret_cast<const float4*>(x + k);
    const float xs[4] = {xv.x, xv.y, xv.z, xv.w};
#pragma unroll
    for (int d = 0; d < 4; ++d) {
      const float4 yv = *reinterpret_cast<const float4*>(y + (k + d) * LDY);
      acc[0] += xs[d] * yv.x;
      acc[1] += xs[d] * yv.y;
      acc[2] += xs[d] * yv.z;
      acc[3] += xs[d] * yv.w;
    }
  }
}
__device__ __forceinline__ void store4(float* dst, const float (&v)[4], float factor = 1.f) {
  *reinterpret_cast<float4*>(dst) = make_float4(factor * v[0], factor * v[1], factor * v[2], factor * v[3]);
}

// A 16-bit pair scaled by a per-column factor pair, repacked.
template <typename T>
__device__ __forceinline__ uint32_t scale2(uint32_t x, float2 f) {
  const float2 v = unpack2<T>(x);
  return pack2<T>(v.x * f.x, v.y * f.y);
}

// An A fragment (16 x 16, T) scaled by per-column factors: lo for its columns 2t, 2t + 1, hi for
// 2t + 8, 2t + 9. bf16 by packed multiplies (the factors rounded to bf16 first: fp32's exponent
// range, one more rounding); fp16 through fp32, since there factors below 2^-14 would lose their
// precision as subnormals and the product would carry that loss times the operand.
template <typename T>
__device__ __forceinline__ void scale_a_fragment(uint32_t (&out)[4], const uint32_t (&a)[4], float2 lo, float2 hi) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const uint32_t l = pack2<T>(lo.x, lo.y), h = pack2<T>(hi.x, hi.y);
    out[0] = mul2_bf16(a[0], l), out[1] = mul2_bf16(a[1], l);
    out[2] = mul2_bf16(a[2], h), out[3] = mul2_bf16(a[3], h);
  } else {
    out[0] = scale2<T>(a[0], lo), out[1] = scale2<T>(a[1], lo);
    out[2] = scale2<T>(a[2], hi), out[3] = scale2<T>(a[3], hi);
  }
}

template <typename T, int K, int V>
__global__ void __launch_bounds__(PrepConfig<K, V>::kThreads, 2) kda_chunk_prep_kernel(const KdaFwdArgs a) {
  using C = PrepConfig<K, V>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  auto& s = *reinterpret_cast<PrepSmem<T, K, V>*>(smem_raw);

  const detail::KdaPrepCta cta = detail::kda_prep_cta(blockIdx.x, a.max_chunks, a.heads_v, a.prep_order);
  const int chunk = cta.chunk, hv = cta.hv;
  const KdaChunk ch = chunk_at(a, chunk);
  if (ch.len <= 0) return;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  const int64_t slot = static_cast<int64_t>(chunk) * a.heads_v + hv;

  // ---- load: q, k, v asynchronously; gate and beta activated on the way in ------------------
  // The raw gate first, as it is stored: fp32 rows straight into gam, 16-bit rows into kb (free
  // until the scaling pass), a scalar gate (GDN) one value per row. The cumulative gate is formed
  // while q, k and v are still landing. Rows from len on: q, k, v zeros, the gate undefined (the
  // cumsum does not read it).
  const int64_t g_base = ch.batch * a.g_st.batch + ch.t0 * a.g_st.token + hv * a.g_st.head;
  if (a.scalar_gate && tid < kKdaChunk)
    s.scalar_gate[tid] = tid < ch.len ? load_scalar<T>(a.g, a.g_fp32, g_base + tid * a.g_st.token) : 0.f;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // sm_90: a bulk copy per row, completing on mbarriers. Warp w copies rows [32 (w % 2), + 32) of
  // input w / 2 (0 the gate, on bar[0]; 1-3 q, k, v, on bar[1]), all issued by one elected lane from
  // warp-uniform operands (a copy per thread took some 16 instructions to make its own operands
  // uniform: an eighth of the chunk prep's instructions). Rows past the chunk's end are zeros
  // (the gate's are not read).
  if (tid == 0) {
    sm90::mbar_init(&s.bar[0], 2);
    sm90::mbar_init(&s.bar[1], C::kWarps - 2);
    sm90::mbar_init_fence();
  }
  __syncthreads();
  {
    static_assert(C::kWarps == 8 && kKdaChunk == 64, "two warps per input, 32 rows each");
    const int w = __shfl_sync(0xffffffffu, warp, 0);  // uniform, as the compiler can see
    const int which = w / 2, row0 = (w % 2) * 32;
    uint64_t* bar = &s.bar[which == 0 ? 0 : 1];
    char* dst = which == 0   ? (a.g_fp32 ? reinterpret_cast<char*>(&s.gam[row0][0]) : reinterpret_cast<char*>(&s.kb[row0][0]))
                : which == 1 ? reinterpret_cast<char*>(&s.q[row0][0])
                : which == 2 ? reinterpret_cast<char*>(&s.k[row0][0])
                             : reinterpret_cast<char*>(&s.v[row0][0]);
    const uint32_t dst_ld = which == 0 ? (a.g_fp32 ? C::kLdG * 4u : C::kLdK * uint32_t{sizeof(T)})
                            : which == 3 ? C::kLdV * uint32_t{sizeof(T)}
                                         : C::kLdK * uint32_t{sizeof(T)};
    const PrepRowSource first = prep_row_source<T, K, V>(a, ch, hv, which, row0);
    const int rows = first.bytes == 0 ? 0 : min(32, ch.len - row0);
    if (which != 0 && rows < 32) {  // the chunk's end: zeros
      const int vecs = (which == 3 ? V : K) * int{sizeof(T)} / 16;
      for (int e = lane; e < (32 - rows) * vecs; e += 32)
        *reinterpret_cast<uint4*>(dst + (rows + e / vecs) * dst_ld + (e % vecs) * 16) = make_uint4(0, 0, 0, 0);
    }
    __syncwarp();  // the zeros before the arrival that publishes them
    if (sm90::elect_one_lane()) sm90::mbar_arrive_expect_tx(bar, rows * first.bytes);
    const char* src = static_cast<const char*>(first.src);
    for (int r = 0; r < rows; ++r, src += first.stride_bytes, dst += dst_ld)
      if (sm90::elect_one_lane()) sm90::bulk_copy_g2s(dst, src, first.bytes, bar);
  }
#else
  auto first_row = [&](int which) { return prep_row_source<T, K, V>(a, ch, hv, which, 0).src; };
  if (!a.scalar_gate) {
    if (a.g_fp32) load_rows<float, K>(s.gam, static_cast<const float*>(first_row(0)), a.g_st.token, ch.len);
    else load_rows<T, K>(s.kb, static_cast<const T*>(first_row(0)), a.g_st.token, ch.len);
  }
  cp_async_commit();
  load_rows<T, K>(s.q, static_cast<const T*>(first_row(1)), a.q_st.token, ch.len);
  load_rows<T, K>(s.k, static_cast<const T*>(first_row(2)), a.k_st.token, ch.len);
  load_rows<T, V>(s.v, static_cast<const T*>(first_row(3)), a.v_st.token, ch.len);
  cp_async_commit();
#endif
  if (tid < kKdaChunk) {
    float b = 0.f;
    if (tid < ch.len) {
      b = load_scalar<T>(a.beta, a.beta_fp32,
                         ch.batch * a.beta_st.batch + (ch.t0 + tid) * a.beta_st.token + hv * a.beta_st.head);
      if (a.beta_sigmoid) b = a.beta_factor * sigmoidf(b);
    }
    s.beta[tid] = b;
  }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  sm90::mbar_wait(&s.bar[0], 0);
#else
  cp_async_wait<1>();
#endif
  __syncthreads();

  // ---- gate activation, cumulative gate, references (per channel); then l2norm (per warp: its rows)
  if (a.scalar_gate)
    cumulate_gate<K, C::kThreads>(s.gam, a, hv, ch.len, [&](int i, int) { return s.scalar_gate[i]; });
  else if (a.g_fp32)
    cumulate_gate<K, C::kThreads>(s.gam, a, hv, ch.len, [&](int i, int c) { return s.gam[i][c]; });
  else
    cumulate_gate<K, C::kThreads>(s.gam, a, hv, ch.len, [&](int i, int c) { return to_float(s.kb[i][c]); });
  for (int c = tid; c < K; c += C::kThreads) {
    float m[4];
#pragma unroll
    for (int I = 0; I < 4; ++I) {
      m[I] = s.gam[I * kKdaSubChunk + kKdaSubChunk / 2 - 1][c];
      s.ref[I][c] = m[I];
      s.ref_exp[I][c] = exp2_clamped(m[I]);
    }
#pragma unroll
    for (int I = 1; I < 4; ++I)
#pragma unroll
      for (int J = 0; J < I; ++J) s.cross[sub_pair(I, J)][c] = exp2_clamped(m[I] - m[J]);
    a.decay[slot * K + c] = exp2_clamped(s.gam[kKdaChunk - 1][c]);
  }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  sm90::mbar_wait(&s.bar[1], 0);
#else
  cp_async_wait<0>();
#endif
  __syncthreads();
  if (a.qk_l2norm) {
    constexpr int kRows = kKdaChunk / C::kWarps;
    l2norm_rows<T, K, kRows>(s.q, warp * kRows);
    l2norm_rows<T, K, kRows>(s.k, warp * kRows);
    __syncthreads();
  }

  // ---- scaled operands: qa, ka, kb in place / smem; qg, kg to global -------------------------
  {
    T* qg = static_cast<T*>(a.qg) + slot * kKdaChunk * K;
    T* kg = static_cast<T*>(a.kg) + slot * kKdaChunk * K;
    // Each thread keeps 8 columns c0.. (the last row's gate for them loaded once) and steps rows.
    constexpr int kVecs = K / 8, kRowStep = C::kThreads / kVecs;
    const int c0 = (tid % kVecs) * 8;
    alignas(16) float last[8];
    *reinterpret_cast<float4*>(last) = *reinterpret_cast<const float4*>(&s.gam[kKdaChunk - 1][c0]);
    *reinterpret_cast<float4*>(last + 4) = *reinterpret_cast<const float4*>(&s.gam[kKdaChunk - 1][c0 + 4]);
    const float scale = a.scale;
#pragma unroll 4
    for (int i = tid / kVecs; i < kKdaChunk; i += kRowStep) {
      const int I = i / kKdaSubChunk;
      const float beta = s.beta[i];
      alignas(16) T qv[8], kv[8], qa[8], ka[8], kb[8], qgv[8], kgv[8];
      alignas(16) float G[8], m[8];
      *reinterpret_cast<uint4*>(qv) = *reinterpret_cast<const uint4*>(&s.q[i][c0]);
      *reinterpret_cast<uint4*>(kv) = *reinterpret_cast<const uint4*>(&s.k[i][c0]);
      *reinterpret_cast<float4*>(G) = *reinterpret_cast<const float4*>(&s.gam[i][c0]);
      *reinterpret_cast<float4*>(G + 4) = *reinterpret_cast<const float4*>(&s.gam[i][c0 + 4]);
      *reinterpret_cast<float4*>(m) = *reinterpret_cast<const float4*>(&s.ref[I][c0]);
      *reinterpret_cast<float4*>(m + 4) = *reinterpret_cast<const float4*>(&s.ref[I][c0 + 4]);
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const float x = G[e] - m[e];
        const float up = exp2_clamped(x), down = exp2_clamped(-x);
        const float qs = scale * to_float(qv[e]), kf = to_float(kv[e]);
        qa[e] = from_float<T>(qs * up);
        ka[e] = from_float<T>(beta * kf * up);
        kb[e] = from_float<T>(kf * down);
        qgv[e] = from_float<T>(qs * exp2_clamped(G[e]));
        kgv[e] = from_float<T>(kf * exp2_clamped(last[e] - G[e]));
      }
      *reinterpret_cast<uint4*>(&s.q[i][c0]) = *reinterpret_cast<const uint4*>(qa);
      *reinterpret_cast<uint4*>(&s.k[i][c0]) = *reinterpret_cast<const uint4*>(ka);
      *reinterpret_cast<uint4*>(&s.kb[i][c0]) = *reinterpret_cast<const uint4*>(kb);
      *reinterpret_cast<uint4*>(qg + i * K + c0) = *reinterpret_cast<const uint4*>(qgv);
      *reinterpret_cast<uint4*>(kg + i * K + c0) = *reinterpret_cast<const uint4*>(kgv);
    }
  }
  __syncthreads();

  // ---- P (warps 0-3) and L (warps 4-7): row block I against column blocks J <= I ------------
  // The L warps also zero the blocks of (I + L)^-1 above the diagonal.
  {
    const int I = warp % C::kSubChunks;
    const bool is_L = warp >= C::kSubChunks;
    uint32_t ar[K / 16][4];  // qa (P) or ka (L), rows of block I
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk) load_a(ar[kk], is_L ? &s.k[0][0] : &s.q[0][0], C::kLdK, I * 16, kk * 16);
    // This thread's rows i0 = 16 I + g and i0 + 8 of P (columns 2t, 2t + 1 of each 8-column tile)
    // and of L.
    const int i0 = I * 16 + g;
    T* P = static_cast<T*>(a.P) + slot * kKdaChunk * kKdaChunk + I * 16 * kKdaChunk;  // row block I
    float* Lrow = &s.wy.L[i0][2 * t];
#pragma unroll
    for (int J = 0; J < C::kSubChunks; ++J) {
      float acc[2][4];
      zero(acc);
      if (J == I) {
#pragma unroll
        for (int kk = 0; kk < K / 16; ++kk) {
          uint32_t b[4];
          load_b_rows(b, &s.kb[0][0], C::kLdK, J * 16, kk * 16);
          mma_pair<T>(acc[0], acc[1], ar[kk], b);
        }
      } else if (J < I) {  // ar scaled by 2^(m_I - m_J) per column: kk 16 + 2t (+1), kk 16 + 2t + 8 (+1)
        const float* f = s.cross[sub_pair(I, J)] + 2 * t;
#pragma unroll
        for (int kk = 0; kk < K / 16; ++kk) {
          uint32_t a_r[4], b[4];
          scale_a_fragment<T>(a_r, ar[kk], make_float2(f[kk * 16], f[kk * 16 + 1]),
                              make_float2(f[kk * 16 + 8], f[kk * 16 + 9]));
          load_b_rows(b, &s.kb[0][0], C::kLdK, J * 16, kk * 16);
          mma_pair<T>(acc[0], acc[1], a_r, b);
        }
      } else if (is_L) {
        for (int e = lane; e < kKdaSubChunk * kKdaSubChunk; e += 32)
          s.wy.A[I * 16 + e / 16][J * 16 + e % 16] = 0.f;
      }
      // P keeps j <= i, L keeps j < i (only the diagonal block needs the test); blocks above the
      // diagonal are zeros. (qa carries the scale.)
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int i = i0 + half * 8, j = J * 16 + nt * 8 + 2 * t;
          float v0 = acc[nt][2 * half], v1 = acc[nt][2 * half + 1];
          const int at = half * 8 * kKdaChunk + J * 16 + nt * 8;
          if (is_L) {
            if (J == I) v0 = j < i ? v0 : 0.f, v1 = j + 1 < i ? v1 : 0.f;
            *reinterpret_cast<float2*>(Lrow + at) = make_float2(v0, v1);
          } else if (J == I) {
            acc[nt][2 * half] = j <= i ? v0 : 0.f;
            acc[nt][2 * half + 1] = j + 1 <= i ? v1 : 0.f;
          }
        }
      if (!is_L && J <= I) store_tile16<T>(P + J * 16, kKdaChunk, acc, g, t);  // (blocks above: never read)
    }
  }
  __syncthreads();

  // ---- (I + L)^-1, diagonal blocks: lane j < 16 of warp I solves column j of block (I, I) -----
  // Meanwhile warps 4-7 turn ka into x = beta k 2^Gam, for w.
  if (warp < C::kSubChunks) {
    if (lane < kKdaSubChunk) {
      const int o = warp * kKdaSubChunk, j = lane;
      float col[kKdaSubChunk];
#pragma unroll
      for (int r = 0; r < kKdaSubChunk; ++r) {
        float x = r == j ? 1.f : 0.f;
#pragma unroll
        for (int m = 0; m < r; ++m) x -= s.wy.L[o + r][o + m] * col[m];
        col[r] = x;
      }
#pragma unroll
      for (int r = 0; r < kKdaSubChunk; ++r) s.wy.A[o + r][o + j] = col[r];
    }
  } else {
    const int id = tid - C::kThreads / 2;  // 128 threads, each on 8 columns of every kStep-th row
    constexpr int kVecs = K / 8, kStep = C::kThreads / 2 / kVecs;
    const int c0 = (id % kVecs) * 8;
#pragma unroll 2
    for (int i = id / kVecs; i < kKdaChunk; i += kStep) {
      alignas(16) T x[8];
      alignas(16) float f[8];
      *reinterpret_cast<uint4*>(x) = *reinterpret_cast<const uint4*>(&s.k[i][c0]);
      *reinterpret_cast<float4*>(f) = *reinterpret_cast<const float4*>(&s.ref_exp[i / kKdaSubChunk][c0]);
      *reinterpret_cast<float4*>(f + 4) = *reinterpret_cast<const float4*>(&s.ref_exp[i / kKdaSubChunk][c0 + 4]);
#pragma unroll
      for (int e = 0; e < 8; ++e) x[e] = from_float<T>(to_float(x[e]) * f[e]);
      *reinterpret_cast<uint4*>(&s.k[i][c0]) = *reinterpret_cast<const uint4*>(x);
    }
  }
  __syncthreads();

  // ---- (I + L)^-1, off-diagonal blocks by doubling: 16 -> 32 -> 64 rows ---------------------
  // With B1 = A[0:32, 0:32] and B2 = A[32:64, 32:64] the inverse's lower-left block is
  // -B2 L[32:64, 0:32] B1; each 32 x 32 diagonal block's own lower-left 16 x 16 block is found the
  // same way from its diagonal blocks. Two products per level, four outputs per thread.
  {
    float* scratch = reinterpret_cast<float*>(&s.kb[0][0]);
    constexpr int kLdA = C::kLdA;
    {  // A_10 and A_32 = -A_II (L_IJ A_JJ), (I, J) = (1, 0) and (3, 2): threads 0-127
      const bool mine = tid < 128;
      const int b = (tid / 64) % 2, r = (tid / 4) % 16, c = (tid % 4) * 4, I = 2 * b + 1, J = 2 * b;
      float* prod = scratch + b * 256;  // [16][16]
      if (mine) {
        float acc[4] = {};
        row_times_cols4<kLdA>(acc, &s.wy.L[I * 16 + r][0], &s.wy.A[0][J * 16 + c], J * 16, J * 16 + 16);
        store4(prod + r * 16 + c, acc);
      }
      __syncthreads();
      if (mine) {
        float out[4] = {};
        row_times_cols4<16>(out, &s.wy.A[I * 16 + r][I * 16], prod + c, 0, 16);
        store4(&s.wy.A[I * 16 + r][J * 16 + c], out, -1.f);
      }
    }
    __syncthreads();
    {  // A[32:64, 0:32] = -B2 (L[32:64, 0:32] B1): row r, columns c .. c + 3 of each 32 x 32 product
      const int r = tid / 8, c = (tid % 8) * 4;
      float* prod = scratch;  // [32][32]
      float acc[4] = {};
      row_times_cols4<kLdA>(acc, &s.wy.L[32 + r][0], &s.wy.A[0][c], c < 16 ? 0 : 16, 32);
      store4(prod + r * 32 + c, acc);
      __syncthreads();
      float out[4] = {};
      row_times_cols4<32>(out, &s.wy.A[32 + r][32], prod + c, 0, r < 16 ? 16 : 32);
      store4(&s.wy.A[32 + r][c], out, -1.f);
    }
    __syncthreads();
  }

  // ---- w = A x (warps 0-3), u = (A Diag(beta)) v (warps 4-7): the 16 rows of block I ---------
  {
    const int I = warp % C::kSubChunks;
    // A's fragments; for u, A Diag(beta) (beta scales the columns of A instead of the rows of v).
    const bool for_u = warp >= C::kSubChunks;
    uint32_t aA[4][4];
#pragma unroll
    for (int J = 0; J < 4; ++J) {
      const float* r0 = &s.wy.A[I * 16 + g][J * 16 + 2 * t];
      const float* r1 = &s.wy.A[I * 16 + g + 8][J * 16 + 2 * t];
      const float* bj = &s.beta[J * 16 + 2 * t];
      const float b0 = for_u ? bj[0] : 1.f, b1 = for_u ? bj[1] : 1.f, b8 = for_u ? bj[8] : 1.f, b9 = for_u ? bj[9] : 1.f;
      aA[J][0] = pack2<T>(r0[0] * b0, r0[1] * b1);
      aA[J][1] = pack2<T>(r1[0] * b0, r1[1] * b1);
      aA[J][2] = pack2<T>(r0[8] * b8, r0[9] * b9);
      aA[J][3] = pack2<T>(r1[8] * b8, r1[9] * b9);
    }
    if (a.A_inv != nullptr && warp < C::kSubChunks) {  // the backward keeps A, as rounded for w and u
      T* Ag = static_cast<T*>(a.A_inv) + slot * kKdaChunk * kKdaChunk + (I * 16 + g) * kKdaChunk + 2 * t;
#pragma unroll
      for (int J = 0; J < 4; ++J) {
        *reinterpret_cast<uint32_t*>(Ag + J * 16) = aA[J][0];
        *reinterpret_cast<uint32_t*>(Ag + 8 * kKdaChunk + J * 16) = aA[J][1];
        *reinterpret_cast<uint32_t*>(Ag + J * 16 + 8) = aA[J][2];
        *reinterpret_cast<uint32_t*>(Ag + 8 * kKdaChunk + J * 16 + 8) = aA[J][3];
      }
    }
    T* w = static_cast<T*>(a.w) + slot * kKdaChunk * K;
    T* u = static_cast<T*>(a.u) + slot * kKdaChunk * V;
    auto product = [&](auto* rhs, int ld, int n0, T* dst, int dst_ld) {
      float acc[2][4];
      zero(acc);
#pragma unroll
      for (int J = 0; J < 4; ++J) {
        if (J > I) break;
        uint32_t b[4];
        load_b_cols(b, rhs, ld, J * 16, n0);
        mma_pair<T>(acc[0], acc[1], aA[J], b);
      }
      store_tile16<T>(dst + I * 16 * dst_ld + n0, dst_ld, acc, g, t);
    };
    if (warp < C::kSubChunks) {
#pragma unroll 2
      for (int n0 = 0; n0 < K; n0 += 16) product(&s.k[0][0], C::kLdK, n0, w, K);
    } else {
#pragma unroll 2
      for (int n0 = 0; n0 < V; n0 += 16) product(&s.v[0][0], C::kLdV, n0, u, V);
    }
  }
}

}  // namespace flare::kda
