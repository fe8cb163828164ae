"""flare from PyTorch: FlashAttention's Python API (flash_attn_func, flash_attn_varlen_func,
flash_attn_with_kvcache), merge_states, FlexAttention's flex_attention with a BlockMask (masks:
mask functions flare runs natively), and flash-linear-attention's chunk_kda /
chunk_gated_delta_rule and (decoding) fused_recurrent_kda / fused_recurrent_gated_delta_rule, on
flare's CUDA kernels. Every op is a torch.library custom op
(torch.ops.flare.*) with a fake implementation, so torch.compile traces through it, and the
attention forward has an autograd formula (flare's backward, optionally deterministic).

Build: tools/python-check (README.md, section "Python").
"""

from .flash_attn import flash_attn_func, flash_attn_varlen_func
from . import masks
from .flex import FlexMask, flex_attention, prepare_block_mask
from .kda import chunk_gated_delta_rule, chunk_kda, fused_recurrent_gated_delta_rule, fused_recurrent_kda
from .kvcache import (KVCacheDecoder, KVCachePlan, flash_attn_with_kvcache, load_decode_tuning_table, merge_states,
                      plan_kvcache)

__all__ = [
    "FlexMask",
    "KVCacheDecoder",
    "KVCachePlan",
    "chunk_gated_delta_rule",
    "chunk_kda",
    "flash_attn_func",
    "flash_attn_varlen_func",
    "flash_attn_with_kvcache",
    "fused_recurrent_gated_delta_rule",
    "fused_recurrent_kda",
    "flex_attention",
    "load_decode_tuning_table",
    "masks",
    "merge_states",
    "plan_kvcache",
    "prepare_block_mask",
]
