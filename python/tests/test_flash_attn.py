"""flash_attn_func / flash_attn_varlen_func against the PyTorch references, forward and backward."""

import pytest
import torch

import flare
import reference as ref
from conftest import assert_close_to_ref

DTYPES = [torch.bfloat16, torch.float16]


def make(batch, seqlen_q, seqlen_k, heads, heads_kv, head_dim, dtype, requires_grad=True):
    def t(s, h):
        return torch.randn(batch, s, h, head_dim, device="cuda", dtype=dtype, requires_grad=requires_grad)
    return t(seqlen_q, heads), t(seqlen_k, heads_kv), t(seqlen_k, heads_kv)


def check_fwd_bwd(q, k, v, grads=True, **kw):
    """flare vs the fp32 reference, judged against the same computation in q's dtype."""
    out = flare.flash_attn_func(q, k, v, causal=kw.get("causal", False), window_size=kw.get("window", (-1, -1)),
                                softcap=kw.get("softcap", 0.0), softmax_scale=kw.get("scale"),
                                sinks=kw.get("sinks"), deterministic=kw.get("deterministic", False))
    out_ref = ref.attention(q, k, v, **kw)
    out_lowp = ref.attention_lowp(q, k, v, **kw)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert_close_to_ref(out, out_ref, out_lowp)
    if not grads:
        return
    dout = torch.randn_like(out)
    inputs = [q, k, v] + ([kw["sinks"]] if kw.get("sinks") is not None else [])
    g = torch.autograd.grad(out, inputs, dout)
    g_ref = torch.autograd.grad(out_ref, inputs, dout)
    g_lowp = torch.autograd.grad(out_lowp, inputs, dout)
    for name, a, b, c in zip("qkvs", g, g_ref, g_lowp):
        assert a.shape == b.shape
        assert_close_to_ref(a, b, c, atol=1e-3, what="d" + name)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlens", [(128, 128), (113, 203), (239, 97), (1, 300)])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)])
def test_forward_backward(dtype, head_dim, causal, seqlens, heads):
    q, k, v = make(2, *seqlens, *heads, head_dim, dtype)
    check_fwd_bwd(q, k, v, causal=causal)


@pytest.mark.parametrize("window", [(32, 0), (48, 16), (-1, 8), (100, -1)])
def test_sliding_window(window):
    q, k, v = make(2, 200, 260, 4, 2, 128, torch.bfloat16)
    check_fwd_bwd(q, k, v, window=window)


@pytest.mark.parametrize("softcap", [5.0, 30.0])
def test_softcap_and_scale(softcap):
    q, k, v = make(2, 150, 150, 4, 4, 64, torch.bfloat16)
    check_fwd_bwd(q * 3, k * 3, v, causal=True, softcap=softcap, scale=0.2)


def test_sinks():
    q, k, v = make(2, 96, 160, 8, 2, 64, torch.bfloat16)
    sinks = torch.randn(8, device="cuda", dtype=torch.float32, requires_grad=True)
    check_fwd_bwd(q, k, v, causal=True, sinks=sinks)


@pytest.mark.parametrize("causal", [False, True])
def test_lse(causal):
    q, k, v = make(2, 77, 190, 4, 1, 128, torch.float16, requires_grad=False)
    out, lse = flare.flash_attn_func(q, k, v, causal=causal, return_lse=True)
    assert lse.shape == (2, 4, 77) and lse.dtype == torch.float32
    torch.testing.assert_close(lse, ref.lse(q, k, causal=causal), atol=2e-3, rtol=1e-3)
    out3, lse3, probs = flare.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    assert probs is None and torch.equal(out3, out) and torch.equal(lse3, lse)


def test_strided_inputs():
    """q/k/v as views of a packed qkv tensor (FlashAttention's qkvpacked layout), and a stride-0
    expanded gradient (what .sum().backward() hands the op)."""
    qkv = torch.randn(2, 130, 3, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    q, k, v = qkv.unbind(2)
    out = flare.flash_attn_func(q, k, v, causal=True)
    out.sum().backward()
    out_ref = ref.attention(q, k, v, causal=True)
    out_lowp = ref.attention_lowp(q, k, v, causal=True)
    assert_close_to_ref(out, out_ref, out_lowp)
    (g_ref,) = torch.autograd.grad(out_ref.sum(), qkv)
    (g_lowp,) = torch.autograd.grad(out_lowp.sum(), qkv)
    assert_close_to_ref(qkv.grad, g_ref, g_lowp, atol=1e-3, what="dqkv")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_varlen(causal, dtype):
    lens_q = [1, 37, 128, 0, 203]
    lens_k = [17, 37, 300, 5, 150]
    heads, heads_kv, d = 8, 2, 128
    cu_q = torch.tensor([0] + lens_q, device="cuda").cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + lens_k, device="cuda").cumsum(0).to(torch.int32)
    q = torch.randn(sum(lens_q), heads, d, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(sum(lens_k), heads_kv, d, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(sum(lens_k), heads_kv, d, device="cuda", dtype=dtype, requires_grad=True)
    out, lse = flare.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal,
                                            return_lse=True)
    assert out.shape == q.shape and lse.shape == (heads, sum(lens_q))
    dout = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    outs_ref, outs_lowp = [], []
    for b in range(len(lens_q)):
        sq = slice(int(cu_q[b]), int(cu_q[b + 1]))
        sk = slice(int(cu_k[b]), int(cu_k[b + 1]))
        if lens_q[b] == 0:
            outs_ref.append(q[sq] * 0)
            outs_lowp.append(q[sq] * 0)
            continue
        qb, kb, vb = q[None, sq], k[None, sk], v[None, sk]
        outs_ref.append(ref.attention(qb, kb, vb, causal=causal)[0])
        outs_lowp.append(ref.attention_lowp(qb, kb, vb, causal=causal)[0])
    out_ref, out_lowp = torch.cat(outs_ref), torch.cat(outs_lowp)
    assert_close_to_ref(out, out_ref, out_lowp)
    g_ref = torch.autograd.grad(out_ref, (q, k, v), dout)
    g_lowp = torch.autograd.grad(out_lowp, (q, k, v), dout)
    for name, a, b, c in zip("qkv", (dq, dk, dv), g_ref, g_lowp):
        assert_close_to_ref(a, b, c, atol=1e-3, what="d" + name)


def test_deterministic_backward_is_bitwise_reproducible():
    q, k, v = make(2, 1024, 1024, 16, 2, 128, torch.bfloat16)
    out = flare.flash_attn_func(q, k, v, causal=True, deterministic=True)
    dout = torch.randn_like(out)
    first = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    for _ in range(5):
        again = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
        for a, b in zip(first, again):
            assert torch.equal(a, b)
    # and it is the right gradient
    out_ref = ref.attention(q, k, v, causal=True)
    out_lowp = ref.attention_lowp(q, k, v, causal=True)
    for name, a, b, c in zip("qkv", first, torch.autograd.grad(out_ref, (q, k, v), dout),
                             torch.autograd.grad(out_lowp, (q, k, v), dout)):
        assert_close_to_ref(a, b, c, atol=1e-3, what="d" + name)


def test_no_grad_and_inference_mode():
    q, k, v = make(1, 64, 64, 2, 2, 64, torch.float16)
    with torch.no_grad():
        out = flare.flash_attn_func(q, k, v)
    assert not out.requires_grad
    with torch.inference_mode():
        out2 = flare.flash_attn_func(q.detach(), k.detach(), v.detach())
    torch.testing.assert_close(out, out2, atol=0, rtol=0)


def test_non_default_stream_and_device_guard():
    q, k, v = make(1, 256, 256, 4, 4, 128, torch.bfloat16, requires_grad=False)
    expect = flare.flash_attn_func(q, k, v, causal=True)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        got = flare.flash_attn_func(q, k, v, causal=True)
    torch.cuda.current_stream().wait_stream(s)
    assert torch.equal(got, expect)
