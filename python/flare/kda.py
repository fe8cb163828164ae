"""Kimi Delta Attention and the gated delta rule, forward only, with flash-linear-attention's argument
names (fla.ops.kda.chunk_kda, fla.ops.gated_delta_rule.chunk_gated_delta_rule).

q, k [B, T, H, K]; v [B, T, HV, V] (HV a multiple of H); g [B, T, HV, K] (KDA, per-channel log
decay) or [B, T, HV] (gated delta rule); beta [B, T, HV]; K and V in {64, 128}, fp16 or bf16
(g, beta fp32 or q's dtype). With cu_seqlens (int32/int64 [N + 1]) B must be 1. States are fp32
[N, HV, K, V]. No backward yet: calling these on tensors that require grad raises.
"""

import torch

from . import _checks
from . import ops  # noqa: F401  (fake implementations)

_kda_fwd = torch.ops.flare.kda_fwd


def _no_grad(*tensors):
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        raise NotImplementedError("flare's KDA has no backward yet: call it under torch.no_grad() or on tensors "
                                  "that do not require grad")


def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, cu_seqlens=None, *, use_gate_in_kernel=False,
              use_beta_sigmoid_in_kernel=False, A_log=None, dt_bias=None, lower_bound=None, allow_neg_eigval=False):
    """Returns (o [B, T, HV, V] in q's dtype, final_state fp32 [N, HV, K, V] or None)."""
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        _checks.tensor(name, t)
    for name, t in (("initial_state", initial_state), ("cu_seqlens", cu_seqlens), ("A_log", A_log),
                    ("dt_bias", dt_bias)):
        _checks.optional_tensor(name, t)
    _no_grad(q, k, v, g, beta, initial_state, A_log, dt_bias)
    bound = 0.0 if lower_bound is None else _checks.number("lower_bound", lower_bound)
    o, final_state = _kda_fwd(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens,
                              0.0 if scale is None else _checks.number("scale", scale),
                              bool(use_qk_l2norm_in_kernel), bool(use_beta_sigmoid_in_kernel),
                              bool(allow_neg_eigval), bool(use_gate_in_kernel), bound, bool(output_final_state))
    return o, (final_state if output_final_state else None)


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           cu_seqlens=None, use_qk_l2norm_in_kernel=False):
    """The gated delta rule (one decay per head: g [B, T, HV]). Returns (o, final_state or None)."""
    return chunk_kda(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                     output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                     cu_seqlens=cu_seqlens)
