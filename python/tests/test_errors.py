"""Bad inputs raise ValueError / TypeError / NotImplementedError naming the argument, never crash."""

import pytest
import torch

import flare


def qkv(dtype=torch.bfloat16, d=64, device="cuda"):
    return tuple(torch.randn(2, 16, 4, d, device=device, dtype=dtype) for _ in range(3))


def test_wrong_dtype_is_type_error():
    q, k, v = qkv(torch.float32)
    with pytest.raises(TypeError, match="'q'"):
        flare.flash_attn_func(q, k, v)
    q, k, v = qkv()
    with pytest.raises(TypeError, match="'k'"):
        flare.flash_attn_func(q, k.half(), v)


def test_not_a_tensor_is_type_error():
    q, k, v = qkv()
    with pytest.raises(TypeError, match="'v'"):
        flare.flash_attn_func(q, k, [1, 2])
    with pytest.raises(TypeError, match="'window_size'"):
        flare.flash_attn_func(q, k, v, window_size=5)


def test_cpu_tensor_is_value_error():
    q, k, v = qkv(device="cpu")
    with pytest.raises(ValueError, match="'q'.*CUDA"):
        flare.flash_attn_func(q, k, v)
    q, k, v = qkv()
    with pytest.raises(ValueError, match="'k'"):
        flare.flash_attn_func(q, k.cpu(), v)


def test_shapes_and_values_are_value_errors():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="'q'"):
        flare.flash_attn_func(q[0], k[0], v[0])                         # rank 3 without cu_seqlens
    with pytest.raises(ValueError, match="'k'"):
        flare.flash_attn_func(q, k[:, :, :3], v[:, :, :3])              # 3 kv heads do not divide 4
    with pytest.raises(ValueError, match="'v'"):
        flare.flash_attn_func(q, k, v[:, :8])
    with pytest.raises(ValueError, match="'q'"):
        flare.flash_attn_func(*qkv(d=300))                              # head dim above 256
    with pytest.raises(ValueError, match="'softmax_scale'"):
        flare.flash_attn_func(q, k, v, softmax_scale=-1.0)
    with pytest.raises(ValueError, match="'softcap'"):
        flare.flash_attn_func(q, k, v, softcap=float("nan"))
    with pytest.raises(ValueError, match="'window_size'"):
        flare.flash_attn_func(q, k, v, window_size=(-5, 0))


def test_varlen_errors():
    q, k, v = (t.reshape(-1, 4, 64) for t in qkv())
    cu = torch.tensor([0, 16, 32], device="cuda", dtype=torch.int32)
    with pytest.raises(TypeError, match="'cu_seqlens_q'"):
        flare.flash_attn_varlen_func(q, k, v, cu.long(), cu, 16, 16)
    with pytest.raises(ValueError, match="'max_seqlen_q'"):
        flare.flash_attn_varlen_func(q, k, v, cu, cu, 0, 16)
    with pytest.raises(TypeError, match="'max_seqlen_k'"):
        flare.flash_attn_varlen_func(q, k, v, cu, cu, 16, 16.5)


def test_unsupported_options_are_not_implemented():
    q, k, v = qkv()
    with pytest.raises(NotImplementedError, match="'dropout_p'"):
        flare.flash_attn_func(q, k, v, dropout_p=0.1)
    with pytest.raises(NotImplementedError, match="'alibi_slopes'"):
        flare.flash_attn_func(q, k, v, alibi_slopes=torch.ones(4, device="cuda"))
    with pytest.raises(NotImplementedError, match="'softcap'"):
        flare.flash_attn_with_kvcache(q[:, :1], k, v, cache_seqlens=16, softcap=10.0)


def test_decode_errors():
    k_cache = torch.randn(2, 256, 2, 64, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(2, 1, 4, 64, device="cuda", dtype=torch.bfloat16)
    seqlens = torch.tensor([3, 4], device="cuda", dtype=torch.int32)
    with pytest.raises(TypeError, match="'cache_seqlens'"):
        flare.flash_attn_with_kvcache(q, k_cache, k_cache, cache_seqlens=seqlens.long())
    with pytest.raises(ValueError, match="'q'"):
        flare.flash_attn_with_kvcache(torch.randn(2, 9, 4, 64, device="cuda", dtype=torch.bfloat16), k_cache,
                                      k_cache, cache_seqlens=seqlens)  # q_len above 8
    with pytest.raises(ValueError, match="'workspace'"):
        flare.flash_attn_with_kvcache(q, k_cache, k_cache, cache_seqlens=seqlens, num_splits=4,
                                      workspace=torch.empty(16, dtype=torch.uint8, device="cuda"))
    with pytest.raises(ValueError, match="'cache_seqlens'"):
        flare.flash_attn_with_kvcache(q, k_cache[:1].expand(2, -1, -1, -1), k_cache, block_table=seqlens[:, None],
                                      cache_seqlens=None)


def test_merge_states_errors():
    with pytest.raises(TypeError, match="'partial_out'"):
        flare.merge_states(torch.randn(3, 2, 64, device="cuda").half(), torch.randn(3, 2, device="cuda"))
    with pytest.raises(ValueError, match="'partial_lse'"):
        flare.merge_states(torch.randn(3, 2, 64, device="cuda"), torch.randn(3, 3, device="cuda"))


def test_kda_errors():
    q = torch.randn(1, 32, 2, 64, device="cuda", dtype=torch.bfloat16)
    g = -torch.rand(1, 32, 2, 64, device="cuda")
    beta = torch.rand(1, 32, 2, device="cuda")
    with pytest.raises(ValueError, match="'v'"):
        flare.chunk_kda(q, q, q[:, :16], g, beta)
    with pytest.raises(ValueError, match="'scale'"):
        flare.chunk_kda(q, q, q, g, beta, scale=-1.0)
