"""Softmax attention with FlashAttention's Python API (flash_attn 2.x argument names and layouts).

q [batch, seqlen_q, heads, head_dim], k/v [batch, seqlen_k, heads_kv, head_dim] (heads_kv divides
heads: GQA/MQA), or packed [total, heads, head_dim] with cu_seqlens (varlen). fp16 or bf16, head
dims up to 256 (multiples of 8). Masks are aligned bottom-right as in FlashAttention. The LSE is
fp32 [batch, heads, seqlen_q] (varlen: [heads, total_q]), natural log. Differentiable in q, k, v
(and sinks); deterministic=True makes the backward bitwise reproducible.
"""

import torch

from . import _C, _checks
from .ops import eager, fwd_eager_autograd

_fwd_op = torch.ops.flare.fwd


def _fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, sinks, softmax_scale, causal,
         window_left, window_right, softcap, deterministic):
    """The op where torch.compile traces; eagerly its C++ implementation, directly where autograd need
    not see it and through ops.eager_autograd where it must."""
    run = _fwd_op
    if eager(q):
        grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad or
                                            (sinks is not None and sinks.requires_grad))
        run = fwd_eager_autograd if grad else _C.fwd
    return run(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, sinks, softmax_scale, causal,
               window_left, window_right, softcap, deterministic)


def _unsupported(dropout_p, alibi_slopes):
    if dropout_p != 0.0:
        raise NotImplementedError(f"argument 'dropout_p': flare has no attention dropout; pass 0.0 "
                                  f"(got {dropout_p!r})")
    _checks.unsupported("alibi_slopes", alibi_slopes, None, "ALiBi is not implemented in flare")


def _result(out, lse, return_attn_probs, return_lse):
    if return_attn_probs:
        return out, lse, None  # FlashAttention's (out, softmax_lse, S_dmask); no dropout, no S_dmask
    if return_lse:
        return out, lse
    return out


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False, *, return_lse=False,
                    sinks=None):
    """Attention over batched q [B, Sq, H, D], k/v [B, Sk, Hkv, D].

    Returns out [B, Sq, H, D]; with return_lse=True (out, lse [B, H, Sq]); with
    return_attn_probs=True FlashAttention's triple (out, lse, None). sinks: optional fp32 [H]
    logits that join each row's softmax denominator (attention sinks).
    """
    _checks.tensor("q", q)
    _checks.tensor("k", k)
    _checks.tensor("v", v)
    _checks.optional_tensor("sinks", sinks)
    _unsupported(dropout_p, alibi_slopes)
    left, right = _checks.window(window_size)
    out, lse = _fwd(q, k, v, None, None, 0, 0, sinks, _checks.softmax_scale(softmax_scale), bool(causal), left,
                    right, _checks.number("softcap", softcap), bool(deterministic))
    return _result(out, lse, return_attn_probs, return_lse)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None, *, return_lse=False,
                           sinks=None):
    """Attention over packed sequences: q [total_q, H, D], k/v [total_k, Hkv, D], cu_seqlens_q/k int32
    [batch + 1] (on the GPU), max_seqlen_q/k upper bounds of the sequence lengths (ints).

    Returns out [total_q, H, D]; with return_lse=True (out, lse [H, total_q]).
    """
    _checks.tensor("q", q)
    _checks.tensor("k", k)
    _checks.tensor("v", v)
    _checks.tensor("cu_seqlens_q", cu_seqlens_q)
    _checks.tensor("cu_seqlens_k", cu_seqlens_k)
    _checks.optional_tensor("sinks", sinks)
    _unsupported(dropout_p, alibi_slopes)
    _checks.unsupported("block_table", block_table, None,
                        "paged K/V in the varlen forward is not implemented (flash_attn_with_kvcache takes one)")
    left, right = _checks.window(window_size)
    out, lse = _fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, _checks.integer("max_seqlen_q", max_seqlen_q),
                    _checks.integer("max_seqlen_k", max_seqlen_k), sinks, _checks.softmax_scale(softmax_scale),
                    bool(causal), left, right, _checks.number("softcap", softcap), bool(deterministic))
    return _result(out, lse, return_attn_probs, return_lse)
