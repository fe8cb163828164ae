// The KDA / GDN recurrent step (flare::kda_recurrent_step): its validation, and the device args
// built once on the host (kda_recurrent_api.cpp) for the kernel (kda_recurrent_step.cuh).
#pragma once

#include <cstdint>

#include "flare/kda.h"
#include "src/kda/kda_args.h"
#include "src/kda/kda_fwd_params.h"

namespace flare::detail {

struct KdaRecurrentShape {
  KdaShape base;        // the inputs' shape, as the chunked forward derives it (num_seqs = N)
  int num_slots = 0;    // P: pool slots (0 without a state)
  bool indexed = false;  // state_indices given
};

// Every argument rule of kda_recurrent_step. The inputs (q, k, v, g, beta, A_log, dt_bias,
// cu_seqlens, out, options) follow the chunked forward's rules and messages; then the pool
// `state`, `state_indices` and `final_state`. With kCPU the values of cu_seqlens and
// state_indices are checked too (device views are not read).
Status validate_kda_recurrent(const KdaRecurrentParams& p, DeviceKind device, KdaRecurrentShape* s);

struct KdaRecurrentArgs {
  // Inputs (q's dtype unless noted).
  const void *q, *k, *v;
  const void* g;               // fp32 or q's dtype; [.., HV, K] or [.., HV] (scalar_gate)
  const void* beta;            // fp32 or q's dtype
  const float* A_log;          // [HV] or null
  const float* dt_bias;        // [HV * K] / [HV] or null
  const void* cu_seqlens;      // int32 / int64 [N + 1] or null
  RowStrides q_st, k_st, v_st, g_st, beta_st;  // g_st.head / beta_st.head: per value head
  bool g_fp32 = false, beta_fp32 = false, cu_int64 = false;
  // States.
  float* state;                // pool [P, HV, K, V] (slot stride slot_stride) or null
  int64_t slot_stride;         // elements between two pool slots
  const int32_t* state_indices;  // [N] or null (slot n)
  float* final_state;          // [N, HV, K, V] or null (then the pool is written in place)
  // Output.
  void* out;
  RowStrides out_st;

  // Shape and options.
  int seqlen, heads, heads_v, num_seqs, num_slots, key_dim, value_dim;
  bool varlen, scalar_gate;
  float scale;
  bool qk_l2norm, beta_sigmoid, gate_in_kernel;
  float beta_factor;  // 1, or 2 with allow_neg_eigval
  float lower_bound;  // < 0: bounded gate
};

// Value columns per CTA (16, 32 or 64; kda_recurrent_dispatch.cu) for `heads` (sequence, value
// head) pairs on `num_sms` SMs; FLARE_KDA_RECURRENT_BV overrides it (tuning).
int recurrent_slice_width(int64_t heads, int value_dim, int num_sms);

// Launches the step kernel for q's dtype on `stream` (kda_recurrent_{bf16,fp16}.cu).
Status launch_kda_recurrent(const KdaRecurrentArgs& a, DType dtype, Stream stream);

}  // namespace flare::detail
