"""flash_attn_with_kvcache (contiguous and paged caches, appends, plans, CUDA graphs) and merge_states."""

import math

import pytest
import torch

import flare
import reference as ref
from conftest import assert_close_to_ref


def cache(batch, max_len, heads_kv, d, dtype=torch.bfloat16):
    return (torch.randn(batch, max_len, heads_kv, d, device="cuda", dtype=dtype),
            torch.randn(batch, max_len, heads_kv, d, device="cuda", dtype=dtype))


def paged(k_cache, v_cache, page_size):
    """The same cache as pages in a shuffled pool, and its block table."""
    batch, max_len, heads_kv, d = k_cache.shape
    pages_per_seq = max_len // page_size
    perm = torch.randperm(batch * pages_per_seq, device="cuda")
    table = perm.view(batch, pages_per_seq).to(torch.int32)
    k_pages = torch.empty(batch * pages_per_seq, page_size, heads_kv, d, device="cuda", dtype=k_cache.dtype)
    v_pages = torch.empty_like(k_pages)
    k_pages[perm] = k_cache.reshape(batch * pages_per_seq, page_size, heads_kv, d)
    v_pages[perm] = v_cache.reshape(batch * pages_per_seq, page_size, heads_kv, d)
    return k_pages, v_pages, table


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("q_len", [1, 4])
@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_decode(dtype, head_dim, q_len, layout):
    batch, heads, heads_kv, max_len = 3, 8, 2, 1024
    k_cache, v_cache = cache(batch, max_len, heads_kv, head_dim, dtype)
    q = torch.randn(batch, q_len, heads, head_dim, device="cuda", dtype=dtype)
    seqlens = torch.tensor([7, 1024, 333], device="cuda", dtype=torch.int32)
    kw = {}
    if layout == "paged":
        k_in, v_in, kw["block_table"] = paged(k_cache, v_cache, 64)
    else:
        k_in, v_in = k_cache, v_cache
    for num_splits in (0, 1, 4):
        out, lse = flare.flash_attn_with_kvcache(q, k_in, v_in, cache_seqlens=seqlens, causal=True,
                                                 num_splits=num_splits, return_softmax_lse=True, **kw)
        assert out.shape == q.shape and lse.shape == (batch, heads, q_len)
        assert_close_to_ref(out, ref.decode(q, k_cache, v_cache, seqlens),
                            ref.decode(q, k_cache, v_cache, seqlens, upcast=False), what=f"out splits={num_splits}")
        lse_ref = torch.cat([ref.lse(q[b:b + 1], k_cache[b:b + 1, :int(seqlens[b])], causal=True)
                             for b in range(batch)])
        torch.testing.assert_close(lse, lse_ref, atol=2e-3, rtol=1e-3)


def test_decode_window():
    k_cache, v_cache = cache(2, 2048, 4, 128)
    q = torch.randn(2, 2, 16, 128, device="cuda", dtype=torch.bfloat16)
    seqlens = torch.tensor([2048, 900], device="cuda", dtype=torch.int32)
    out = flare.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, causal=True,
                                       window_size=(255, 0))
    assert_close_to_ref(out, ref.decode(q, k_cache, v_cache, seqlens, window_left=255),
                        ref.decode(q, k_cache, v_cache, seqlens, window_left=255, upcast=False))


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_append_new_tokens(layout):
    """k/v given: written into the cache at cache_seqlens, then attended (FlashAttention's semantics)."""
    batch, heads, heads_kv, d, max_len = 2, 8, 8, 64, 512
    k_cache, v_cache = cache(batch, max_len, heads_kv, d)
    seqlens = torch.tensor([10, 300], device="cuda", dtype=torch.int32)
    q = torch.randn(batch, 2, heads, d, device="cuda", dtype=torch.bfloat16)
    k_new = torch.randn(batch, 2, heads_kv, d, device="cuda", dtype=torch.bfloat16)
    v_new = torch.randn_like(k_new)
    expect_k, expect_v = k_cache.clone(), v_cache.clone()
    for b in range(batch):
        n = int(seqlens[b])
        expect_k[b, n:n + 2], expect_v[b, n:n + 2] = k_new[b], v_new[b]
    if layout == "paged":
        k_in, v_in, table = paged(k_cache, v_cache, 32)
        out = flare.flash_attn_with_kvcache(q, k_in, v_in, k_new, v_new, cache_seqlens=seqlens, block_table=table,
                                           causal=True)
        got_k = k_in[table.long()].reshape(batch, max_len, heads_kv, d)
    else:
        out = flare.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens, causal=True)
        got_k = k_cache
    assert torch.equal(got_k, expect_k)
    total = seqlens + 2
    assert_close_to_ref(out, ref.decode(q, expect_k, expect_v, total),
                        ref.decode(q, expect_k, expect_v, total, upcast=False))


def test_plan_and_cuda_graph_replay():
    """Plan once, allocate the workspace once, capture one decode step, replay it with new lengths."""
    batch, heads, heads_kv, d, max_len = 4, 32, 8, 128, 4096
    k_cache, v_cache = cache(batch, max_len, heads_kv, d)
    k_pages, v_pages, table = paged(k_cache, v_cache, 64)
    q = torch.randn(batch, 1, heads, d, device="cuda", dtype=torch.bfloat16)
    plan = flare.plan_kvcache(q, k_pages, block_table=table, causal=True, num_splits=8)
    assert plan.kernel == "split_kv" and plan.num_splits == 8 and plan.workspace_bytes > 0
    auto = flare.plan_kvcache(q, k_pages, block_table=table, causal=True)
    assert auto.num_splits >= 1 and auto.source in ("tuning_table", "heuristic")
    workspace = plan.workspace(q.device)
    seqlens = torch.full((batch,), 100, device="cuda", dtype=torch.int32)

    def step():
        return flare.flash_attn_with_kvcache(q, k_pages, v_pages, cache_seqlens=seqlens, block_table=table,
                                             causal=True, num_splits=plan.num_splits, workspace=workspace)

    step()  # warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for lengths in ([100, 4096, 1, 2000], [4096, 4096, 4096, 4096], [64, 65, 3000, 129]):
        seqlens.copy_(torch.tensor(lengths, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        assert_close_to_ref(out, ref.decode(q, k_cache, v_cache, seqlens),
                            ref.decode(q, k_cache, v_cache, seqlens, upcast=False), what=f"replay {lengths}")


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
@pytest.mark.parametrize("num_splits", [0, 1, 8])
def test_decoder_matches_flash_attn_with_kvcache(layout, num_splits):
    """KVCacheDecoder.run gives what flash_attn_with_kvcache gives (same plan: bitwise), fills out=/lse=
    buffers in place, and follows new cache lengths and page tables from call to call."""
    batch, heads, heads_kv, d, max_len = 3, 32, 8, 128, 2048
    k_cache, v_cache = cache(batch, max_len, heads_kv, d)
    q = torch.randn(batch, 1, heads, d, device="cuda", dtype=torch.bfloat16)
    kw = {}
    if layout == "paged":
        k_in, v_in, kw["block_table"] = paged(k_cache, v_cache, 16)
    else:
        k_in, v_in = k_cache, v_cache
    table = kw.get("block_table")
    decoder = flare.KVCacheDecoder(q, k_in, v_in, causal=True, num_splits=num_splits, return_softmax_lse=True,
                                   **kw)
    assert decoder.plan.num_splits >= 1 and (num_splits == 0 or decoder.plan.num_splits == num_splits)
    out_buf = torch.full_like(q, float("nan"))
    lse_buf = torch.full((batch, heads, 1), float("nan"), device="cuda")
    for lengths in ([5, 2048, 700], [1, 17, 2047]):
        seqlens = torch.tensor(lengths, device="cuda", dtype=torch.int32)
        expect_out, expect_lse = flare.flash_attn_with_kvcache(q, k_in, v_in, cache_seqlens=seqlens, causal=True,
                                                               num_splits=decoder.plan.num_splits,
                                                               return_softmax_lse=True, **kw)
        out, lse = decoder.run(q, k_in, v_in, seqlens, table)
        assert torch.equal(out, expect_out) and torch.equal(lse, expect_lse)
        out2, lse2 = decoder.run(q, k_in, v_in, seqlens, table, out=out_buf, lse=lse_buf)
        assert out2.data_ptr() == out_buf.data_ptr() and lse2.data_ptr() == lse_buf.data_ptr()
        assert torch.equal(out_buf, expect_out) and torch.equal(lse_buf, expect_lse)
        assert_close_to_ref(out, ref.decode(q, k_cache, v_cache, seqlens),
                            ref.decode(q, k_cache, v_cache, seqlens, upcast=False), what=f"decoder {lengths}")


def test_decoder_cuda_graph_and_errors():
    batch, heads, heads_kv, d, max_len = 2, 8, 2, 64, 1024
    k_cache, v_cache = cache(batch, max_len, heads_kv, d)
    q = torch.randn(batch, 2, heads, d, device="cuda", dtype=torch.bfloat16)
    decoder = flare.KVCacheDecoder(q, k_cache, v_cache, causal=True, num_splits=4)
    seqlens = torch.full((batch,), 100, device="cuda", dtype=torch.int32)
    out = torch.empty_like(q)
    decoder.run(q, k_cache, v_cache, seqlens, out=out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decoder.run(q, k_cache, v_cache, seqlens, out=out)
    for lengths in ([1000, 2], [1024, 1024]):
        out.fill_(float("nan"))
        seqlens.copy_(torch.tensor(lengths, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        assert_close_to_ref(out, ref.decode(q, k_cache, v_cache, seqlens),
                            ref.decode(q, k_cache, v_cache, seqlens, upcast=False), what=f"replay {lengths}")
    # A step whose shapes differ from the plan's, a tensor elsewhere, a buffer of another shape or
    # dtype, a block table the contiguous plan does not take, an lse the decoder does not return.
    with pytest.raises(ValueError, match="'q'.*planned"):
        decoder.run(q[:, :1], k_cache, v_cache, seqlens)
    with pytest.raises(ValueError, match="'k_cache'.*planned"):
        decoder.run(q, k_cache[:, :512], v_cache, seqlens)
    with pytest.raises(ValueError, match="'v_cache'"):
        decoder.run(q, k_cache, v_cache.cpu(), seqlens)
    with pytest.raises(ValueError, match="'cache_seqlens'"):
        decoder.run(q, k_cache, v_cache, seqlens.cpu())
    with pytest.raises(ValueError, match="'out'"):
        decoder.run(q, k_cache, v_cache, seqlens, out=out[:1])
    with pytest.raises(TypeError, match="'out'"):
        decoder.run(q, k_cache, v_cache, seqlens, out=out.half())
    with pytest.raises(TypeError, match="'cache_seqlens'"):
        decoder.run(q, k_cache, v_cache, seqlens.long())
    with pytest.raises(ValueError, match="'block_table'"):
        decoder.run(q, k_cache, v_cache, seqlens, seqlens[:, None])
    with pytest.raises(ValueError, match="'lse'"):
        decoder.run(q, k_cache, v_cache, seqlens, lse=torch.empty(batch, heads, 2, device="cuda"))
    with pytest.raises(ValueError, match="'workspace'"):
        flare.KVCacheDecoder(q, k_cache, v_cache, num_splits=4, workspace=torch.empty(16, dtype=torch.uint8,
                                                                                        device="cuda"))
    with pytest.raises(ValueError, match="'q'"):
        flare.KVCacheDecoder(q[0], k_cache, v_cache)


def test_merge_states():
    rows, states, d = (3, 5), 4, 128
    partial_out = torch.randn(*rows, states, d, device="cuda")
    partial_lse = torch.randn(*rows, states, device="cuda") * 3
    partial_lse[0, 0, 1] = -math.inf
    partial_lse[1, 2, :] = -math.inf
    out, lse = flare.merge_states(partial_out, partial_lse, out_dtype=torch.bfloat16)
    lse_ref = torch.logsumexp(partial_lse, dim=-1)
    w = torch.nan_to_num(torch.exp(partial_lse - lse_ref[..., None]), nan=0.0)
    out_ref = (w[..., None] * partial_out).sum(-2)
    assert out.dtype == torch.bfloat16 and out.shape == (*rows, d) and lse.shape == rows
    torch.testing.assert_close(lse, lse_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.float(), out_ref, atol=2e-2, rtol=1e-2)
    assert lse[1, 2].item() == -math.inf and out[1, 2].abs().max().item() == 0


def test_merge_states_recovers_full_attention():
    """Two halves of the keys merged by LSE give attention over all of them."""
    q = torch.randn(1, 16, 4, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 512, 4, 64, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    outs, lses = zip(*(flare.flash_attn_func(q, k[:, s], v[:, s], return_lse=True)
                       for s in (slice(0, 200), slice(200, 512))))
    partial_out = torch.stack([o.float() for o in outs], dim=-2)          # [1, 16, 4, 2, 64]
    partial_lse = torch.stack([l.transpose(1, 2) for l in lses], dim=-1)  # [1, 16, 4, 2]
    out, _ = flare.merge_states(partial_out, partial_lse, out_dtype=torch.bfloat16)
    full = flare.flash_attn_func(q, k, v)
    torch.testing.assert_close(out, full, atol=2e-2, rtol=2e-2)
