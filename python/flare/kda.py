"""Kimi Delta Attention and the gated delta rule with flash-linear-attention's argument
names (fla.ops.kda.chunk_kda, fla.ops.gated_delta_rule.chunk_gated_delta_rule; for decoding
fla.ops.kda.fused_recurrent_kda and fused_recurrent_gated_delta_rule, with a state pool updated in
place).

q, k [B, T, H, K]; v [B, T, HV, V] (HV a multiple of H); g [B, T, HV, K] (KDA, per-channel log
decay) or [B, T, HV] (gated delta rule); beta [B, T, HV]; K and V in {64, 128}, fp16 or bf16
(g, beta fp32 or q's dtype). With cu_seqlens (int32/int64 [N + 1]) B must be 1. States are fp32
[N, HV, K, V]. chunk_kda / chunk_gated_delta_rule have a backward (flare's chunked KDA backward,
through the in-kernel options: dq, dk, dv, dg, dbeta, d initial_state, dA_log, ddt_bias); the
recurrent decode step has none (calling it on tensors that require grad raises).
"""

import torch

from . import _C, _checks
from . import ops  # the fake implementations; ops.eager

_kda_fwd = torch.ops.flare.kda_fwd


def _no_grad(*tensors):
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        raise NotImplementedError("flare's recurrent KDA step has no backward: call it under torch.no_grad() or on "
                                  "tensors that do not require grad (chunk_kda has one)")


def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, cu_seqlens=None, *, use_gate_in_kernel=False,
              use_beta_sigmoid_in_kernel=False, A_log=None, dt_bias=None, lower_bound=None, allow_neg_eigval=False):
    """Returns (o [B, T, HV, V] in q's dtype, final_state fp32 [N, HV, K, V] or None)."""
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        _checks.tensor(name, t)
    for name, t in (("initial_state", initial_state), ("cu_seqlens", cu_seqlens), ("A_log", A_log),
                    ("dt_bias", dt_bias)):
        _checks.optional_tensor(name, t)
    bound = 0.0 if lower_bound is None else _checks.number("lower_bound", lower_bound)
    run = _kda_fwd
    if ops.eager(q):  # the C++ implementation, through ops.eager_autograd where autograd must see it
        grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                               for t in (q, k, v, g, beta, A_log, dt_bias, initial_state))
        run = ops.kda_fwd_eager_autograd if grad else _C.kda_fwd
    o, final_state = run(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens,
                         0.0 if scale is None else _checks.number("scale", scale), bool(use_qk_l2norm_in_kernel),
                         bool(use_beta_sigmoid_in_kernel), bool(allow_neg_eigval), bool(use_gate_in_kernel), bound,
                         bool(output_final_state))
    return o, (final_state if output_final_state else None)


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           cu_seqlens=None, use_qk_l2norm_in_kernel=False):
    """The gated delta rule (one decay per head: g [B, T, HV]). Returns (o, final_state or None)."""
    return chunk_kda(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                     output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                     cu_seqlens=cu_seqlens)


# ---- the recurrent step (decode): flash-linear-attention's fused_recurrent_kda ---------------------

_kda_recurrent = torch.ops.flare.kda_recurrent
_kda_recurrent_inplace = torch.ops.flare.kda_recurrent_inplace


def _slot_indices(ssm_state_indices):
    """flare's pool indices are int32 [N]; FLA also passes int64 ones (converted here)."""
    if ssm_state_indices is not None and ssm_state_indices.dtype == torch.int64:
        return ssm_state_indices.to(torch.int32)
    return ssm_state_indices


def fused_recurrent_kda(q, k, v, g, beta, A_log=None, dt_bias=None, scale=None, initial_state=None,
                        output_final_state=False, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                        use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, lower_bound=None,
                        state_v_first=False, cu_seqlens=None, *, ssm_state_indices=None, inplace_final_state=None,
                        num_accepted_tokens=None):
    """flash-linear-attention's fused_recurrent_kda (forward, decoding): a few tokens per sequence
    (q, k [B, T, H, K]; v [B, T, HV, V]; g [B, T, HV, K], or [B, T, HV] for the gated delta rule;
    beta [B, T, HV]; or packed with cu_seqlens and B = 1) applied to fp32 states [K, V].

    Two ways to hold the states:
      - FLA's fused_recurrent_kda: initial_state [N, HV, K, V] (or None: zeros) is only read;
        returns (o, final_state [N, HV, K, V] fp32 or None) by output_final_state.
      - A state pool updated in place (FLA's fused_recurrent_kda_fwd as serving engines call it):
        with ssm_state_indices (int32 or int64 [N]) sequence n uses slot ssm_state_indices[n] of
        initial_state [P, HV, K, V] (a negative index: no state, start from zero, write nothing);
        with inplace_final_state=True and no indices, slot n. Returns (o, initial_state), the pool
        holding the updated states. An index >= P is not read: that sequence's outputs are NaN.
    No allocation besides the outputs; capturable in a CUDA graph. Not supported (they raise
    NotImplementedError): state_v_first, num_accepted_tokens, and ssm_state_indices with
    inplace_final_state=False (FLA's per-token states).
    """
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        _checks.tensor(name, t)
    for name, t in (("initial_state", initial_state), ("cu_seqlens", cu_seqlens), ("A_log", A_log),
                    ("dt_bias", dt_bias), ("ssm_state_indices", ssm_state_indices)):
        _checks.optional_tensor(name, t)
    _checks.unsupported("state_v_first", state_v_first, False, "flare's states are [K, V] (key rows)")
    _checks.unsupported("num_accepted_tokens", num_accepted_tokens, None,
                        "speculative decoding with per-token states is not supported")
    _no_grad(q, k, v, g, beta, initial_state, A_log, dt_bias)
    inplace = ssm_state_indices is not None if inplace_final_state is None else bool(inplace_final_state)
    if ssm_state_indices is not None and not inplace:
        raise NotImplementedError("argument 'inplace_final_state': ssm_state_indices with inplace_final_state=False "
                                  "(FLA's per-token states) is not supported; pass True or None")
    options = (0.0 if scale is None else _checks.number("scale", scale), bool(use_qk_l2norm_in_kernel),
               bool(use_beta_sigmoid_in_kernel), bool(allow_neg_eigval), bool(use_gate_in_kernel),
               0.0 if lower_bound is None else _checks.number("lower_bound", lower_bound))
    if inplace:
        if initial_state is None:
            raise ValueError("argument 'initial_state': the state pool is required to update states in place "
                             "(ssm_state_indices or inplace_final_state=True)")
        indices = _slot_indices(ssm_state_indices)
        if ops.eager(q):  # no autograd to record (_no_grad above), no tracing: skip the dispatcher
            o = _C.kda_recurrent_inplace(q, k, v, g, beta, A_log, dt_bias, initial_state, indices, cu_seqlens,
                                         *options)
        else:
            o = _kda_recurrent_inplace(q, k, v, g, beta, A_log, dt_bias, initial_state, indices, cu_seqlens, *options)
        return o, initial_state
    o, final_state = _kda_recurrent(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, *options,
                                    bool(output_final_state))
    return o, (final_state if output_final_state else None)


def fused_recurrent_gated_delta_rule(q, k, v, g=None, beta=None, scale=None, initial_state=None,
                                     output_final_state=False, use_qk_l2norm_in_kernel=False, cu_seqlens=None, *,
                                     gk=None, gv=None, ssm_state_indices=None, inplace_final_state=None,
                                     num_accepted_tokens=None):
    """flash-linear-attention's fused_recurrent_gated_delta_rule (forward), called as its examples
    and serving engines do, (q, k, v, g, beta, ...): g [B, T, HV] one decay per head, or (keyword)
    gk [B, T, HV, K] per key channel (KDA); beta [B, T, HV] (None: ones); no gate at all: no decay.
    The states and the pool work as in fused_recurrent_kda. gv, and g together with gk, are not
    supported."""
    _checks.unsupported("gv", gv, None, "flare has no per-value-channel decay")
    if g is not None and gk is not None:
        raise NotImplementedError("arguments 'g' and 'gk': flare takes one of the two decays, not both")
    _checks.tensor("v", v)
    gate = gk if gk is not None else g
    if gate is None:
        gate = torch.zeros(v.shape[:3], dtype=torch.float32, device=v.device)
    if beta is None:
        beta = torch.ones(v.shape[:3], dtype=v.dtype, device=v.device)
    return fused_recurrent_kda(q, k, v, gate, beta, scale=scale, initial_state=initial_state,
                               output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                               cu_seqlens=cu_seqlens, ssm_state_indices=ssm_state_indices,
                               inplace_final_state=inplace_final_state, num_accepted_tokens=num_accepted_tokens)
