"""FlexAttention's calling convention (torch.nn.attention.flex_attention) on flare's kernels.

    out = flare.flex_attention(query, key, value, block_mask=block_mask)   # [B, H, S, D]

takes a torch BlockMask as it is (create_block_mask, BlockMask.from_kv_blocks) and runs flare's
block-sparse forward and backward over its lists; block_mask=None is dense attention (flare's
dense kernels, the Hopper ones on sm_90). What flare does with a BlockMask:

- The lists. kv_num_blocks / kv_indices (partial blocks), full_kv_num_blocks / full_kv_indices
  (full blocks) and the transposed q_* lists the backward walks are flare::BlockMask's lists
  (include/flare/mask.h) as they are: int32 [B|1, H|1, rows(, cols)], a batch or head dim of 1
  broadcast, BLOCK_SIZE its block sizes (multiples of 16). Rows or columns past the sequence are
  sliced off (a view); missing transposed lists are built from the forward ones.
- The element mask of partial blocks. A mask_mod from flare.masks carries flare's own predicate
  (causal, windows, prefix-LM, document ids, bit words), which the kernels evaluate. torch's
  noop_mask needs none. Any other mask_mod is evaluated (torch.vmap, on the mask's device) on the
  partial blocks only and packed into flare's bit words [B|1, H|1, seqlen_q, ceil(seqlen_k / 32)].
- Caching. The converted form is kept on the BlockMask object (attribute _flare_flex) with a stamp
  of the tensors' versions and the mask_mod, so repeated calls (every layer, every step) reuse it
  and an in-place change of the lists rebuilds it. prepare_block_mask() builds it ahead of time
  (before torch.compile or CUDA-graph capture, since the evaluation syncs with the host).

- deterministic=True with a block mask: flare's deterministic block-sparse backward, which follows a
  plan made on the host from the mask's lists (make_block_sparse_dq_plan: the q blocks each kv
  block visits, the turn of every dQ add, the grid's order). The plan is made on first use for a
  shape (a copy of the lists to the host: it syncs) and kept with the converted mask.

Not supported: score_mod (NotImplementedError), max_scores, different batch sizes of query and key,
a value head dim different from the query's, gradients through the returned LSE.
"""

import math
from dataclasses import dataclass, field

import torch
from torch.nn.attention.flex_attention import BlockMask, noop_mask

from . import _C, _checks
from .masks import ElementMask, element_mask_of
from .ops import eager, eager_autograd

_flex_fwd_op = torch.ops.flare.flex_fwd

# Mask-mod evaluation works on this many (q, kv) elements at a time (the int64 temporaries of one
# chunk take 8 bytes each).
_EVAL_CHUNK_ELEMENTS = 1 << 22
_BLOCK_SIZE_GRANULARITY = 16  # flare's block sizes: multiples of the MMA tile edge
_CACHE_ATTRIBUTE = "_flare_flex"
_LIST_FIELDS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks", "q_indices",
                "full_q_num_blocks", "full_q_indices")


@dataclass(frozen=True, eq=False)
class FlexMask:
    """A BlockMask as flare's ops take it (the op schema's mask arguments, in order)."""
    lists: tuple            # the eight lists of _LIST_FIELDS (None where absent)
    q_block_size: int
    kv_block_size: int
    element: ElementMask    # doc ids int32 [B|1, S], bits int32 words
    batch: int              # the lists' batch and head dims (1: broadcast)
    heads: int
    seq_lengths: tuple
    # The deterministic backward's plans by (batch, heads, heads_kv, seqlen_q, seqlen_k): (data on
    # the device, meta).
    dq_plans: dict = field(default_factory=dict, repr=False)

    def dq_plan(self, query, key):
        """The deterministic backward's plan for these shapes (made once: the lists go to the host)."""
        shape = (query.shape[0], query.shape[1], key.shape[1], query.shape[2], key.shape[2])
        plan = self.dq_plans.get(shape)
        if plan is None:
            lists = [None if t is None else t.contiguous().cpu() for t in self.lists[:4]]
            data, meta = _C.block_sparse_dq_plan(*lists, self.q_block_size, self.kv_block_size, *shape)
            plan = self.dq_plans[shape] = (data.to(query.device), list(meta))
        return plan

    def op_args(self, batch, dq_plan=(None, [])):
        """The op's mask arguments for a batch of `batch` (1-row doc ids are expanded, a view)."""
        e = self.element
        doc_q, doc_k = e.doc_ids_q, e.doc_ids_k
        if doc_q is not None:
            doc_q, doc_k = doc_q.expand(batch, -1), doc_k.expand(batch, -1)
        return (*self.lists, self.q_block_size, self.kv_block_size, e.causal, e.window_left, e.window_right,
                e.prefix_length, doc_q, doc_k, e.bits, *dq_plan)


# The op arguments of "no mask": dense attention.
_NO_MASK = (None,) * 8 + (128, 128, False, -1, -1, -1, None, None, None, None, [])


# ---- BlockMask -> FlexMask ----------------------------------------------------------------------

def _block_sizes(block_mask):
    size = block_mask.BLOCK_SIZE
    sizes = (size, size) if isinstance(size, int) else tuple(size)
    if (len(sizes) != 2 or any(isinstance(s, bool) or not isinstance(s, int) or s <= 0 or
                               s % _BLOCK_SIZE_GRANULARITY for s in sizes)):
        raise ValueError(f"argument 'block_mask.BLOCK_SIZE': flare needs positive multiples of "
                         f"{_BLOCK_SIZE_GRANULARITY} (the MMA tile edge), got {size!r}")
    return sizes


def _list(block_mask, field, rank, rows, cols):
    """A BlockMask list checked and trimmed to [B|1, H|1, rows(, cols)], last dim contiguous."""
    t = getattr(block_mask, field)
    if t is None:
        return None
    name = f"block_mask.{field}"
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"argument '{name}': expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise TypeError(f"argument '{name}': expected dtype torch.int32, got {t.dtype}")
    if t.dim() != rank:
        raise ValueError(f"argument '{name}': expected rank {rank}, got shape {tuple(t.shape)}")
    want = (rows, cols)[:rank - 2]
    if any(have < need for have, need in zip(t.shape[2:], want)):
        raise ValueError(f"argument '{name}': shape {tuple(t.shape)} has fewer than the {want} blocks of "
                         f"BLOCK_SIZE {tuple(block_mask.BLOCK_SIZE)} over seq_lengths {tuple(block_mask.seq_lengths)}")
    t = t[:, :, :rows] if rank == 3 else t[:, :, :rows, :cols]
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def _transposed(counts, indices, num_cols):
    """Per column block, the row blocks that list it (ascending), from per-row lists."""
    slots = indices.shape[-1]
    listed = torch.arange(slots, device=counts.device) < counts[..., None]
    # Slots past the count hold anything: they add 0 at a valid place.
    columns = torch.where(listed, indices.long(), 0).clamp(0, num_cols - 1)
    dense = torch.zeros(*indices.shape[:-1], num_cols, dtype=torch.int32, device=counts.device)
    dense.scatter_add_(-1, columns, listed.to(torch.int32))
    seen = dense.transpose(-1, -2) > 0
    order = torch.argsort((~seen).to(torch.uint8), dim=-1, stable=True)
    return seen.sum(-1, dtype=torch.int32), order.to(torch.int32).contiguous()


def _vmap_mask_mod(mask_mod):
    """mask_mod over blocks: b, h [P]; q_idx [P, QB]; kv_idx [P, KB] -> [P, QB, KB] (as torch's
    create_mask evaluates it, one scalar index of each kind per call)."""
    fn = torch.vmap(mask_mod, in_dims=(None, None, None, 0))
    fn = torch.vmap(fn, in_dims=(None, None, 0, None))
    return torch.vmap(fn, in_dims=(0, 0, 0, 0))


def _evaluate_bits(mask_mod, counts, indices, seqlen_q, seqlen_k, q_block, kv_block):
    """mask_mod on the partial blocks the lists name, as bit words int32 [B|1, H|1, seqlen_q,
    ceil(seqlen_k / 32)] (bits outside partial blocks 0: the kernels read only partial blocks).
    Elements past the sequence are not evaluated (their indices are clamped) and stay 0."""
    device = counts.device
    batch, heads = counts.shape[0], counts.shape[1]
    words = (seqlen_k + 31) // 32
    slots = torch.arange(indices.shape[-1], device=device)
    b, h, m, slot = torch.nonzero(slots < counts[..., None], as_tuple=True)
    # Device lists are not validated: an index out of range is clamped rather than read out of bounds.
    n = indices[b, h, m, slot].long().clamp(0, -(-seqlen_k // kv_block) - 1)
    packed = torch.zeros(batch * heads * seqlen_q * words, dtype=torch.int64, device=device)
    evaluate = _vmap_mask_mod(mask_mod)
    q_offsets = torch.arange(q_block, device=device)
    kv_offsets = torch.arange(kv_block, device=device)
    # kv_block and every block start are multiples of 16, so each run of 16 keys lies in one word.
    groups = kv_block // 16
    per_chunk = max(1, _EVAL_CHUNK_ELEMENTS // (q_block * kv_block))
    for start in range(0, b.numel(), per_chunk):
        cb, ch, cm, cn = (x[start:start + per_chunk] for x in (b, h, m, n))
        q_idx = cm[:, None] * q_block + q_offsets            # [P, QB]
        kv_idx = cn[:, None] * kv_block + kv_offsets         # [P, KB]
        q_eval, kv_eval = q_idx.clamp(max=seqlen_q - 1), kv_idx.clamp(max=seqlen_k - 1)
        visible = evaluate(cb, ch, q_eval, kv_eval).to(torch.bool)
        visible = visible & (q_idx < seqlen_q)[:, :, None] & (kv_idx < seqlen_k)[:, None, :]
        p = visible.shape[0]
        shifted = visible.to(torch.int64) << (kv_idx % 32)[:, None, :]
        values = shifted.view(p, q_block, groups, 16).sum(-1)                           # [P, QB, G]
        word = (kv_idx.view(p, groups, 16)[:, :, 0] // 32).clamp(max=words - 1)        # [P, G]
        row = ((cb * heads + ch)[:, None] * seqlen_q + q_eval) * words                  # [P, QB]
        packed.index_add_(0, (row[:, :, None] + word[:, None, :]).flatten(), values.flatten())
    packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    return packed.view(batch, heads, seqlen_q, words)


def _doc_ids(name, ids, seqlen, device):
    if ids.shape[-1] != seqlen:
        raise ValueError(f"argument 'element_mask.{name}': {tuple(ids.shape)} does not cover the block mask's "
                         f"{seqlen} positions")
    ids = ids.to(device=device, dtype=torch.int32)
    return (ids[None] if ids.dim() == 1 else ids).contiguous()


def _element(element, block_mask, kv_lists, device):
    """The ElementMask of the partial blocks: flare's own, none for noop_mask, else mask_mod's bits."""
    seqlen_q, seqlen_k = block_mask.seq_lengths
    if element is None:
        mask_mod = block_mask.mask_mod
        if _is_noop(mask_mod):
            return ElementMask()
        if not callable(mask_mod):
            raise TypeError(f"argument 'block_mask.mask_mod': expected a function, got {type(mask_mod).__name__}")
        try:
            bits = _evaluate_bits(mask_mod, *kv_lists, seqlen_q, seqlen_k, *_block_sizes(block_mask))
        except RuntimeError as e:
            raise ValueError(f"argument 'block_mask.mask_mod': evaluating it on the partial blocks failed ({e}); "
                             f"flare evaluates mask_mod(b, h, q_idx, kv_idx) under torch.vmap as "
                             f"create_block_mask does") from e
        return ElementMask(bits=bits)
    doc_q, doc_k, bits = element.doc_ids_q, element.doc_ids_k, element.bits
    if doc_q is not None:
        doc_q = _doc_ids("doc_ids_q", doc_q, seqlen_q, device)
        doc_k = _doc_ids("doc_ids_k", doc_k, seqlen_k, device)
    if bits is not None:
        if not isinstance(bits, torch.Tensor) or bits.dtype != torch.int32:
            raise TypeError("argument 'element_mask.bits': expected an int32 tensor (flare.masks.pack_bits)")
        bits = bits.to(device)
        if bits.stride(-1) != 1:
            bits = bits.contiguous()
    return ElementMask(causal=bool(element.causal), window_left=int(element.window_left),
                       window_right=int(element.window_right), prefix_length=int(element.prefix_length),
                       doc_ids_q=doc_q, doc_ids_k=doc_k, bits=bits)


def _convert(block_mask, element):
    q_block, kv_block = _block_sizes(block_mask)
    seqlen_q, seqlen_k = (int(s) for s in block_mask.seq_lengths)
    rows, cols = -(-seqlen_q // q_block), -(-seqlen_k // kv_block)
    kv = (_list(block_mask, "kv_num_blocks", 3, rows, cols), _list(block_mask, "kv_indices", 4, rows, cols))
    full_kv = (_list(block_mask, "full_kv_num_blocks", 3, rows, cols),
               _list(block_mask, "full_kv_indices", 4, rows, cols))
    q = (_list(block_mask, "q_num_blocks", 3, cols, rows), _list(block_mask, "q_indices", 4, cols, rows))
    full_q = (_list(block_mask, "full_q_num_blocks", 3, cols, rows),
              _list(block_mask, "full_q_indices", 4, cols, rows))
    if (full_kv[0] is None) != (full_kv[1] is None):
        raise ValueError("argument 'block_mask.full_kv_indices': full_kv_num_blocks and full_kv_indices go together")
    device = kv[0].device
    for name, t in zip(_LIST_FIELDS, kv + full_kv + q + full_q):
        if t is not None and (t.device != device or t.shape[:2] != kv[0].shape[:2]):
            raise ValueError(f"argument 'block_mask.{name}': {tuple(t.shape)} on {t.device} does not match "
                             f"kv_num_blocks' batch and head dims {tuple(kv[0].shape[:2])} on {device}")
    # The backward walks the transposed lists; a mask made without them gets them here.
    if q[0] is None or q[1] is None or (full_kv[0] is not None and (full_q[0] is None or full_q[1] is None)):
        q = _transposed(*kv, cols)
        full_q = _transposed(*full_kv, cols) if full_kv[0] is not None else (None, None)
    return FlexMask(lists=kv + full_kv + q + full_q, q_block_size=q_block, kv_block_size=kv_block,
                    element=_element(element, block_mask, kv, device), batch=kv[0].shape[0],
                    heads=kv[0].shape[1], seq_lengths=(seqlen_q, seqlen_k))


def _version(t):
    try:
        return t._version
    except RuntimeError:  # an inference tensor has no version counter (and cannot change in place outside
        return -1         # inference mode)


def _stamp(block_mask):
    """What the cached form depends on: the lists (by identity and in-place version), mask_mod,
    BLOCK_SIZE and seq_lengths."""
    lists = tuple(None if t is None else (id(t), _version(t))
                  for t in (getattr(block_mask, f) for f in _LIST_FIELDS))
    return lists, id(block_mask.mask_mod), block_mask.BLOCK_SIZE, block_mask.seq_lengths


def _is_noop(mask_mod):
    return mask_mod is noop_mask or getattr(mask_mod, "fn", None) is noop_mask


def _prepare(block_mask):
    cached = getattr(block_mask, _CACHE_ATTRIBUTE, None)
    stamp = _stamp(block_mask)
    if cached is not None and cached[0] == stamp:
        return cached[1]
    flex_mask = _convert(block_mask, element_mask_of(block_mask.mask_mod))
    setattr(block_mask, _CACHE_ATTRIBUTE, (stamp, flex_mask))
    return flex_mask


_prepare_outside_graph = torch.compiler.disable(
    _prepare, reason="flare evaluates a BlockMask's mask_mod eagerly (data-dependent): call "
                     "flare.prepare_block_mask(block_mask) before the compiled code, or use a mask from flare.masks")


def prepare_block_mask(block_mask):
    """flare's form of a BlockMask (FlexMask), built once and kept on the BlockMask. Call it ahead of
    torch.compile(fullgraph=True) or CUDA-graph capture where the mask_mod is not one of flare.masks:
    evaluating an arbitrary mask_mod is data-dependent and synchronizes with the host."""
    if not isinstance(block_mask, BlockMask):
        raise TypeError(f"argument 'block_mask': expected a torch.nn.attention.flex_attention.BlockMask, got "
                        f"{type(block_mask).__name__}")
    if not torch.compiler.is_compiling():
        return _prepare(block_mask)
    # Traced code trusts a form prepared in eager mode (versions are not traceable). A flare-native
    # mask converts in the graph; evaluating any other mask_mod breaks the graph (runs eagerly).
    cached = getattr(block_mask, _CACHE_ATTRIBUTE, None)
    if cached is not None:
        return cached[1]
    element = element_mask_of(block_mask.mask_mod)
    if element is None and not _is_noop(block_mask.mask_mod):
        return _prepare_outside_graph(block_mask)
    return _convert(block_mask, element)


# ---- flex_attention -----------------------------------------------------------------------------

def _check_inputs(query, key, value, enable_gqa):
    for name, t in (("query", query), ("key", key), ("value", value)):
        _checks.tensor(name, t)
        if t.dim() != 4:
            raise ValueError(f"argument '{name}': expected rank 4 [batch, heads, seqlen, head_dim], got shape "
                             f"{tuple(t.shape)}")
    heads, heads_kv = query.shape[1], key.shape[1]
    if heads != heads_kv and not enable_gqa:
        raise ValueError(f"argument 'enable_gqa': query has {heads} heads and key {heads_kv}; pass enable_gqa=True "
                         f"for grouped-query attention")
    if query.shape[0] != key.shape[0]:
        raise ValueError(f"argument 'key': batch {key.shape[0]} differs from query's {query.shape[0]} (flare needs "
                         f"the same batch)")


def _check_mask_fits(flex_mask, query, key):
    batch, heads, seqlen_q = query.shape[0], query.shape[1], query.shape[2]
    seqlen_k = key.shape[2]
    if flex_mask.seq_lengths != (seqlen_q, seqlen_k):
        raise ValueError(f"argument 'block_mask': made for seq_lengths {flex_mask.seq_lengths}, but query and key "
                         f"have {(seqlen_q, seqlen_k)} (make one for these lengths, or BlockMask._adjust)")
    if flex_mask.batch not in (1, batch) or flex_mask.heads not in (1, heads):
        raise ValueError(f"argument 'block_mask': batch and head dims {(flex_mask.batch, flex_mask.heads)} must each "
                         f"be 1 or query's {(batch, heads)}")
    if flex_mask.element.doc_ids_q is not None and flex_mask.element.doc_ids_q.shape[0] not in (1, batch):
        raise ValueError(f"argument 'element_mask.doc_ids_q': {flex_mask.element.doc_ids_q.shape[0]} rows, query's "
                         f"batch is {batch}")
    if flex_mask.lists[0].device != query.device:
        raise ValueError(f"argument 'block_mask': on {flex_mask.lists[0].device}, query on {query.device}")


def _aux_request(return_lse, return_aux):
    if return_aux is None:
        return bool(return_lse)
    if return_lse:
        raise ValueError("argument 'return_aux': pass return_lse or return_aux=AuxRequest(lse=True), not both")
    if getattr(return_aux, "max_scores", False):
        raise NotImplementedError("argument 'return_aux': flare's flex_attention returns no max_scores; "
                                  "ask for AuxRequest(lse=True)")
    return bool(getattr(return_aux, "lse", False))


def flex_attention(query, key, value, score_mod=None, block_mask=None, scale=None, enable_gqa=False,
                   return_lse=False, kernel_options=None, *, return_aux=None, deterministic=False):
    """torch.nn.attention.flex_attention on flare's kernels: query [B, H, Sq, D], key/value
    [B, Hkv, Sk, D] (Hkv divides H with enable_gqa=True), fp16 or bf16, D up to 256 (a multiple of 8).

    block_mask: a torch BlockMask (or None: every key visible). score_mod must be None.
    kernel_options (Triton tuning for torch's kernel) is accepted and ignored. Returns out
    [B, H, Sq, D]; with return_lse=True (out, lse fp32 [B, H, Sq], natural log, -inf where a row sees
    no key), with return_aux=AuxRequest(lse=True) (out, AuxOutput). Differentiable in query, key,
    value. deterministic=True: a bitwise reproducible backward (with a block mask: its plan, made on
    first use for these shapes).
    """
    if score_mod is not None:
        hint = " (a BlockMask goes in block_mask=)" if isinstance(score_mod, BlockMask) else ""
        raise NotImplementedError(f"argument 'score_mod': flare's flex_attention has no score_mod, only masks "
                                  f"(block_mask and its mask_mod); pass None{hint}")
    if kernel_options is not None and not isinstance(kernel_options, dict):
        raise TypeError(f"argument 'kernel_options': expected a dict or None, got {type(kernel_options).__name__}")
    want_lse = _aux_request(return_lse, return_aux)
    _check_inputs(query, key, value, enable_gqa)
    scale = 0.0 if scale is None else _checks.number("scale", scale)
    if block_mask is None:
        mask_args = _NO_MASK
    else:
        flex_mask = prepare_block_mask(block_mask)
        _check_mask_fits(flex_mask, query, key)
        dq_plan = flex_mask.dq_plan(query, key) if deterministic else (None, [])
        mask_args = flex_mask.op_args(query.shape[0], dq_plan)

    run = _flex_fwd_op
    if eager(query):
        grad = torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad)
        run = _flex_fwd_eager_autograd if grad else _C.flex_fwd
    out, lse = run(query, key, value, *mask_args, scale, bool(deterministic))
    if not want_lse:
        return out
    # flare marks rows that see no key with +inf, FlexAttention with -inf.
    lse = lse.masked_fill(lse == math.inf, -math.inf)
    if return_aux is not None:
        from torch.nn.attention.flex_attention import AuxOutput
        return out, AuxOutput(lse=lse, max_scores=None)
    return out, lse


# ---- the op's fake implementation and autograd --------------------------------------------------

@torch.library.register_fake("flare::flex_fwd")
def _flex_fwd_fake(query, key, value, *mask_scale_deterministic):
    out = query.new_empty((query.shape[0], query.shape[1], query.shape[2], value.shape[3]))
    return out, query.new_empty((query.shape[0], query.shape[1], query.shape[2]), dtype=torch.float32)


@torch.library.register_fake("flare::flex_bwd")
def _flex_bwd_fake(dout, query, key, value, out, lse, *mask_scale_deterministic):
    return query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape)


def _flex_setup_context(ctx, inputs, output):
    query, key, value, *mask_args, scale, deterministic = inputs
    out, lse = output
    tensors = [a for a in mask_args if isinstance(a, torch.Tensor)]
    ctx.mask_layout = [isinstance(a, torch.Tensor) for a in mask_args]
    ctx.mask_values = [None if isinstance(a, torch.Tensor) else a for a in mask_args]
    ctx.save_for_backward(query, key, value, out, lse, *tensors)
    ctx.scale, ctx.deterministic = scale, deterministic
    ctx.mark_non_differentiable(lse)


def _flex_backward(ctx, dout, dlse):
    query, key, value, out, lse, *tensors = ctx.saved_tensors
    it = iter(tensors)
    mask_args = [next(it) if is_tensor else value_ for is_tensor, value_ in zip(ctx.mask_layout, ctx.mask_values)]
    if dout is None:  # only the LSE was used, which is not differentiable
        dout = torch.zeros_like(out)
    run = _C.flex_bwd if eager(dout) else torch.ops.flare.flex_bwd
    dq, dk, dv = run(dout, query, key, value, out, lse, *mask_args, ctx.scale, ctx.deterministic)
    return (dq, dk, dv) + (None,) * (len(mask_args) + 2)


torch.library.register_autograd("flare::flex_fwd", _flex_backward, setup_context=_flex_setup_context)
_flex_fwd_eager_autograd = eager_autograd("FlareFlexFwd", _C.flex_fwd, _flex_setup_context, _flex_backward)
