"""Mask functions for flex_attention that flare's kernels know natively.

Each factory returns a FlexAttention mask_mod, mask_mod(b, h, q_idx, kv_idx) -> bool, usable with
torch's create_block_mask and flex_attention as any other, that also carries an ElementMask: the
same predicate in the form flare's block-sparse kernels evaluate inside partial blocks (causal,
windows, prefix-LM, document ids, a bit-packed mask). flare.flex_attention uses that form instead
of evaluating the Python function into a bit mask. Positions are absolute (top-left aligned), as in
FlexAttention.

    mask_mod = flare.masks.and_masks(flare.masks.causal(), flare.masks.document(doc_ids))
    block_mask = create_block_mask(mask_mod, None, None, S, S, device="cuda")
    out = flare.flex_attention(q, k, v, block_mask=block_mask)

Any other mask_mod works too: flare evaluates it on the partial blocks (flex.py).
"""

from dataclasses import dataclass, replace

import torch

# The attribute of a mask_mod that holds its ElementMask.
ATTRIBUTE = "flare_element_mask"


@dataclass(frozen=True, eq=False)
class ElementMask:
    """flare's element predicate (include/flare/mask.h, ElementMask): every enabled part must hold.

    causal: kv_idx <= q_idx. window_left / window_right: q_idx - kv_idx <= window_left,
    kv_idx - q_idx <= window_right (-1: off). prefix_length: kv_idx < prefix_length or
    kv_idx <= q_idx (-1: off). doc_ids_q / doc_ids_k: integer [seqlen] or [batch, seqlen], same
    document required (given together). bits: int32 words [B|1, H|1, seqlen_q, ceil(seqlen_k / 32)],
    bit kv_idx % 32 of word kv_idx // 32 set = visible (pack_bits makes them).
    """
    causal: bool = False
    window_left: int = -1
    window_right: int = -1
    prefix_length: int = -1
    doc_ids_q: torch.Tensor | None = None
    doc_ids_k: torch.Tensor | None = None
    bits: torch.Tensor | None = None


def element_mask_of(mask_mod):
    """The ElementMask a mask_mod carries, or None. Sees through torch's wrappers (a BlockMask that
    went through pytree flattening keeps the function's attributes)."""
    for fn in (mask_mod, getattr(mask_mod, "fn", None)):
        element = getattr(fn, ATTRIBUTE, None)
        if isinstance(element, ElementMask):
            return element
    return None


def _tagged(fn, element, name):
    setattr(fn, ATTRIBUTE, element)
    fn.__name__ = fn.__qualname__ = name
    return fn


def causal():
    """q_idx >= kv_idx."""
    def mask_mod(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx
    return _tagged(mask_mod, ElementMask(causal=True), "causal")


def sliding_window(window_left, window_right=0):
    """q_idx - window_left <= kv_idx <= q_idx + window_right (-1: unbounded on that side); the
    default right window 0 is the causal sliding window."""
    for name, w in (("window_left", window_left), ("window_right", window_right)):
        if isinstance(w, bool) or not isinstance(w, int) or w < -1:
            raise ValueError(f"argument '{name}': expected an int >= -1 (-1: unbounded), got {w!r}")

    def mask_mod(b, h, q_idx, kv_idx):
        ok = q_idx >= 0  # all true, shaped like the indices
        if window_left >= 0:
            ok = ok & (q_idx - kv_idx <= window_left)
        if window_right >= 0:
            ok = ok & (kv_idx - q_idx <= window_right)
        return ok
    return _tagged(mask_mod, ElementMask(window_left=window_left, window_right=window_right),
                   f"sliding_window_{window_left}_{window_right}")


def prefix_lm(prefix_length):
    """Bidirectional over the first prefix_length keys, causal after: kv_idx < prefix_length or
    kv_idx <= q_idx."""
    if isinstance(prefix_length, bool) or not isinstance(prefix_length, int) or prefix_length < 0:
        raise ValueError(f"argument 'prefix_length': expected an int >= 0, got {prefix_length!r}")

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx < prefix_length) | (kv_idx <= q_idx)
    return _tagged(mask_mod, ElementMask(prefix_length=prefix_length), f"prefix_lm_{prefix_length}")


def _doc_ids(name, ids):
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"argument '{name}': expected a torch.Tensor, got {type(ids).__name__}")
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise TypeError(f"argument '{name}': expected an integer dtype, got {ids.dtype}")
    if ids.dim() not in (1, 2):
        raise ValueError(f"argument '{name}': expected [seqlen] or [batch, seqlen], got shape {tuple(ids.shape)}")
    return ids


def document(doc_ids_q, doc_ids_k=None):
    """Same document: doc_ids_q[q_idx] == doc_ids_k[kv_idx] (ids [seqlen] shared by the batch, or
    [batch, seqlen]); doc_ids_k defaults to doc_ids_q (self-attention)."""
    doc_ids_q = _doc_ids("doc_ids_q", doc_ids_q)
    doc_ids_k = doc_ids_q if doc_ids_k is None else _doc_ids("doc_ids_k", doc_ids_k)
    if doc_ids_q.dim() != doc_ids_k.dim() or doc_ids_q.device != doc_ids_k.device:
        raise ValueError(f"argument 'doc_ids_k': {tuple(doc_ids_k.shape)} on {doc_ids_k.device} does not pair with "
                         f"doc_ids_q {tuple(doc_ids_q.shape)} on {doc_ids_q.device} (same rank and device)")
    if doc_ids_q.dim() == 1:
        def mask_mod(b, h, q_idx, kv_idx):
            return doc_ids_q[q_idx] == doc_ids_k[kv_idx]
    else:
        def mask_mod(b, h, q_idx, kv_idx):
            return doc_ids_q[b, q_idx] == doc_ids_k[b, kv_idx]
    return _tagged(mask_mod, ElementMask(doc_ids_q=doc_ids_q, doc_ids_k=doc_ids_k), "document")


def pack_bits(mask):
    """A bool mask [B|1, H|1, seqlen_q, seqlen_k] as flare's bit words: int32
    [B|1, H|1, seqlen_q, ceil(seqlen_k / 32)], bit kv_idx % 32 of word kv_idx // 32."""
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.dim() != 4:
        raise TypeError("argument 'mask': expected a bool tensor [B|1, H|1, seqlen_q, seqlen_k]")
    seqlen_k = mask.shape[-1]
    words = (seqlen_k + 31) // 32
    padded = torch.nn.functional.pad(mask, (0, words * 32 - seqlen_k)).view(*mask.shape[:-1], words, 32)
    weights = torch.ones(32, dtype=torch.int64, device=mask.device) << torch.arange(32, device=mask.device)
    packed = (padded.to(torch.int64) * weights).sum(-1)
    return _wrap_int32(packed)


def _wrap_int32(words):
    """int64 values in [0, 2^32) as the int32 with the same bits."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def from_dense(mask):
    """A mask_mod reading a bool tensor [B|1, H|1, seqlen_q, seqlen_k] (a dim of 1 serves every
    batch entry / head), flare-native as bit words."""
    bits = pack_bits(mask)
    last_b, last_h = mask.shape[0] - 1, mask.shape[1] - 1

    def mask_mod(b, h, q_idx, kv_idx):
        return mask[b.clamp(max=last_b), h.clamp(max=last_h), q_idx, kv_idx]
    return _tagged(mask_mod, ElementMask(bits=bits), "dense_mask")


def _combine(a, b):
    """The ElementMask of a AND b, or None where one ElementMask cannot say it."""
    def window(x, y):
        return x if y < 0 else (y if x < 0 else min(x, y))

    if (a.doc_ids_q is not None and b.doc_ids_q is not None and
            (a.doc_ids_q is not b.doc_ids_q or a.doc_ids_k is not b.doc_ids_k)):
        return None
    bits = a.bits if b.bits is None else b.bits
    if a.bits is not None and b.bits is not None:
        if a.bits.shape != b.bits.shape:
            return None
        bits = a.bits & b.bits
    # (kv < P1 or kv <= q) and (kv < P2 or kv <= q) is (kv < min(P1, P2) or kv <= q).
    prefix = window(a.prefix_length, b.prefix_length)
    return replace(a, causal=a.causal or b.causal, window_left=window(a.window_left, b.window_left),
                   window_right=window(a.window_right, b.window_right), prefix_length=prefix,
                   doc_ids_q=a.doc_ids_q if a.doc_ids_q is not None else b.doc_ids_q,
                   doc_ids_k=a.doc_ids_k if a.doc_ids_k is not None else b.doc_ids_k, bits=bits)


def and_masks(*mask_mods):
    """The AND of mask_mods (as torch's and_masks), flare-native when every part is and the parts
    combine into one ElementMask (else flex_attention evaluates the combined function)."""
    if not mask_mods or not all(callable(m) for m in mask_mods):
        raise TypeError("argument 'mask_mods': expected one or more mask_mod functions")

    def mask_mod(b, h, q_idx, kv_idx):
        ok = mask_mods[0](b, h, q_idx, kv_idx)
        for m in mask_mods[1:]:
            ok = ok & m(b, h, q_idx, kv_idx)
        return ok

    element = element_mask_of(mask_mods[0])
    for m in mask_mods[1:]:
        other = element_mask_of(m)
        element = None if element is None or other is None else _combine(element, other)
    if element is None:
        mask_mod.__name__ = mask_mod.__qualname__ = "and_masks"
        return mask_mod
    return _tagged(mask_mod, element, "_and_".join(getattr(m, "__name__", "mask") for m in mask_mods))
