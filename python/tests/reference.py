"""PyTorch references for the tests.

The attention reference is SDPA's math backend in fp32 on upcast inputs (a hand-written fp32 path
where SDPA has no equivalent: soft-capping, sinks). Its counterpart `attention_lowp` is the same
computation in the inputs' dtype (scores, softmax and P rounded to bf16/fp16, as FlashAttention's
tests do): a kernel passes when its error against the fp32 reference is within a small multiple of
the low-precision computation's own error.
"""

import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def visible(seqlen_q, seqlen_k, causal, window, device):
    """[seqlen_q, seqlen_k] bool: key j is visible to query i (bottom-right aligned, as flare and
    FlashAttention define it)."""
    left, right = window
    if causal:
        right = 0
    i = torch.arange(seqlen_q, device=device)[:, None] + (seqlen_k - seqlen_q)
    j = torch.arange(seqlen_k, device=device)[None, :]
    ok = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if left >= 0:
        ok &= j >= i - left
    if right >= 0:
        ok &= j <= i + right
    return ok


def _manual(q, k, v, mask, scale, softcap, sinks):
    """q [B, H, Sq, D], k/v [B, H, Sk, D] (heads already repeated), in their own dtype."""
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        sink = sinks.to(s.dtype)[None, :, None, None].expand(s.shape[0], s.shape[1], s.shape[2], 1)
        s = torch.cat([s, sink], dim=-1)
    p = torch.softmax(s, dim=-1)
    if sinks is not None:
        p = p[..., :-1]
    p = torch.nan_to_num(p, nan=0.0)  # rows that see no key
    return torch.matmul(p.to(v.dtype), v)


def attention(q, k, v, causal=False, window=(-1, -1), softcap=0.0, scale=None, sinks=None, upcast=True):
    """q [B, Sq, H, D], k/v [B, Sk, Hkv, D] -> [B, Sq, H, D] in q's dtype. upcast=True: fp32 (SDPA
    math where it applies); upcast=False: the same computation in the inputs' dtype."""
    dtype = q.dtype
    if upcast:
        q, k, v = q.float(), k.float(), v.float()
        sinks = None if sinks is None else sinks.float()
    seqlen_q, seqlen_k, heads, heads_kv = q.shape[1], k.shape[1], q.shape[2], k.shape[2]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    mask = visible(seqlen_q, seqlen_k, causal, window, q.device)
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    if upcast and softcap == 0 and sinks is None:
        with sdpa_kernel(SDPBackend.MATH):
            out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale,
                                                 enable_gqa=heads != heads_kv)
        out = out.masked_fill(~mask.any(-1)[:, None], 0.0)  # rows that see no key: flare gives 0
        out = torch.nan_to_num(out, nan=0.0)
    else:
        group = heads // heads_kv
        kt, vt = kt.repeat_interleave(group, dim=1), vt.repeat_interleave(group, dim=1)
        out = _manual(qt, kt, vt, mask, scale, softcap, sinks)
    return out.transpose(1, 2).to(dtype)


def attention_lowp(q, k, v, **kw):
    return attention(q, k, v, upcast=False, **kw)


def lse(q, k, causal=False, window=(-1, -1), softcap=0.0, scale=None):
    """fp32 [B, H, Sq] natural-log LSE of the scaled (capped) scores; +inf where a row sees no key."""
    q, k = q.float(), k.float()
    heads, heads_kv = q.shape[2], k.shape[2]
    k = k.repeat_interleave(heads // heads_kv, dim=2)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    mask = visible(q.shape[1], k.shape[1], causal, window, q.device)
    s = s.masked_fill(~mask, float("-inf"))
    out = torch.logsumexp(s, dim=-1)
    return torch.where(mask.any(-1), out, torch.full_like(out, math.inf))


def decode(q, k_cache, v_cache, cache_seqlens, causal=True, window_left=-1, upcast=True):
    """Decode reference: the q_len queries are the last of each sequence's cache_seqlens[b] keys."""
    outs = []
    for b in range(q.shape[0]):
        n = int(cache_seqlens[b])
        outs.append(attention(q[b:b + 1], k_cache[b:b + 1, :n], v_cache[b:b + 1, :n], causal=causal,
                              window=(window_left, -1), upcast=upcast))
    return torch.cat(outs)


def kda(q, k, v, g, beta, scale=None, initial_state=None):
    """The KDA / gated delta rule recurrence in fp32, token by token:
    S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T,  o_t = scale S_t^T q_t.
    q, k [B, T, H, K]; v [B, T, HV, V]; g [B, T, HV, K] or [B, T, HV]; beta [B, T, HV]."""
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    rep = HV // H
    q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
    if g.dim() == 3:
        g = g[..., None].expand(B, T, HV, K)
    scale = K ** -0.5 if scale is None else scale
    S = torch.zeros(B, HV, K, V, device=q.device) if initial_state is None else initial_state.float().clone()
    out = torch.empty(B, T, HV, V, device=q.device)
    for t in range(T):
        S = S * g[:, t].exp()[..., None]
        kt, vt, bt = k[:, t], v[:, t], beta[:, t]
        pred = torch.einsum("bhk,bhkv->bhv", kt, S)
        S = S + torch.einsum("bhk,bhv->bhkv", kt, bt[..., None] * (vt - pred))
        out[:, t] = scale * torch.einsum("bhk,bhkv->bhv", q[:, t], S)
    return out, S
