"""chunk_kda / chunk_gated_delta_rule (forward and autograd backward) and fused_recurrent_kda /
fused_recurrent_gated_delta_rule (forward) against the token-by-token fp32 recurrence, and against each
other."""

import pytest
import torch

import flare
import reference as ref
from conftest import assert_close_to_ref


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


def test_chunk_kda_without_final_state():
    q, k, v, g, beta = inputs(1, 64, 1, 1, 64, 64)
    o, ht = flare.chunk_kda(q, k, v, g, beta)
    assert ht is None and o.shape == v.shape


@pytest.mark.parametrize("K,V", [(64, 64), (128, 128)])
@pytest.mark.parametrize("gdn", [False, True])
def test_chunk_kda_gradients_match_the_recurrence(K, V, gdn):
    """Every gradient through autograd (flare's chunked backward) against autograd through the fp32
    recurrence, with an initial state and a loss on the final state too; GVA 2, T not a multiple of 64."""
    q, k, v, g, beta = inputs(1, 130, 2, 4, K, V, gdn=gdn)
    h0 = torch.randn(1, 4, K, V, device="cuda") * 0.1
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, g, beta, h0)]
    o, ht = flare.chunk_kda(*leaves[:5], initial_state=leaves[5], output_final_state=True)
    w_o, w_h = torch.randn_like(o.float()), torch.randn_like(ht)
    ((o.float() * w_o).sum() + (ht * w_h).sum()).backward()
    ref_leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, g, beta, h0)]
    o_ref, ht_ref = ref.kda(*ref_leaves[:5], initial_state=ref_leaves[5])
    ((o_ref * w_o).sum() + (ht_ref * w_h).sum()).backward()
    for name, got, want in zip(("dq", "dk", "dv", "dg", "dbeta", "d_initial_state"), leaves, ref_leaves):
        assert got.grad is not None and torch.isfinite(got.grad).all(), name
        assert rel_err(got.grad, want.grad) < 5e-2, name


# ---- fused_recurrent_kda / fused_recurrent_gated_delta_rule (decoding) -----------------------------


def activated(q, k, g, beta, A_log=None, dt_bias=None, l2norm=False, beta_sigmoid=False, gate=False,
              lower_bound=None):
    """The in-kernel options applied in fp32, as flare::KdaOptions defines them."""
    q, k, g, beta = q.float(), k.float(), g.float(), beta.float()
    if l2norm:
        q = q / (q.square().sum(-1, keepdim=True) + 1e-6).sqrt()
        k = k / (k.square().sum(-1, keepdim=True) + 1e-6).sqrt()
    if beta_sigmoid:
        beta = beta.sigmoid()
    if gate:
        bias = 0.0 if dt_bias is None else dt_bias.view(g.shape[2], -1).squeeze(-1) if g.dim() == 3 else \
            dt_bias.view(g.shape[2], g.shape[3])
        z = g + bias
        a = torch.ones(g.shape[2], device=g.device) if A_log is None else A_log.exp()
        a = a.view(-1, *([1] * (g.dim() - 3)))
        g = lower_bound * torch.sigmoid(a * z) if lower_bound is not None else -a * torch.nn.functional.softplus(z)
    return q, k, g, beta


def assert_states_close(got, want, atol=1e-4):
    err = (got.float() - want.float()).abs().max().item()
    assert err <= atol, f"state: max error {err:.3e} > {atol:.0e}"


@pytest.mark.parametrize("K,V", [(64, 64), (128, 128), (64, 128)])
@pytest.mark.parametrize("gdn", [False, True])
@pytest.mark.parametrize("T", [1, 3, 8])
def test_fused_recurrent_matches_recurrence(K, V, gdn, T):
    q, k, v, g, beta = inputs(3, T, 2, 4, K, V, gdn=gdn)
    h0 = torch.randn(3, 4, K, V, device="cuda") * 0.1
    h0_before = h0.clone()
    if gdn:
        o, ht = flare.fused_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    else:
        o, ht = flare.fused_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o_ref, ht_ref = ref.kda(q, k, v, g, beta, initial_state=h0)
    assert o.shape == v.shape and o.dtype == q.dtype and ht.shape == (3, 4, K, V) and ht.dtype == torch.float32
    assert_close_to_ref(o, o_ref, o_ref.to(q.dtype), atol=1e-4)
    assert_states_close(ht, ht_ref)
    assert torch.equal(h0, h0_before), "initial_state must only be read without ssm_state_indices"


@pytest.mark.parametrize("options", [dict(l2norm=True), dict(beta_sigmoid=True), dict(gate=True),
                                     dict(gate=True, lower_bound=-5.0), dict(l2norm=True, beta_sigmoid=True, gate=True)])
def test_fused_recurrent_in_kernel_options(options):
    B, T, H, HV, K, V = 2, 4, 2, 2, 128, 64
    q = torch.randn(B, T, H, K, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, T, H, K, device="cuda", dtype=torch.bfloat16)
    if not options.get("l2norm"):
        k = torch.nn.functional.normalize(k.float(), dim=-1).to(torch.bfloat16)
    v = torch.randn(B, T, HV, V, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(B, T, HV, K, device="cuda") if options.get("gate") else -0.01 - 0.2 * torch.rand(B, T, HV, K,
                                                                                                      device="cuda")
    beta = torch.randn(B, T, HV, device="cuda") if options.get("beta_sigmoid") else torch.rand(B, T, HV, device="cuda")
    A_log = torch.rand(HV, device="cuda") - 0.5
    dt_bias = torch.rand(HV * K, device="cuda") - 0.5
    h0 = torch.randn(B, HV, K, V, device="cuda") * 0.1
    gate = options.get("gate", False)
    o, ht = flare.fused_recurrent_kda(q, k, v, g, beta, A_log=A_log if gate else None,
                                      dt_bias=dt_bias if gate else None, initial_state=h0, output_final_state=True,
                                      use_qk_l2norm_in_kernel=options.get("l2norm", False), use_gate_in_kernel=gate,
                                      use_beta_sigmoid_in_kernel=options.get("beta_sigmoid", False),
                                      lower_bound=options.get("lower_bound"))
    qa, ka, ga, ba = activated(q, k, g, beta, A_log, dt_bias, **options)
    o_ref, ht_ref = ref.kda(qa, ka, v, ga, ba, scale=K ** -0.5, initial_state=h0)
    assert_close_to_ref(o, o_ref, o_ref.to(q.dtype), atol=1e-4)
    assert_states_close(ht, ht_ref)


def test_fused_recurrent_state_pool_in_place():
    """Continuous batching: sequence n uses pool slot ssm_state_indices[n]; -1 is no state."""
    K = V = 128
    q, k, v, g, beta = inputs(4, 2, 2, 4, K, V)
    pool = torch.randn(7, 4, K, V, device="cuda") * 0.1
    before = pool.clone()
    idx = torch.tensor([5, 0, -1, 3], device="cuda", dtype=torch.int32)
    h0 = torch.stack([before[i] if i >= 0 else torch.zeros_like(before[0]) for i in idx.tolist()])
    o, returned = flare.fused_recurrent_kda(q, k, v, g, beta, initial_state=pool, ssm_state_indices=idx)
    assert returned is pool
    o_ref, ht_ref = ref.kda(q, k, v, g, beta, initial_state=h0)
    assert_close_to_ref(o, o_ref, o_ref.to(q.dtype), atol=1e-4)
    for n, slot in enumerate(idx.tolist()):
        if slot >= 0:
            assert_states_close(pool[slot], ht_ref[n])
    for slot in (1, 2, 4, 6):
        assert torch.equal(pool[slot], before[slot]), f"slot {slot} is no sequence's and must not change"
    # int64 indices (as FLA passes them) work the same; an index beyond the pool gives NaN outputs.
    pool.copy_(before)
    o64, _ = flare.fused_recurrent_kda(q, k, v, g, beta, initial_state=pool, ssm_state_indices=idx.long())
    assert torch.equal(o64, o)
    o_bad, _ = flare.fused_recurrent_kda(q, k, v, g, beta, initial_state=pool,
                                         ssm_state_indices=torch.tensor([9, 0, -1, 3], device="cuda"))
    assert o_bad[0].isnan().all() and not o_bad[1:].isnan().any()


def test_fused_recurrent_varlen_pool():
    lens = [3, 0, 1, 8]
    cu = torch.tensor([0, 3, 3, 4, 12], device="cuda", dtype=torch.int32)
    q, k, v, g, beta = inputs(1, sum(lens), 2, 2, 64, 64, gdn=True)
    pool = torch.randn(6, 2, 64, 64, device="cuda") * 0.1
    before = pool.clone()
    idx = torch.tensor([4, 1, 0, 2], device="cuda", dtype=torch.int32)
    o, _ = flare.fused_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=pool, cu_seqlens=cu,
                                                  ssm_state_indices=idx)
    for n in range(len(lens)):
        s = slice(int(cu[n]), int(cu[n + 1]))
        o_ref, ht_ref = ref.kda(q[:, s], k[:, s], v[:, s], g[:, s], beta[:, s], initial_state=before[idx[n]][None])
        if lens[n]:
            assert_close_to_ref(o[:, s], o_ref, o_ref.to(q.dtype), atol=1e-4)
        assert_states_close(pool[idx[n]], ht_ref[0])


def test_fused_recurrent_steps_agree_with_chunk_kda():
    """T tokens fed one decode step at a time give chunk_kda's outputs and final state."""
    B, T, H, HV, K, V = 2, 70, 2, 4, 128, 128
    q, k, v, g, beta = inputs(B, T, H, HV, K, V)
    h0 = torch.randn(B, HV, K, V, device="cuda") * 0.1
    o_chunk, ht_chunk = flare.chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    state = h0.clone()
    steps = [flare.fused_recurrent_kda(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], g[:, t:t + 1],
                                       beta[:, t:t + 1], initial_state=state, inplace_final_state=True)[0]
             for t in range(T)]
    o_steps = torch.cat(steps, dim=1)
    assert rel_err(o_steps, o_chunk) < 3e-2  # chunk_kda keeps its chunk matrices in bf16
    assert rel_err(state, ht_chunk) < 3e-2
    o_ref, ht_ref = ref.kda(q, k, v, g, beta, initial_state=h0)
    assert_close_to_ref(o_steps, o_ref, o_ref.to(q.dtype), atol=1e-4)
    assert_states_close(state, ht_ref, atol=2e-4)


def test_fused_recurrent_compile_and_graph():
    """The pool's in-place update survives torch.compile (the op's schema declares the mutation)
    and CUDA-graph capture."""
    q, k, v, g, beta = inputs(4, 1, 2, 2, 64, 64)
    pool = torch.randn(5, 2, 64, 64, device="cuda") * 0.1
    idx = torch.tensor([3, 1, -1, 0], device="cuda", dtype=torch.int32)

    def step(pool):
        return flare.fused_recurrent_kda(q, k, v, g, beta, initial_state=pool, ssm_state_indices=idx)[0]

    eager_pool, compiled_pool, graph_pool = pool.clone(), pool.clone(), pool.clone()
    o_eager = step(eager_pool)
    o_compiled = torch.compile(step, fullgraph=True)(compiled_pool)
    assert torch.equal(o_compiled, o_eager) and torch.equal(compiled_pool, eager_pool)

    step(graph_pool.clone())  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_graph = step(graph_pool)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(o_graph, o_eager) and torch.equal(graph_pool, eager_pool)


def test_fused_recurrent_errors():
    q, k, v, g, beta = inputs(2, 1, 1, 1, 64, 64)
    idx = torch.tensor([0, 1], device="cuda", dtype=torch.int32)
    with pytest.raises(ValueError, match="initial_state"):
        flare.fused_recurrent_kda(q, k, v, g, beta, ssm_state_indices=idx)
    with pytest.raises(ValueError, match="'initial_state'"):  # the pool's head count is wrong
        flare.fused_recurrent_kda(q, k, v, g, beta, initial_state=torch.zeros(3, 2, 64, 64, device="cuda"),
                                  ssm_state_indices=idx)
    with pytest.raises(ValueError, match="'ssm_state_indices'"):
        flare.fused_recurrent_kda(q, k, v, g, beta, initial_state=torch.zeros(3, 1, 64, 64, device="cuda"),
                                  ssm_state_indices=idx[:1])
    with pytest.raises(NotImplementedError, match="inplace_final_state"):
        flare.fused_recurrent_kda(q, k, v, g, beta, initial_state=torch.zeros(3, 1, 64, 64, device="cuda"),
                                  ssm_state_indices=idx, inplace_final_state=False)
    with pytest.raises(NotImplementedError, match="state_v_first"):
        flare.fused_recurrent_kda(q, k, v, g, beta, state_v_first=True)
    with pytest.raises(NotImplementedError, match="backward"):
        flare.fused_recurrent_kda(q.requires_grad_(), k, v, g, beta)
