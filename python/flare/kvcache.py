"""Decode against a KV cache (FlashAttention's flash_attn_with_kvcache) and merge_states.

The decode op plans on the host (which kernel, how many KV splits, how much workspace) and runs
without allocating anything of its own, so a decode step can be captured in a CUDA graph and
replayed with new cache_seqlens and block_table contents. For capture, plan once with
plan_kvcache(), allocate plan.workspace() once, and pass num_splits=plan.num_splits and
workspace=... to every call; without them each call plans for itself and takes its workspace from
torch's caching allocator (which is capturable too, from the graph's private pool).
"""

from dataclasses import dataclass
from pathlib import Path

import torch

from . import _C, _checks
from .ops import eager

_decode_op = torch.ops.flare.decode
_NO_WINDOW = (-1, -1)
_merge_states_op = torch.ops.flare.merge_states

# The measured split counts shipped with flare (bench_decode --tune on each GPU), by the name
# torch gives the device: a table is used only on the GPU it was measured on.
_DATA = Path(__file__).resolve().parents[2] / "data"
_TABLES = {"H200": _DATA / "decode_tuning_h200.txt", "H100": _DATA / "decode_tuning_h100.txt"}
_table_checked = False


def load_decode_tuning_table(path):
    """Plans decode split counts from a measured table (bench_decode --tune PATH); None clears it."""
    global _table_checked
    _C.load_decode_tuning_table("" if path is None else str(path))
    _table_checked = True


def _default_table(device):
    global _table_checked
    _table_checked = True
    name = torch.cuda.get_device_name(device)
    for gpu, table in _TABLES.items():
        if gpu in name and table.exists():
            _C.load_decode_tuning_table(str(table))
            return


@dataclass(frozen=True)
class KVCachePlan:
    """A decode plan: the kernel ('standard' or 'split_kv'), its KV split count and the workspace
    bytes it needs (0 for the standard kernel)."""
    kernel: str
    num_splits: int
    kv_chunk: int
    workspace_bytes: int
    source: str  # 'tuning_table', 'heuristic' or 'forced'

    def workspace(self, device="cuda"):
        """A workspace tensor for this plan (at least one 16-byte word, so it always has storage)."""
        return torch.empty(max(self.workspace_bytes, 16), dtype=torch.uint8, device=device)


def _decode_window(causal, window_size):
    if window_size == _NO_WINDOW:  # the common call, without the checks' function calls
        return bool(causal), -1
    left, right = _checks.window(window_size)
    if right == 0:  # (left, 0) is FlashAttention's causal sliding window
        causal = True
    elif right != -1 and not causal:
        raise NotImplementedError(f"argument 'window_size': a right window of {right} is not implemented for "
                                  f"decode (use -1, or 0 / causal=True)")
    return bool(causal), left


def plan_kvcache(q, k_cache, block_table=None, causal=False, window_size=(-1, -1), num_splits=0):
    """The plan flash_attn_with_kvcache would use for these shapes (tensors or torch.Size). The
    plan depends on shapes only: make it once, then pass num_splits=plan.num_splits and
    workspace=plan.workspace(device) to each call, which then allocates nothing (CUDA graphs)."""
    q_shape = q.shape if isinstance(q, torch.Tensor) else torch.Size(q)
    k_shape = k_cache.shape if isinstance(k_cache, torch.Tensor) else torch.Size(k_cache)
    dtype = q.dtype if isinstance(q, torch.Tensor) else torch.bfloat16
    device = q.device if isinstance(q, torch.Tensor) else torch.device("cuda", torch.cuda.current_device())
    if len(q_shape) != 4 or len(k_shape) != 4:
        raise ValueError(f"arguments 'q' and 'k_cache': expected rank 4, got {tuple(q_shape)} and {tuple(k_shape)}")
    _, window_left = _decode_window(causal, window_size)
    if block_table is not None:
        page_size = k_shape[1]
        max_cache_len = block_table.shape[1] * page_size
    else:
        page_size = 0
        max_cache_len = k_shape[1]
    if not _table_checked:
        _default_table(device)
    d = _C.decode_plan_info(q_shape[0], q_shape[2], k_shape[2], q_shape[3], q_shape[1], max_cache_len, page_size,
                            window_left, dtype == torch.bfloat16, _checks.integer("num_splits", num_splits),
                            device.index if device.index is not None else torch.cuda.current_device())
    return KVCachePlan(**d)


class KVCacheDecoder:
    """A decode step planned once and run many times: the eager fast path of a decode loop.

        decoder = flare.KVCacheDecoder(q, k_cache, v_cache, block_table=table, causal=True)
        for step in ...:
            out = decoder.run(q, k_cache, v_cache, cache_seqlens, table, out=out_buffer)

    The constructor takes the tensors of one step (or tensors of the same shapes, dtype and device),
    validates them, plans (as plan_kvcache) and keeps a workspace (the one given, or its own).
    run(q, k_cache, v_cache, cache_seqlens, block_table=None, *, out=None, lse=None) is the C++
    binding itself, with no Python in between: it checks that the tensors have the planned shapes
    and device (ValueError otherwise; dtypes, strides and alignment are checked by flare's C++
    validation on every call) and launches. It returns out, or (out, lse) when the decoder was made
    with return_softmax_lse=True; with out= (and lse=) buffers a step allocates nothing. The same
    arguments as flash_attn_with_kvcache, without appending new tokens (write k/v into the cache
    first). Eager only: torch.compile and autograd go through flash_attn_with_kvcache. Capturable
    in a CUDA graph. The plan is fixed at construction: a tuning table loaded later does not
    change it.
    """

    def __init__(self, q, k_cache, v_cache, block_table=None, softmax_scale=None, causal=False,
                 window_size=(-1, -1), num_splits=0, return_softmax_lse=False, workspace=None):
        _checks.tensor("q", q)
        _checks.tensor("k_cache", k_cache)
        _checks.tensor("v_cache", v_cache)
        _checks.optional_tensor("block_table", block_table)
        _checks.optional_tensor("workspace", workspace)
        causal, window_left = _decode_window(causal, window_size)
        num_splits = _checks.integer("num_splits", num_splits)
        if not _table_checked and num_splits == 0:
            _default_table(q.device)
        self._runner = _C.DecodeRunner(q, k_cache, v_cache, block_table, workspace,
                                       _checks.softmax_scale(softmax_scale), causal, window_left, num_splits,
                                       bool(return_softmax_lse))
        self.plan = KVCachePlan(**self._runner.plan_info())
        self.run = self._runner.run


def _append(k_cache, v_cache, k, v, cache_seqlens, block_table):
    """Writes the new tokens k/v [B, S_new, Hkv, D] into the cache at cache_seqlens."""
    b, s_new = k.shape[0], k.shape[1]
    pos = cache_seqlens.long()[:, None] + torch.arange(s_new, device=k.device)[None, :]
    if block_table is None:
        rows = torch.arange(b, device=k.device)[:, None].expand(b, s_new)
        k_cache[rows, pos] = k
        v_cache[rows, pos] = v
    else:
        page_size = k_cache.shape[1]
        page = torch.gather(block_table.long(), 1, pos // page_size)
        k_cache[page, pos % page_size] = k
        v_cache[page, pos % page_size] = v


def _reject_unsupported(rotary_cos, rotary_sin, cache_batch_idx, cache_leftpad, alibi_slopes, softcap):
    _checks.unsupported("rotary_cos", rotary_cos, None, "rotary embedding in the decode op is not implemented")
    _checks.unsupported("rotary_sin", rotary_sin, None, "rotary embedding in the decode op is not implemented")
    _checks.unsupported("cache_batch_idx", cache_batch_idx, None, "cache_batch_idx is not implemented")
    _checks.unsupported("cache_leftpad", cache_leftpad, None, "cache_leftpad is not implemented")
    _checks.unsupported("alibi_slopes", alibi_slopes, None, "ALiBi is not implemented in flare")
    if _checks.number("softcap", softcap) != 0.0:
        raise NotImplementedError("argument 'softcap': soft-capping in the decode op is not implemented; pass 0.0")


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False,
                            *, workspace=None):
    """Decode: q [B, q_len (1-8), H, D] against a cache k_cache/v_cache [B, max_len, Hkv, D], or a paged
    cache [num_pages, page_size, Hkv, D] with block_table int32 [B, max_pages] (page_size a power of
    two >= 16). cache_seqlens (int32 [B] or an int) counts the tokens already in the cache; with
    k/v [B, S_new, Hkv, D] those are written in first (in place) and attended too, as in
    FlashAttention. The q_len queries are the last tokens of each sequence (bottom-right aligned).

    num_splits: 0 lets flare plan (a measured table on H100s, else a heuristic), N > 0 forces N KV
    splits (1: no split). workspace: a uint8 buffer of at least plan_kvcache(...).workspace_bytes.
    Returns out [B, q_len, H, D], and with return_softmax_lse=True (out, lse [B, H, q_len]).
    """
    _checks.tensor("q", q)
    _checks.tensor("k_cache", k_cache)
    _checks.tensor("v_cache", v_cache)
    if block_table is not None:
        _checks.tensor("block_table", block_table)
    if workspace is not None:
        _checks.tensor("workspace", workspace)
    if (rotary_cos is not None or rotary_sin is not None or cache_batch_idx is not None or cache_leftpad is not None
            or alibi_slopes is not None or softcap != 0.0):
        _reject_unsupported(rotary_cos, rotary_sin, cache_batch_idx, cache_leftpad, alibi_slopes, softcap)
    causal, window_left = _decode_window(causal, window_size)
    if cache_seqlens is None:
        if block_table is not None:
            raise ValueError("argument 'cache_seqlens': required with a paged cache (block_table)")
        cache_seqlens = k_cache.shape[1] - (0 if k is None else k.shape[1])
    if isinstance(cache_seqlens, int):
        cache_seqlens = torch.full((q.shape[0],), cache_seqlens, dtype=torch.int32, device=q.device)
    _checks.tensor("cache_seqlens", cache_seqlens)
    if (k is None) != (v is None):
        raise ValueError(f"argument '{'v' if k is not None else 'k'}': k and v must be given together")
    if k is not None:
        _checks.tensor("k", k)
        _checks.tensor("v", v)
        _append(k_cache, v_cache, k, v, cache_seqlens, block_table)
        cache_seqlens = cache_seqlens + k.shape[1]
    if not _table_checked and num_splits == 0:
        _default_table(q.device)
    run = _C.decode if eager(q) else _decode_op
    out, lse = run(q, k_cache, v_cache, cache_seqlens, block_table, workspace, _checks.softmax_scale(softmax_scale),
                   causal, window_left, _checks.integer("num_splits", num_splits), bool(return_softmax_lse))
    return (out, lse) if return_softmax_lse else out


def merge_states(partial_out, partial_lse, out_dtype=None):
    """Merges partial attention states by their log-sum-exp (split-KV, ring attention, cascades).

    partial_out fp32 [rows..., num_states, dim], partial_lse fp32 [rows..., num_states] (at most 3
    row dims). Returns (out [rows..., dim] in out_dtype (default fp32), lse fp32 [rows...]). A state
    with LSE -inf contributes nothing; a row of only -inf states gets out 0, lse -inf.
    """
    _checks.tensor("partial_out", partial_out)
    _checks.tensor("partial_lse", partial_lse)
    if out_dtype is not None and not isinstance(out_dtype, torch.dtype):
        raise TypeError(f"argument 'out_dtype': expected a torch.dtype, got {type(out_dtype).__name__}")
    run = _C.merge_states if eager(partial_out) else _merge_states_op
    return run(partial_out, partial_lse, out_dtype)
