// KDA forward, stage 2: the sequential pass over the chunks of one sequence, carrying the fp32
// state, and the output. One CTA per (sequence, value head, BV-wide value slice) (and segment,
// when the pass is segmented: kda_state_segments.h); warp w owns the 16 value columns
// [16 w, 16 w + 16) of the slice and never needs another warp's data.
//
// The state is kept transposed, S^T [16 values x K keys] per warp, as MMA accumulators. Then
// every product of the chunk step has S^T or vnew^T as its A operand, and an accumulator block
// turns into the next A operand in registers (to_a), never through memory:
//   vnew^T = u^T - S^T w^T                      (the delta-rule corrections, 16 x 64)
//   O^T    = S^T qg^T + vnew^T P^T               (qg and P carry the scale)
//   S^T    = S^T Diag(decay) + vnew^T kg
// The chunk's w, qg, kg, P come from kda_chunk_prep through a 3-stage cp.async pipeline (two
// chunks in flight while one is computed), its u through a 2-slot ring (one ahead); each warp
// stages its output tile in the columns of u it alone has read.
// The segmented pass's transition kernel runs the same step without the output (no qg, P) on
// K x (V + K) columns, all in one CTA of (V + K) / 16 warps: value columns from a zero state,
// identity columns with u = 0; its warps share each chunk's w and kg.
//
// Two forms of the step (kGmma). The portable one: each warp's m16n8k16 MMAs read every B operand
// (w, qg, P, kg) from shared memory with ldmatrix, 8 warps 8 times over. The sm_90a one
// (kda_gmma.cuh; instantiated by kda_state_gmma_*.sm90.cu): each warpgroup of 4 warps issues
// m64nNk16 wgmma with the same register fragments as A and B read from 128-byte-swizzled tiles once
// per warpgroup: a quarter of the shared-memory reads, and the tensor cores' full rate.
#pragma once

#include <type_traits>

#include "src/common/grid_dependency.h"
#include "src/kda/kda_chunk_prep.cuh"
#include "src/kda/kda_fwd_params.h"
#ifndef FLARE_CUDA_EMU  // the CPU emulation (tests/cpu/cuda_emu) runs the portable form only
#include "src/kda/kda_gmma.cuh"
#endif
#include "src/kda/kda_tiles.cuh"

namespace flare::kda {

// kOutput: the pass that writes the output; kTransition: a segment's S0 | X (no output).
enum class StatePass { kOutput, kTransition };

// BV: the state columns of a CTA (a value slice; the transition's V + K); BU: the value columns
// of u it reads (the slice; the transition's V).
template <int K, int BV, int BU = BV>
struct StateConfig {
  static_assert(BV % 16 == 0 && BV <= 256, "BV: 16 to 256 state columns");
  static_assert(BU % 16 == 0 && BU <= BV, "BU: value columns among the state's");
  static constexpr int kWarps = BV / 16;
  static constexpr int kThreads = 32 * kWarps;
  // The output pass: stages of w, kg, qg, P (two chunks in flight while one is computed) and
  // slots of u (one ahead: u is the operand whose columns the slice narrows). At the widest slice
  // three whole stages (u in them) would not fit in shared memory; with u apart they do.
  static constexpr int kStages = 3;
  static constexpr int kUSlots = 2;
  // The transition pass (u in its stages, which it reads whole): two chunks in flight as well
  // (3 x 52 KB at K = V = 128; one CTA per SM either way).
  static constexpr int kTransitionStages = 3;
  static constexpr int kLdK = K + 8;  // 16-byte padding: conflict-free ldmatrix
  static constexpr int kLdP = kKdaChunk + 8;
  static constexpr int kLdU = BU + 8;
};

// One stage of the transition pass: a chunk's w, kg, u (value columns) and decay.
template <typename T, int K, int BV, int BU>
struct StateStageCore {
  using C = StateConfig<K, BV, BU>;
  T w[kKdaChunk][C::kLdK];
  T kg[kKdaChunk][C::kLdK];
  T u[kKdaChunk][C::kLdU];
  float decay[K];
};

// One stage of the output pass: a chunk's w, kg, qg, P and decay (its u is in the slots).
template <typename T, int K, int BV>
struct StateStageOut {
  using C = StateConfig<K, BV>;
  T w[kKdaChunk][C::kLdK];
  T kg[kKdaChunk][C::kLdK];
  T qg[kKdaChunk][C::kLdK];
  T P[kKdaChunk][C::kLdP];
  float decay[K];
};

// The wgmma step's stages: w, kg, qg, P as 128-byte-swizzled tiles (kda_gmma.cuh), unpadded and
// 1024-byte aligned; u as above (its reads are per-warp transposes, not MMA operands).
template <typename T, int K>
struct alignas(1024) GmmaStageOut {
  T w[kKdaChunk * K];
  T kg[kKdaChunk * K];
  T qg[kKdaChunk * K];
  T P[kKdaChunk * kKdaChunk];
  float decay[K];
};
template <typename T, int K, int BV, int BU>
struct alignas(1024) GmmaStageCore {
  using C = StateConfig<K, BV, BU>;
  T w[kKdaChunk * K];
  T kg[kKdaChunk * K];
  T u[kKdaChunk][C::kLdU];
  float decay[K];
};

template <typename T, int K, int BV, int BU, StatePass kPass, bool kGmma = false>
using StateStage = std::conditional_t<
    kPass == StatePass::kOutput, std::conditional_t<kGmma, GmmaStageOut<T, K>, StateStageOut<T, K, BV>>,
    std::conditional_t<kGmma, GmmaStageCore<T, K, BV, BU>, StateStageCore<T, K, BV, BU>>>;

// The output pass's shared memory (BU = BV): the stages and u's slots.
template <typename T, int K, int BV, int BU = BV, StatePass kPass = StatePass::kOutput, bool kGmma = false>
struct StateSmem {
  using C = StateConfig<K, BV>;
  StateStage<T, K, BV, BV, StatePass::kOutput, kGmma> stage[C::kStages];
  T u[C::kUSlots][kKdaChunk][C::kLdU];  // this CTA's value columns; then each warp's output tile
};

// The transition pass's shared memory.
template <typename T, int K, int BV, int BU, bool kGmma>
struct StateSmem<T, K, BV, BU, StatePass::kTransition, kGmma> {
  using C = StateConfig<K, BV, BU>;
  StateStage<T, K, BV, BU, StatePass::kTransition, kGmma> stage[C::kTransitionStages];
};

// The dynamic shared memory a state pass requests: the wgmma form aligns its base to 1024 bytes
// itself (kda_state_pass's smem_base), so it asks for that much more.
template <typename T, int K, int BV, int BU, StatePass kPass, bool kGmma>
inline constexpr size_t kStateSmemBytes = sizeof(StateSmem<T, K, BV, BU, kPass, kGmma>) + (kGmma ? 1024 : 0);

// The transition pass's configuration and shared memory: one CTA of all K x (V + K) columns.
template <int K, int V>
using TransitionConfig = StateConfig<K, V + K, V>;
template <typename T, int K, int V>
using TransitionSmem = StateSmem<T, K, V + K, V, StatePass::kTransition>;

// cp.async of chunk `chunk`'s u, value columns [v0, v0 + BU), into rows of ld LD.
template <typename T, int V, int BU, int kThreads, int LD>
__device__ __forceinline__ void load_chunk_u(T (*dst)[LD], const KdaFwdArgs& a, int chunk, int hv, int v0) {
  if (threadIdx.x >= kThreads) return;
  const int64_t slot = static_cast<int64_t>(chunk) * a.heads_v + hv;
  load_rows<T, BU, LD, kThreads, true>(dst, static_cast<const T*>(a.u) + slot * kKdaChunk * V + v0, V);
}

// The loaders' thread count: the rows are spread over a power-of-two count of threads (a
// transition CTA of 12 warps loads with 8 of them).
template <int kCtaThreads>
inline constexpr int kStateLoaders = kCtaThreads & (kCtaThreads - 1) ? 256 : kCtaThreads;

// cp.async of chunk `chunk`'s w, kg, decay and, for the output pass, qg and P into one stage; the
// transition pass's stage also takes u (value columns [v0, v0 + BU)).
template <typename T, int K, int V, int BV, int BU, StatePass kPass, bool kGmma>
__device__ __forceinline__ void load_chunk(StateStage<T, K, BV, BU, kPass, kGmma>& st, const KdaFwdArgs& a, int chunk,
                                           int hv, int v0) {
  using C = StateConfig<K, BV, BU>;
  constexpr int kThreads = kStateLoaders<C::kThreads>;
  static_assert(kThreads <= C::kThreads, "loaders within the CTA");
  const int64_t slot = static_cast<int64_t>(chunk) * a.heads_v + hv;
  const T* w = static_cast<const T*>(a.w) + slot * kKdaChunk * K;
  const T* kg = static_cast<const T*>(a.kg) + slot * kKdaChunk * K;
  const float* decay = a.decay + slot * K;
  for (int idx = threadIdx.x; idx < K / 4; idx += C::kThreads) cp_async_16(&st.decay[idx * 4], decay + idx * 4, true);
  if (threadIdx.x >= kThreads) return;
  const T* qg = static_cast<const T*>(a.qg) + slot * kKdaChunk * K;
  const T* P = static_cast<const T*>(a.P) + slot * kKdaChunk * kKdaChunk;
#ifndef FLARE_CUDA_EMU
  if constexpr (kGmma) {
    gmma::load_rows_sw128<T, K, kThreads>(st.w, w, K);
    if constexpr (kPass == StatePass::kOutput) {
      gmma::load_rows_sw128<T, K, kThreads>(st.qg, qg, K);
      gmma::load_rows_sw128<T, kKdaChunk, kThreads, true>(st.P, P, kKdaChunk);  // P: its lower blocks
    }
    gmma::load_rows_sw128<T, K, kThreads>(st.kg, kg, K);
  } else
#endif
  {
    load_rows<T, K, C::kLdK, kThreads, true>(st.w, w, K);
    if constexpr (kPass == StatePass::kOutput) {
      load_rows<T, K, C::kLdK, kThreads, true>(st.qg, qg, K);
      load_rows<T, kKdaChunk, C::kLdP, kThreads, true, true>(st.P, P, kKdaChunk);  // P: its lower blocks
    }
    load_rows<T, K, C::kLdK, kThreads, true>(st.kg, kg, K);
  }
  if constexpr (kPass == StatePass::kTransition) load_chunk_u<T, V, BU, kThreads>(st.u, a, chunk, hv, v0);
}

// The segmented pass's arrays for head = sequence * HV + value head: segment s's S0 | X
// (K x (V + K), 1 <= s <= state_segments - 2) and the state where segment s >= 1 starts (K x V).
template <int K, int V>
__device__ __forceinline__ float* segment_transition(const KdaFwdArgs& a, int64_t head, int s) {
  return a.seg_transition + (head * (a.state_segments - 2) + s - 1) * K * (V + K);
}
template <int K, int V>
__device__ __forceinline__ float* segment_start(const KdaFwdArgs& a, int64_t head, int s) {
  return a.seg_start + (head * (a.state_segments - 1) + s - 1) * K * V;
}

// S^T = the identity's columns [j0, j0 + 16) (transposed): row v = j0 + g (+8) is e_v.
template <int K>
__device__ __forceinline__ void identity_state_frag(float (&S)[K / 8][4], int j0, int g, int t) {
#pragma unroll
  for (int nt = 0; nt < K / 8; ++nt) {
    const int c = nt * 8 + 2 * t;
    S[nt][0] = c == j0 + g ? 1.f : 0.f;
    S[nt][1] = c + 1 == j0 + g ? 1.f : 0.f;
    S[nt][2] = c == j0 + g + 8 ? 1.f : 0.f;
    S[nt][3] = c + 1 == j0 + g + 8 ? 1.f : 0.f;
  }
}

// O^T += vnew^T P^T with the warp's MMAs (P is lower triangular: token block i sees blocks j <= i).
template <typename T, int K, int BV>
__device__ __forceinline__ void add_pv_product(float (&o)[kKdaChunk / 8][4], const uint32_t (&aV)[kKdaChunk / 16][4],
                                               const StateStageOut<T, K, BV>& st) {
  using C = StateConfig<K, BV>;
#pragma unroll
  for (int jj = 0; jj < kKdaChunk / 16; ++jj)
#pragma unroll
    for (int np = jj; np < kKdaChunk / 16; ++np) {
      uint32_t b[4];
      load_b_rows(b, &st.P[0][0], C::kLdP, np * 16, jj * 16);
      mma_pair<T>(o[2 * np], o[2 * np + 1], aV[jj], b);
    }
}

// O^T's tile of one chunk through this warp's columns [uc, uc + 16) of the chunk's u slot (stmatrix:
// O^T's fragments land as O's rows; the warp alone read those columns, as vnew's start), 32 bytes
// per token, into out's columns [vc, vc + 16).
template <typename T, int K, int BV>
__device__ __forceinline__ void write_output(T (*ot)[StateConfig<K, BV>::kLdU], int uc, const float (&o)[kKdaChunk / 8][4],
                                             const KdaFwdArgs& a, int chunk, int hv, int vc, int lane) {
  const KdaChunk ch = chunk_at(a, chunk);
  __syncwarp();  // every lane's reads of u are done
#pragma unroll
  for (int nt = 0; nt < kKdaChunk / 8; nt += 2) {
    // matrix m: tokens 8 (nt + m / 2) .. + 7, values 8 (m % 2) .. + 7
    const uint32_t r[4] = {pack2<T>(o[nt][0], o[nt][1]), pack2<T>(o[nt][2], o[nt][3]),
                           pack2<T>(o[nt + 1][0], o[nt + 1][1]), pack2<T>(o[nt + 1][2], o[nt + 1][3])};
    const int m = lane / 8;
    stmatrix_x4_trans(r, &ot[8 * (nt + m / 2) + lane % 8][uc + 8 * (m % 2)]);
  }
  __syncwarp();
  // lane: token 16 r + lane / 2, value half lane % 2
  T* out = static_cast<T*>(a.out) + ch.batch * a.out_st.batch + (ch.t0 + lane / 2) * a.out_st.token +
           hv * a.out_st.head + vc + (lane % 2) * 8;
  const int64_t step = 16 * a.out_st.token;
#pragma unroll
  for (int r = 0; r < kKdaChunk / 16; ++r, out += step) {
    const int i = r * 16 + lane / 2;
    if (i < ch.len) *reinterpret_cast<uint4*>(out) = *reinterpret_cast<const uint4*>(&ot[i][uc + (lane % 2) * 8]);
  }
}

#ifndef FLARE_CUDA_EMU
// One chunk step on wgmma (sm_90a), for the warp's rows of its warpgroup's 64 state columns:
//   vnew^T = u^T - S^T w^T,  O^T = S^T qg^T      (vnew holds u^T, o zeros on entry)
//   O^T += vnew^T P^T;  then `output(o)` while   S^T = S^T Diag(decay) + vnew^T kg   runs.
// S^T's bf16 A fragments go in batches of kBatch k-steps (all of them for the output pass; 4 for the
// transition pass, whose up to 384 threads have 170 registers each), each batch waited for before
// its registers are reused.
template <typename T, int K, int BV, bool kOut, typename Stage, typename Output>
__device__ __forceinline__ void gmma_chunk_step(float (&S)[K / 8][4], float (&vnew)[kKdaChunk / 8][4],
                                                float (&o)[kKdaChunk / 8][4], const Stage& st, int t, Output&& output) {
  using gmma::Major;
  constexpr int kKSteps = K / 16, kBatch = kOut ? kKSteps : (kKSteps < 4 ? kKSteps : 4);
  gmma::fence(S), gmma::fence(vnew);
  if constexpr (kOut) gmma::fence(o);
#pragma unroll
  for (int b0 = 0; b0 < kKSteps; b0 += kBatch) {
    uint32_t s_a[kBatch][4];
#pragma unroll
    for (int i = 0; i < kBatch; ++i) to_a<T>(s_a[i], S, b0 + i);
    gmma::fence(s_a);
    gmma::wg_arrive();
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      gmma::mma_rs<T, Major::K, gmma::ScaleIn::Neg>(vnew, s_a[i], gmma::desc_k(st.w, b0 + i));
      if constexpr (kOut) gmma::mma_rs<T, Major::K>(o, s_a[i], gmma::desc_k(st.qg, b0 + i));
    }
    gmma::wg_commit();
    gmma::wg_wait<0>();
    gmma::fence(s_a), gmma::fence(vnew);
    if constexpr (kOut) gmma::fence(o);
  }
  uint32_t aV[kKdaChunk / 16][4];
#pragma unroll
  for (int jj = 0; jj < kKdaChunk / 16; ++jj) to_a<T>(aV[jj], vnew, jj);
  gmma::fence(aV);
  if constexpr (kOut) {
    gmma::wg_arrive();
#pragma unroll
    for (int jj = 0; jj < kKdaChunk / 16; ++jj) gmma::mma_rs<T, Major::K>(o, aV[jj], gmma::desc_k(st.P, jj));
    gmma::wg_commit();
  }
  decay_state_frag<K>(S, st.decay, t);
  gmma::fence(S);
  gmma::wg_arrive();
#pragma unroll
  for (int jj = 0; jj < kKdaChunk / 16; ++jj) gmma::mma_rs<T, Major::MN>(S, aV[jj], gmma::desc_mn(st.kg, jj));
  gmma::wg_commit();
  if constexpr (kOut) {
    gmma::wg_wait<1>();
    gmma::fence(o);
    output(o);
  }
  gmma::wg_wait<0>();
  gmma::fence(S), gmma::fence(aV);
}
#endif

// One CTA's pass over its chunks. The grids (kda_state_segments.h):
//   unsegmented (state_segments 1): the output pass over every chunk, first_segment 0;
//   segmented, output pass: segment 0 alone (first_segment 0: from the initial state, ending in
//     segment 1's start), or segments 1 .. count-1 (first_segment 1: from the combine's starts,
//     the last ending in the final state);
//   segmented, transition pass: segments 1 .. count-2 (S0 | X each), all V + K columns in one CTA.
template <typename T, int K, int V, int BV, int BU, StatePass kPass, bool kGmma>
__device__ __forceinline__ void state_pass(const KdaFwdArgs& a, int first_segment) {
  using C = StateConfig<K, BV, BU>;
  constexpr bool kOut = kPass == StatePass::kOutput;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  // The wgmma form's swizzled tiles need 1024-byte alignment (kStateSmemBytes leaves the room).
  unsigned char* smem_base = smem_raw;
#ifndef FLARE_CUDA_EMU
  if constexpr (kGmma) smem_base += (1024 - static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw)) % 1024) % 1024;
#endif
  auto& sm = *reinterpret_cast<StateSmem<T, K, BV, BU, kPass, kGmma>*>(smem_base);

  const int count = a.state_segments;
  const int in_grid = !kOut ? count - 2 : (count == 1 || first_segment == 0) ? 1 : count - 1;
  // Varlen rows go longest first; segmented passes (the transitions always) are never varlen.
  const int row = blockIdx.z / in_grid, seg = (kOut ? first_segment : 1) + blockIdx.z % in_grid;
  const int n = kOut ? sequence_of_row(a, row) : row;
  const int hv = blockIdx.y, v0 = kOut ? blockIdx.x * BV : 0;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int vw = warp * 16;  // this warp's columns within the CTA's
  auto [begin, end] = chunk_range(a, n);
  if (count > 1) {
    begin += seg == 0 ? 0 : a.first_segment_chunks + (seg - 1) * a.segment_chunks;
    end = min(end, begin + (seg == 0 ? a.first_segment_chunks : a.segment_chunks));
  }
  const int64_t head = static_cast<int64_t>(n) * a.heads_v + hv;
  // Transition pass: the warps past V carry identity columns (no u).
  const bool value_warp = kOut || vw < V;
  // Segment 0's output runs beside the transitions as their programmatic dependent (the launch
  // says why); they have nothing to wait for, so let it start at once.
  if constexpr (!kOut) device::allow_dependent_launch();

  // S^T: rows v = v0 + vw + g (+8), columns c = 8 nt + 2 t (+1).
  float S[K / 8][4];
  if constexpr (kOut) {
    if (seg == 0)
      load_state_frag<K>(S, a.initial_state ? a.initial_state + head * K * V + v0 + vw + g : nullptr, V, t);
    else
      load_state_frag<K>(S, segment_start<K, V>(a, head, seg) + v0 + vw + g, V, t);
  } else if (value_warp) {
    load_state_frag<K>(S, nullptr, V, t);
  } else {
    identity_state_frag<K>(S, vw - V, g, t);
  }

  // The pipeline. Output pass: commit groups M(0) U(0) M(1) U(1) M(2), then after step j U(j + 2)
  // M(j + 3) (M: a stage's w, kg, qg, P, decay; U: u's slot); at step j every group up to U(j) is
  // complete, the three after it may be in flight. Transition pass: M(0) M(1), then after step j
  // M(j + 2) (u in the stages).
  constexpr int kStages = kOut ? C::kStages : C::kTransitionStages;
  constexpr int kInFlight = kOut ? 3 : kStages - 1;
  static_assert(!kOut || (C::kStages == 3 && C::kUSlots == 2), "the output pass's group order assumes 3 stages, 2 slots");
  auto load_main = [&](int j) {
    if (begin + j < end) load_chunk<T, K, V, BV, BU, kPass, kGmma>(sm.stage[j % kStages], a, begin + j, hv, v0);
    cp_async_commit();
  };
  auto load_u = [&](int j) {
    if constexpr (kOut) {
      if (begin + j < end) load_chunk_u<T, V, BU, kStateLoaders<C::kThreads>>(sm.u[j % C::kUSlots], a, begin + j, hv, v0);
      cp_async_commit();
    }
  };
  auto u_of = [&](int j) -> auto& {
    if constexpr (kOut) return sm.u[j % C::kUSlots];
    else return sm.stage[j % kStages].u;
  };
  if constexpr (kOut) {
    load_main(0), load_u(0), load_main(1), load_u(1), load_main(2);
  } else {
#pragma unroll
    for (int j = 0; j < kStages; ++j) load_main(j);
  }

  for (int chunk = begin; chunk < end; ++chunk) {
    const int j = chunk - begin;
    const StateStage<T, K, BV, BU, kPass, kGmma>& st = sm.stage[j % kStages];
    cp_async_wait<kInFlight>();
    __syncthreads();

    float vnew[kKdaChunk / 8][4], o[kKdaChunk / 8][4];
    if (value_warp) load_frag_t<kKdaChunk>(vnew, u_of(j), vw, g, t);
    else zero(vnew);
    zero(o);
#ifndef FLARE_CUDA_EMU
    if constexpr (kGmma) {
      gmma_chunk_step<T, K, BV, kOut>(S, vnew, o, st, t, [&](const float(&ot)[kKdaChunk / 8][4]) {
        if constexpr (kOut) write_output<T, K, BV>(u_of(j), vw, ot, a, chunk, hv, v0 + vw, lane);
      });
    } else
#endif
    {
      // vnew^T = u^T - S^T w^T  and  O^T = S^T qg^T, k-step by k-step: S^T (the state at the chunk
      // start) becomes an A operand one k-step at a time, which keeps registers free for the
      // loads in flight.
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
          if constexpr (kOut) {
            uint32_t bq[4];
            load_b_rows(bq, &st.qg[0][0], C::kLdK, np * 16, kk * 16);
            mma_pair<T>(o[2 * np], o[2 * np + 1], s_a, bq);
          }
        }
      }
      uint32_t aV[kKdaChunk / 16][4];
#pragma unroll
      for (int jj = 0; jj < kKdaChunk / 16; ++jj) to_a<T>(aV[jj], vnew, jj);

      if constexpr (kOut) {
        add_pv_product<T, K, BV>(o, aV, st);
        write_output<T, K, BV>(u_of(j), vw, o, a, chunk, hv, v0 + vw, lane);
      }

      // S^T <- S^T Diag(decay) + vnew^T kg
      decay_state_frag<K>(S, st.decay, t);
      add_chunk_product<T, K>(S, aV, &st.kg[0][0], C::kLdK);
    }

    __syncthreads();  // every warp is done with this stage and u slot (and its output tile)
    if constexpr (kOut) {
      load_u(j + 2), load_main(j + 3);
    } else {
      load_main(j + kStages);
    }
  }

  if constexpr (kOut) {
    if (seg == count - 1)
      store_state_frag<K>(S, a.final_state ? a.final_state + head * K * V + v0 + vw + g : nullptr, V, t);
    else if (seg == 0)
      store_state_frag<K>(S, segment_start<K, V>(a, head, 1) + v0 + vw + g, V, t);
    // Segment 0's grid ran beside the transition grid: it completes only after that grid has, so
    // that the kernels after it (the combine) see the transitions whatever the stream's rule for a
    // programmatic dependent's completion.
    if (count > 1 && seg == 0) device::wait_for_prerequisite_grids();
  } else {
    store_state_frag<K>(S, segment_transition<K, V>(a, head, seg) + vw + g, V + K, t);
  }
}

// The output pass: grid (V / BV, HV, N x segments in the grid); first_segment as in state_pass.
// kGmma: the wgmma step (sm_90a only; BV a multiple of 64, a warpgroup's rows).
template <typename T, int K, int V, int BV, bool kGmma = false>
__global__ void __launch_bounds__(StateConfig<K, BV>::kThreads, 1)
    kda_state_pass_kernel(const KdaFwdArgs a, int first_segment) {
  static_assert(!kGmma || BV % 64 == 0, "wgmma: whole warpgroups");
  state_pass<T, K, V, BV, BV, StatePass::kOutput, kGmma>(a, first_segment);
}

// The segmented pass's transitions: grid (1, HV, N x (segments - 2)), (V + K) / 16 warps.
template <typename T, int K, int V, bool kGmma = false>
__global__ void __launch_bounds__(TransitionConfig<K, V>::kThreads) kda_state_transition_kernel(const KdaFwdArgs a) {
  state_pass<T, K, V, V + K, V, StatePass::kTransition, kGmma>(a, 1);
}

inline constexpr int kSegmentCombineCols = 16;
inline constexpr int kSegmentCombineChunk = 32;  // columns of X in one staged chunk
inline constexpr int kSegmentCombineLd = kSegmentCombineChunk + 4;  // rows padded to 144 bytes
// Chunks in flight: one X (K / kChunk chunks), so X_{s+1} loads while X_s is used.
template <int K>
inline constexpr int kSegmentCombineRing = K / kSegmentCombineChunk;

// The combine's dynamic shared memory: start (K x 16) and the ring of X chunks (K x 32 each).
template <int K>
constexpr size_t segment_combine_smem_bytes() {
  return sizeof(float) * K * (kSegmentCombineCols + kSegmentCombineRing<K> * kSegmentCombineLd);
}

// The segmented pass's third kernel: start_{s+1} = X_s start_s + S0_s for s = 1 .. count-2, in
// fp32, from start_1 (segment 0's output pass wrote it). One CTA per (sequence, value head, 16 value
// columns), thread i the state's row i. Only the products depend on the chain: every X_s is
// streamed through a ring of 32-column chunks with cp.async (each chunk loaded by all threads in
// 128-byte rows), one whole X ahead, so X_{s+1} lands while X_s is used (before: each chunk loaded
// and waited for in turn, 63 us at boost for B1 T32768's three transitions). Rows padded to 144
// bytes: thread i's 16-byte reads of its row are conflict-free. Same sums in the same order as
// before.
template <int K, int V>
__global__ void __launch_bounds__(K) kda_state_segment_combine_kernel(const KdaFwdArgs a) {
  constexpr int kCols = kSegmentCombineCols, kChunk = kSegmentCombineChunk, kLd = kSegmentCombineLd;
  constexpr int kRing = kSegmentCombineRing<K>, kPerX = K / kChunk;
  static_assert(K % kChunk == 0 && V % kCols == 0 && kCols % 4 == 0, "whole chunks and float4 columns");
  extern __shared__ __align__(16) unsigned char smem_raw[];
  auto& start = *reinterpret_cast<float(*)[K][kCols]>(smem_raw);                                   // K x kCols
  auto& ring = *reinterpret_cast<float(*)[kRing][K][kLd]>(smem_raw + sizeof(float) * K * kCols);  // chunks
  const int n = blockIdx.z, hv = blockIdx.y, c0 = blockIdx.x * kCols, i = threadIdx.x;
  const int64_t head = static_cast<int64_t>(n) * a.heads_v + hv;
  const int steps = a.state_segments - 2, chunks = steps * kPerX;

  // Chunk q: columns [kChunk (q % kPerX), + kChunk) of X_{1 + q / kPerX}, into slot q % kRing; one
  // cp.async group per chunk (an empty one past the last, so that every wait counts alike).
  auto issue = [&](int q) {
    if (q < chunks) {
      const float* x = segment_transition<K, V>(a, head, 1 + q / kPerX) + V + (q % kPerX) * kChunk;
#pragma unroll
      for (int j = 0; j < kChunk / 4; ++j) {  // K x kChunk / 4 float4 over K threads
        const int idx = i + j * K, r = idx / (kChunk / 4), c4 = idx % (kChunk / 4);
        cp_async_16(&ring[q % kRing][r][4 * c4], x + int64_t{r} * (V + K) + 4 * c4, true);
      }
    }
    cp_async_commit();
  };
#pragma unroll
  for (int q = 0; q < kRing; ++q) issue(q);

  const float* start_1 = segment_start<K, V>(a, head, 1) + int64_t{i} * V + c0;
#pragma unroll
  for (int c4 = 0; c4 < kCols / 4; ++c4) {
    const float4 v = *reinterpret_cast<const float4*>(start_1 + 4 * c4);
    start[i][4 * c4] = v.x, start[i][4 * c4 + 1] = v.y, start[i][4 * c4 + 2] = v.z, start[i][4 * c4 + 3] = v.w;
  }
  for (int s = 1, q = 0; s <= steps; ++s) {
    const float* rows = segment_transition<K, V>(a, head, s);  // row r: S0 in [0, V), X in [V, V + K)
    float acc[kCols];
#pragma unroll
    for (int c4 = 0; c4 < kCols / 4; ++c4) {  // S0
      const float4 v = *reinterpret_cast<const float4*>(rows + int64_t{i} * (V + K) + c0 + 4 * c4);
      acc[4 * c4] = v.x, acc[4 * c4 + 1] = v.y, acc[4 * c4 + 2] = v.z, acc[4 * c4 + 3] = v.w;
    }
    for (int k0 = 0; k0 < K; k0 += kChunk, ++q) {
      cp_async_wait<kRing - 1>();  // this thread's part of chunk q has landed
      __syncthreads();             // everyone's (and start_s, at a step's first chunk)
      const float(&x)[K][kLd] = ring[q % kRing];
#pragma unroll 2
      for (int k = 0; k < kChunk; k += 4) {
        const float4 x4 = *reinterpret_cast<const float4*>(&x[i][k]);
        const float xs[4] = {x4.x, x4.y, x4.z, x4.w};
#pragma unroll
        for (int e = 0; e < 4; ++e)
#pragma unroll
          for (int c = 0; c < kCols; ++c) acc[c] = fmaf(xs[e], start[k0 + k + e][c], acc[c]);
      }
      __syncthreads();  // every row has read the slot (and, at a step's last chunk, start_s)
      issue(q + kRing);
    }
    float* out = segment_start<K, V>(a, head, s + 1) + int64_t{i} * V + c0;
#pragma unroll
    for (int c4 = 0; c4 < kCols / 4; ++c4)
      *reinterpret_cast<float4*>(out + 4 * c4) = make_float4(acc[4 * c4], acc[4 * c4 + 1], acc[4 * c4 + 2], acc[4 * c4 + 3]);
#pragma unroll
    for (int c = 0; c < kCols; ++c) start[i][c] = acc[c];
  }
}

}  // namespace flare::kda
