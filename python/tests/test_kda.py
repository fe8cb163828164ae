"""chunk_kda / chunk_gated_delta_rule (forward) against the token-by-token fp32 recurrence."""

import pytest
import torch

import flare
import reference as ref


def inputs(B, T, H, HV, K, V, gdn=False, dtype=torch.bfloat16):
    q = torch.randn(B, T, H, K, device="cuda", dtype=dtype)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, device="cuda"), dim=-1).to(dtype)
    v = torch.randn(B, T, HV, V, device="cuda", dtype=dtype)
    g_shape = (B, T, HV) if gdn else (B, T, HV, K)
    g = -0.01 - 0.2 * torch.rand(g_shape, device="cuda")
    beta = torch.rand(B, T, HV, device="cuda").to(dtype)
    return q, k, v, g, beta


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("K,V", [(64, 64), (128, 128)])
@pytest.mark.parametrize("gdn", [False, True])
def test_chunk_kda_matches_recurrence(K, V, gdn):
    q, k, v, g, beta = inputs(2, 200, 2, 4, K, V, gdn=gdn)
    h0 = torch.randn(2, 4, K, V, device="cuda") * 0.1
    if gdn:
        o, ht = flare.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    else:
        o, ht = flare.chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o_ref, ht_ref = ref.kda(q, k, v, g, beta, initial_state=h0)
    assert o.shape == v.shape and o.dtype == q.dtype and ht.shape == (2, 4, K, V)
    assert rel_err(o, o_ref) < 3e-2
    assert rel_err(ht, ht_ref) < 3e-2


def test_chunk_kda_varlen():
    lens = [100, 1, 170]
    q, k, v, g, beta = inputs(1, sum(lens), 2, 2, 64, 64)
    cu = torch.tensor([0, 100, 101, 271], device="cuda", dtype=torch.int32)
    o, ht = flare.chunk_kda(q, k, v, g, beta, cu_seqlens=cu, output_final_state=True)
    assert ht.shape == (3, 2, 64, 64)
    for n in range(3):
        s = slice(int(cu[n]), int(cu[n + 1]))
        o_ref, ht_ref = ref.kda(q[:, s], k[:, s], v[:, s], g[:, s], beta[:, s])
        assert rel_err(o[:, s], o_ref) < 3e-2
        assert rel_err(ht[n:n + 1], ht_ref) < 3e-2


def test_chunk_kda_without_final_state_and_grad_refused():
    q, k, v, g, beta = inputs(1, 64, 1, 1, 64, 64)
    o, ht = flare.chunk_kda(q, k, v, g, beta)
    assert ht is None and o.shape == v.shape
    with pytest.raises(NotImplementedError, match="backward"):
        flare.chunk_kda(q.requires_grad_(), k, v, g, beta)
