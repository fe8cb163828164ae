// CPU fp64 oracles for Kimi Delta Attention (KDA) and the gated delta rule (GDN).
//
// The math is KDA.md (the project notes on KDA), section (a): for one sequence and one value head,
//   S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T,  o_t = scale S_t^T q_t.
// Inputs are CPU views of any float dtype, read with their strides; every computation is in fp64
// and results are stored in each output view's own dtype. The in-kernel options (l2norm of q/k,
// beta sigmoid, gate activation) are applied first, exactly as in flare::KdaOptions.
#pragma once

#include "flare/kda.h"
#include "flare/status.h"

namespace flare::ref {

// The exact token-by-token recurrence. Writes p.out and, when given, p.final_state.
// Returns InvalidArgument naming the argument when a shape, dtype or device is wrong.
Status kda_forward(const KdaForwardParams& p);

// Reverse mode through the same recurrence (every state is kept, then walked backwards).
// Gradients are w.r.t. the raw inputs as given, i.e. through the in-kernel options: dq, dk, dv,
// dg (shaped like g), dbeta, d_initial_state (required when initial_state is given), dA_log and
// ddt_bias (with gate_in_kernel; zero-filled when given otherwise). d_final_state, when given,
// seeds the gradient of the last state of each sequence.
Status kda_backward(const KdaBackwardParams& p);

// An independent forward through the chunked WY form of KDA.md section (b) with chunks of
// `chunk_size` tokens (the last chunk of each sequence may be partial). Only for cross-checking
// kda_forward: both must agree to rounding. With `intermediates` a 16-bit dtype, the per-chunk
// matrices a GPU kernel stores in its input dtype (A = (I + L)^-1, w, u, the gated q and k, the
// scaled P, the state as an MMA operand, vnew) are rounded to it: the low-precision baseline of
// the GPU tests.
Status kda_forward_chunked(const KdaForwardParams& p, int chunk_size, DType intermediates = DType::kFloat64);

// The chunked backward, stage by stage as the GPU backward computes it (prep, a forward pass
// recording each chunk's start state and vnew, a reverse pass carrying the state gradient, then
// per-chunk gradients; see kda_ref.cpp), with the same outputs and checks as kda_backward. Only
// for cross-checking: it must agree with kda_backward to rounding. With `intermediates` a 16-bit
// dtype, what the GPU kernels store or use as MMA operands in their input dtype is rounded to it
// (the forward's intermediates, the per-chunk states h and their gradients dh, vnew, dvnew, and
// the per-chunk dw, dA, dL, dP): the low-precision baseline of the GPU backward tests.
Status kda_backward_chunked(const KdaBackwardParams& p, int chunk_size, DType intermediates = DType::kFloat64);

}  // namespace flare::ref
