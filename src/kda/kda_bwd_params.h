// Device params of the KDA / GDN chunked backward, built once on the host (kda_api.cpp), and the
// workspace layout that carries the per-chunk quantities between its kernels.
//
// The backward runs these kernels in order (KDA.md's chunked form; the CPU version of the same
// stages is flare::ref::kda_backward_chunked):
//   kda_chunk_table  (varlen only) as in the forward;
//   kda_chunk_prep   the forward's per-chunk stage, also storing A = (I + L)^-1;
//   kda_state_record (kda_bwd_state_record.cuh), per (sequence, value head, value slice), chunks
//                    in order: stores each chunk's start state h and vnew = u - w h;
//   kda_bwd_state_pass (kda_bwd_state_pass.cuh), chunks in reverse, carrying the fp32 state
//                    gradient dS: stores dh (w.r.t. each chunk's end state) and dvnew; writes
//                    d_initial_state;
//   kda_chunk_grad   (kda_bwd_chunk_grad.cuh), per (chunk, value head), all in parallel: dq, dk,
//                    dv, dbeta, dg and the chain rule through the in-kernel options;
//   finish           (kda_bwd_finish.cu): dq, dk summed over the value heads of a q/k head (GVA),
//                    dA_log and ddt_bias summed over the chunks.
#pragma once

#include <cstddef>
#include <cstdint>

#include "src/kda/kda_fwd_params.h"

namespace flare::detail {

struct KdaBwdArgs {
  KdaFwdArgs fwd;  // inputs, shapes, options; the prep's workspace (w, u, kg, qg, P, decay, A_inv)
  bool prep_done = false;  // the forward (keep_for_backward) left the prep's workspace: skip it

  const void* dout;             // [B, T, HV, V], q's dtype
  RowStrides dout_st;
  const float* d_final_state;   // [N, HV, K, V] or null

  // Outputs. dq, dk, dv in q's dtype; dg, dbeta fp32 or their input's dtype.
  void *dq, *dk, *dv, *dg, *dbeta;
  RowStrides dq_st, dk_st, dv_st, dg_st, dbeta_st;
  bool dg_fp32 = false, dbeta_fp32 = false;
  float* d_initial_state;  // [N, HV, K, V] or null
  float* dA_log;           // [HV] or null
  float* ddt_bias;         // [HV * K] / [HV] or null

  // Workspace, per slot s = chunk * HV + hv (q's dtype unless noted).
  void *h, *dh;          // [s][V][K]: the state at the chunk's start, the gradient w.r.t. its end (transposed)
  void *vnew, *dvnew;    // [s][V][64]: vnew^T, dvnew^T
  float* gate_partial;   // [s][K]: per-chunk sums of the raw gate's gradient (-> ddt_bias), or null
  float* A_log_partial;  // [s]: per-chunk sums (-> dA_log), or null
  float *dq_heads, *dk_heads;  // [B * T][HV][K] fp32 per value head when HV > H (GVA), else null
};

struct KdaBwdWorkspaceLayout {
  KdaWorkspaceLayout fwd;  // the prep's arrays, at the start
  size_t A_inv = 0, h = 0, dh = 0, vnew = 0, dvnew = 0, gate_partial = 0, A_log_partial = 0;
  size_t dq_heads = 0, dk_heads = 0;
  size_t total = 0;
};

// Offsets (bytes, 256-byte aligned) for `max_chunks` chunks of `heads_v` value heads:
//   the forward's (w, u, kg, qg: 64 x K or V each; P: 64 x 64; decay: K fp32; the chunk table)
//   + A_inv 64 x 64 + h, dh K x V each + vnew, dvnew 64 x V each            per slot, q's dtype
//   + gate partials (K + 1) fp32 per slot                                  with gate_in_kernel
//   + dq, dk per value head: 2 x tokens x HV x K fp32                     when HV > H
inline KdaBwdWorkspaceLayout kda_bwd_workspace_layout(int64_t max_chunks, int64_t heads, int64_t heads_v, int64_t K,
                                                      int64_t V, int64_t num_seqs, int64_t tokens,
                                                      int64_t elem_bytes, bool gate_partials) {
  KdaBwdWorkspaceLayout l;
  l.fwd = kda_workspace_layout(max_chunks, heads_v, K, V, num_seqs, elem_bytes);
  size_t at = l.fwd.total;
  auto take = [&at](size_t bytes) {
    const size_t start = at;
    at += (bytes + 255) / 256 * 256;
    return start;
  };
  const size_t slots = static_cast<size_t>(max_chunks * heads_v);
  l.A_inv = take(slots * kKdaChunk * kKdaChunk * elem_bytes);
  l.h = take(slots * K * V * elem_bytes);
  l.dh = take(slots * K * V * elem_bytes);
  l.vnew = take(slots * kKdaChunk * V * elem_bytes);
  l.dvnew = take(slots * kKdaChunk * V * elem_bytes);
  if (gate_partials) {
    l.gate_partial = take(slots * K * sizeof(float));
    l.A_log_partial = take(slots * sizeof(float));
  }
  if (heads_v > heads) {
    l.dq_heads = take(static_cast<size_t>(tokens * heads_v * K) * sizeof(float));
    l.dk_heads = take(static_cast<size_t>(tokens * heads_v * K) * sizeof(float));
  }
  l.total = at;
  return l;
}

// Validates the params (as kda_backward does, the workspace included) and builds the device args.
Status kda_backward_args(const KdaBackwardParams& p, KdaBwdArgs* args);

// Launches the backward kernels on `stream` (kda_bwd_launch.cuh); the args are complete.
Status launch_kda_backward(const KdaBwdArgs& a, DType dtype, Stream stream);

}  // namespace flare::detail
