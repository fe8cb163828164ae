// Kimi Delta Attention (KDA) and the gated delta rule (GDN), following flash-linear-attention.
//
// q, k [B, T, H, K]; v [B, T, HV, V]; g [B, T, HV, K] (KDA, per-channel log decay) or
// [B, T, HV] (GDN, one decay per head); beta [B, T, HV]. HV is a multiple of H: value head hv
// reads q/k head hv / (HV / H). With cu_seqlens (int32 or int64 [N + 1]) B must be 1 and the
// state restarts at each sequence. States are fp32 [N, HV, K, V].
//   S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T,  o_t = scale S_t^T q_t
#pragma once

#include <cstddef>

#include "flare/status.h"
#include "flare/tensor.h"
#include "flare/types.h"

namespace flare {

struct KdaOptions {
  float scale = 0.f;                // 0: K^-0.5
  bool qk_l2norm = false;           // q, k <- x / sqrt(sum x^2 + 1e-6) per token and head
  bool beta_sigmoid = false;        // beta <- sigmoid(beta) (2*sigmoid with allow_neg_eigval)
  bool allow_neg_eigval = false;
  bool gate_in_kernel = false;      // g is raw: g <- -exp(A_log) * softplus(g + dt_bias), or with
  float lower_bound = 0.f;          // lower_bound < 0: lower_bound * sigmoid(exp(A_log)(g + dt_bias))
};

struct KdaForwardParams {
  TensorView q, k, v, g, beta;
  TensorView A_log;           // fp32 [HV], with gate_in_kernel (optional with lower_bound)
  TensorView dt_bias;         // optional fp32 [HV * K] (KDA) or [HV] (GDN)
  TensorView initial_state;   // optional fp32 [N, HV, K, V]
  TensorView cu_seqlens;      // optional
  TensorView out;             // [B, T, HV, V], dtype of q
  TensorView final_state;     // optional fp32 [N, HV, K, V]
  KdaOptions options;
  void* workspace = nullptr;  // device memory of kda_forward_workspace_size bytes (GPU forward)
  size_t workspace_bytes = 0;
  // Training: keep the per-chunk WY form for kda_backward. The workspace then has the backward's
  // layout (kda_forward_workspace_size returns kda_backward_workspace_size's figure for the same
  // shapes and options) and the forward also stores A = (I + L)^-1 there; a kda_backward given this
  // workspace, untouched, with workspace_from_forward = true skips recomputing it.
  bool keep_for_backward = false;
  Stream stream = nullptr;
};

struct KdaBackwardParams {
  TensorView q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens;
  TensorView dout;            // [B, T, HV, V]
  TensorView d_final_state;   // optional fp32 [N, HV, K, V]
  TensorView dq, dk, dv, dg, dbeta;  // shaped like their inputs (dg, dbeta: fp32 or their input's dtype)
  TensorView d_initial_state;        // optional (required when initial_state is given)
  TensorView dA_log, ddt_bias;       // with gate_in_kernel
  KdaOptions options;
  void* workspace = nullptr;  // device memory of kda_backward_workspace_size bytes (GPU backward)
  size_t workspace_bytes = 0;
  // The workspace is what kda_forward left with keep_for_backward, for these same inputs, shapes
  // and options, unmodified since: the backward reads the forward's per-chunk WY form instead of
  // recomputing it (its first kernel; gradients bitwise equal either way). The backward leaves
  // that part intact, so it may run again from the same workspace.
  bool workspace_from_forward = false;
  Stream stream = nullptr;
};

// The chunked forward on the GPU (mma.sync, sm_80+): K and V in {64, 128}, fp16 or bf16.
// It keeps each 64-token chunk's WY form (w, u, the gated q and k, the intra-chunk scores) in the
// caller's workspace between its two stages; kda_forward_workspace_size gives its size, which
// depends on the shapes only (with cu_seqlens: on T and N, not on the lengths). Nothing is
// allocated and nothing synchronizes with the host; cu_seqlens stays on the device.
// Numerics: gates are cumulated per chunk in fp32; the per-chunk matrices and the state used as
// an MMA operand are rounded to the input dtype (as in flash-linear-attention); the state is
// carried in fp32. Intra-chunk decays are exact while one channel's gate summed over 8
// consecutive tokens stays above -87 (exp(-87) ~ 1e-38).
Status kda_forward_workspace_size(const KdaForwardParams& params, size_t* bytes);
Status kda_forward(const KdaForwardParams& params);

// The chunked backward on the GPU (mma.sync, sm_80+; K and V in {64, 128}, fp16 or bf16): every
// gradient of kda_forward's inputs (dq, dk, dv, dg, dbeta; d_initial_state with initial_state;
// dA_log, ddt_bias with gate_in_kernel), seeded by dout and, when given, d_final_state. It
// recomputes the forward's per-chunk WY form, records each chunk's start state (in the input
// dtype), carries the state gradient back in fp32, then computes every chunk's gradients in
// parallel. The workspace (kda_backward_workspace_size; depends on the shapes only) holds those
// per-chunk quantities: per 64-token chunk and value head 2 x (192 K + 192 V + 2 x 64 x 64 + 2 K V)
// bytes (16-bit inputs) + 4 K (+ 4 (K + 1) with gate_in_kernel), and with grouped value heads
// (HV > H) 8 K bytes per token and value head. Nothing is allocated and nothing synchronizes with
// the host; cu_seqlens stays on the device; the result is deterministic. Shared memory: K = V = 128
// needs the 227 KiB of an sm_90 SM. fp16 inputs hold the intra-chunk decay factors only while one
// channel's gate summed over 8 tokens stays above -11 (bf16: -87), as in the forward.
Status kda_backward_workspace_size(const KdaBackwardParams& params, size_t* bytes);
Status kda_backward(const KdaBackwardParams& params);

}  // namespace flare

// ---- Recurrent step (decode) ------------------------------------------------------------------
// flash-linear-attention's fused_recurrent_kda / fused_recurrent_gated_delta_rule: a few tokens
// per sequence applied to fp32 states kept in a pool, for decoding and speculative decoding.
//
// q, k [N, Tq, H, K]; v [N, Tq, HV, V]; g [N, Tq, HV, K] (KDA) or [N, Tq, HV] (GDN); beta
// [N, Tq, HV]; out [N, Tq, HV, V] in q's dtype. Or, with cu_seqlens (int32 / int64 [N + 1] on
// the device), B = 1 and sequence n owns the packed tokens [cu_seqlens[n], cu_seqlens[n + 1]).
// Any Tq works; the kernel is built for a few tokens (1-8, e.g. speculative decoding) per
// sequence, applied while the state stays in registers (long prompts belong to kda_forward).
//
// States: `state` is a pool fp32 [P, HV, K, V] ([HV, K, V] dense, any 16-byte-multiple stride
// between slots). Sequence n starts from slot state_indices[n] (int32 [N]; without it, slot n
// and P must equal N) and its updated state is written back to that slot IN PLACE, or, when
// `final_state` (fp32 [N, HV, K, V]) is given, to final_state[n] while the pool is only read.
// A negative index means no state: the sequence starts from zero and nothing is written back to
// the pool (final_state[n], when given, still receives its state). An index >= P, which the host
// cannot check in device memory, is never dereferenced: that sequence's outputs become NaN and
// nothing is written. Without `state` every sequence starts from zero.
// Two sequences of one call must not share a pool slot (their updates would race).
//
// K and V in {64, 128}; fp16 or bf16 (g and beta fp32 or q's dtype); every KdaOptions field.
// Nothing is allocated and nothing synchronizes with the host, so a step can be captured in a
// CUDA graph (indices and cu_seqlens are read on the device).
namespace flare {

struct KdaRecurrentParams {
  TensorView q, k, v, g, beta;
  TensorView A_log;          // fp32 [HV], with options.gate_in_kernel (optional with lower_bound)
  TensorView dt_bias;        // optional fp32 [HV * K] (KDA) or [HV] (GDN)
  TensorView cu_seqlens;     // optional
  TensorView state;          // optional fp32 [P, HV, K, V], updated in place
  TensorView state_indices;  // optional int32 [N]: the pool slot of each sequence (< 0: none)
  TensorView final_state;    // optional fp32 [N, HV, K, V]: receives the states instead of the pool
  TensorView out;            // [N, Tq, HV, V] (or [1, T, HV, V] with cu_seqlens), dtype of q
  KdaOptions options;
  Stream stream = nullptr;
};

Status kda_recurrent_step(const KdaRecurrentParams& params);

}  // namespace flare
