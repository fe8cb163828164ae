// Device params of the KDA / GDN chunked forward, built once on the host (kda_api.cpp), and the
// workspace layout that carries one chunk's WY form from the chunk kernel to the state pass.
//
// The forward runs in two kernels (three with cu_seqlens):
//   kda_chunk_table (varlen only): which tokens each 64-token chunk holds, chunks never
//     straddling a sequence;
//   kda_chunk_prep  (kda_chunk_prep.cuh), one CTA per (chunk, value head), all in parallel:
//     gate, cumulative gate, L and P, (I + L)^-1, and writes w, u, kg, qg, P, decay;
//   kda_state_pass  (kda_state_pass.cuh), one CTA per (sequence, value head, value slice),
//     walks the chunks in order with the state in registers and writes the output and the
//     final state. For small batches the pass is cut into segments along the sequence
//     (kda_state_segments.h: transitions beside segment 0's output, a combine, the other segments).
#pragma once

#include <cstddef>
#include <cstdint>

#include "flare/kda.h"

namespace flare::detail {

inline constexpr int kKdaChunk = 64;     // tokens per chunk
inline constexpr int kKdaSubChunk = 16;  // rows of one MMA tile: the unit of the safe exponent offsets

// Where one (token, head) row starts: base + b * batch + t * token + h * head (in elements).
struct RowStrides {
  int64_t batch = 0, token = 0, head = 0;
};

// One chunk: tokens [t0, t0 + len) of batch row `batch`, state index `seq`.
struct KdaChunk {
  int batch, t0, len, seq;
};

struct KdaFwdArgs {
  // Inputs (q's dtype unless noted).
  const void *q, *k, *v;
  const void* g;          // fp32 or q's dtype; [.., HV, K] or [.., HV] (scalar_gate)
  const void* beta;       // fp32 or q's dtype
  const float* A_log;     // [HV] or null
  const float* dt_bias;   // [HV * K] / [HV] or null
  const float* initial_state;  // [N, HV, K, V] or null
  const void* cu_seqlens;      // int32 / int64 [N + 1] or null
  RowStrides q_st, k_st, v_st, g_st, beta_st;  // g_st.head / beta_st.head: per value head
  bool g_fp32 = false, beta_fp32 = false, cu_int64 = false;
  // Outputs.
  void* out;
  RowStrides out_st;
  float* final_state;  // [N, HV, K, V] or null

  // Shape and options.
  int batch, seqlen, heads, heads_v, num_seqs, key_dim, value_dim;
  int chunks_per_row;  // ceil(T / 64) without cu_seqlens
  int max_chunks;      // chunks the workspace holds (an upper bound with cu_seqlens)
  int prep_order = 0;  // the chunk prep's CTA order (kda_prep_order.h)
  bool varlen, scalar_gate;
  float scale;
  bool qk_l2norm, beta_sigmoid, gate_in_kernel;
  float beta_factor;   // 1, or 2 with allow_neg_eigval
  float lower_bound;   // < 0: bounded gate

  // Workspace: per (chunk c, value head hv) slot s = c * HV + hv, each a dense block.
  void *w, *u, *kg, *qg, *P;  // [s][64][K], [s][64][V], [s][64][K], [s][64][K], [s][64][64] (P: only its
                              // 16 x 16 blocks on and below the diagonal are written)
  float* decay;               // [s][K]: exp(Gam_last)
  void* A_inv = nullptr;      // [s][64][64]: (I + L)^-1, written only when set (the backward reads it)
  KdaChunk* chunks;           // [max_chunks] (varlen)
  int* seq_chunk_begin;       // [N + 1] (varlen): chunks of sequence n are [begin[n], begin[n+1])
  int* seq_order;             // [N] (varlen): the sequences longest first, the state passes' CTA order

  // The segmented state pass (kda_state_segments.h); state_segments 1: not segmented.
  int state_segments = 1, segment_chunks = 0;  // segment_chunks: of each segment after the first
  int first_segment_chunks = 0;                 // of segment 0
  float* seg_transition = nullptr;  // [N][HV][state_segments - 2][K][V + K]: S0 | X of segments 1 .. count-2
  float* seg_start = nullptr;       // [N][HV][state_segments - 1][K][V]: the state where segments 1.. start
};

// Bytes of the segmented pass's two arrays (0 when not segmented), each 256-byte aligned.
inline size_t kda_segment_bytes(int64_t num_seqs, int64_t heads_v, int64_t K, int64_t V, int segments,
                                size_t* transition_bytes) {
  const size_t heads = static_cast<size_t>(num_seqs * heads_v);
  const size_t transitions = segments > 2 ? static_cast<size_t>(segments - 2) : 0;
  *transition_bytes = (heads * transitions * K * (V + K) * sizeof(float) + 255) / 256 * 256;
  return *transition_bytes + (heads * (segments - 1) * K * V * sizeof(float) + 255) / 256 * 256;
}

struct KdaWorkspaceLayout {
  size_t w = 0, u = 0, kg = 0, qg = 0, P = 0, decay = 0, chunks = 0, seq_chunk_begin = 0, seq_order = 0;
  size_t total = 0;
};

// Offsets (bytes) of each workspace array for `max_chunks` chunks; 256-byte aligned.
inline KdaWorkspaceLayout kda_workspace_layout(int64_t max_chunks, int64_t heads_v, int64_t K, int64_t V,
                                               int64_t num_seqs, int64_t elem_bytes) {
  KdaWorkspaceLayout l;
  size_t at = 0;
  auto take = [&at](size_t bytes) {
    const size_t start = at;
    at += (bytes + 255) / 256 * 256;
    return start;
  };
  const size_t slots = static_cast<size_t>(max_chunks * heads_v);
  l.w = take(slots * kKdaChunk * K * elem_bytes);
  l.u = take(slots * kKdaChunk * V * elem_bytes);
  l.kg = take(slots * kKdaChunk * K * elem_bytes);
  l.qg = take(slots * kKdaChunk * K * elem_bytes);
  l.P = take(slots * kKdaChunk * kKdaChunk * elem_bytes);
  l.decay = take(slots * K * sizeof(float));
  l.chunks = take(static_cast<size_t>(max_chunks) * sizeof(KdaChunk));
  l.seq_chunk_begin = take(static_cast<size_t>(num_seqs + 1) * sizeof(int));
  l.seq_order = take(static_cast<size_t>(num_seqs) * sizeof(int));
  l.total = at;
  return l;
}

// Launches the forward kernels on `stream` (kda_fwd_launch.cuh); the args are complete.
Status launch_kda_forward(const KdaFwdArgs& a, DType dtype, Stream stream);

}  // namespace flare::detail
