"""flex_attention with a torch BlockMask against PyTorch's references: SDPA's math backend in fp32 on
the dense mask torch's create_mask makes from the same mask_mod (and the same computation in the
inputs' dtype, for the error budget), and torch's own flex_attention. Forward, gradients, LSE, GQA,
flare-native and evaluated mask_mods, the cache, torch.compile, and bad inputs."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, create_block_mask, create_mask
from torch.nn.attention.flex_attention import flex_attention as torch_flex_attention

import flare
import flare.flex
from conftest import assert_close_to_ref

DTYPES = [torch.bfloat16, torch.float16]
MASK_KINDS = ["causal", "sliding_window", "two_sided_window", "prefix_lm", "document", "causal_document", "random"]


# ---- masks --------------------------------------------------------------------------------------

def documents(seqlen, num_docs=4, batch=None):
    """Sorted document ids [seqlen] (or [batch, seqlen]) for packed sequences."""
    shape = (seqlen,) if batch is None else (batch, seqlen)
    return torch.randint(0, num_docs, shape, device="cuda").sort(-1).values


def mask_mod_of(kind, native, seqlen_q, seqlen_k, batch=2, heads=4):
    """The mask kind as a flare.masks mask_mod (native: flare evaluates its own predicate) or as a
    plain Python function (flare evaluates it into bit words)."""
    m = flare.masks
    if kind == "causal":
        return m.causal() if native else (lambda b, h, q, kv: q >= kv)
    if kind == "sliding_window":
        return m.sliding_window(64) if native else (lambda b, h, q, kv: (q >= kv) & (q - kv <= 64))
    if kind == "two_sided_window":
        return m.sliding_window(48, 16) if native else (lambda b, h, q, kv: (q - kv <= 48) & (kv - q <= 16))
    if kind == "prefix_lm":
        return m.prefix_lm(100) if native else (lambda b, h, q, kv: (kv < 100) | (kv <= q))
    if kind == "document":
        doc_k = documents(seqlen_k)
        doc_q = doc_k[:seqlen_q] if seqlen_q <= seqlen_k else documents(seqlen_q)
        return m.document(doc_q, doc_k) if native else (lambda b, h, q, kv: doc_q[q] == doc_k[kv])
    if kind == "causal_document":
        doc = documents(max(seqlen_q, seqlen_k), batch=batch)
        if native:
            return m.and_masks(m.causal(), m.document(doc[:, :seqlen_q], doc[:, :seqlen_k]))
        return lambda b, h, q, kv: (q >= kv) & (doc[b, q] == doc[b, kv])
    if kind == "random":  # an arbitrary mask: every element drawn at random, per batch entry and head
        dense = torch.rand(batch, heads, seqlen_q, seqlen_k, device="cuda") < 0.3
        return m.from_dense(dense) if native else (lambda b, h, q, kv: dense[b, h, q, kv])
    raise ValueError(kind)


def make_qkv(batch, heads, heads_kv, seqlen_q, seqlen_k, head_dim, dtype, requires_grad=True):
    def t(h, s):
        return torch.randn(batch, h, s, head_dim, device="cuda", dtype=dtype, requires_grad=requires_grad)
    return t(heads, seqlen_q), t(heads_kv, seqlen_k), t(heads_kv, seqlen_k)


# ---- references ---------------------------------------------------------------------------------

def reference(q, k, v, visible, scale=None, upcast=True):
    """[B, H, Sq, D] attention over the bool mask `visible` [B|1, H|1, Sq, Sk]; rows that see no key
    give 0. upcast: SDPA's math backend in fp32; else the same computation in the inputs' dtype."""
    dtype = q.dtype
    group = q.shape[1] // k.shape[1]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    sees_a_key = visible.any(-1, keepdim=True)
    if upcast:
        with sdpa_kernel(SDPBackend.MATH):
            out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=visible, scale=scale,
                                                 enable_gqa=group > 1)
        return out.masked_fill(~sees_a_key, 0.0).to(dtype)
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    s = s.masked_fill(~visible, float("-inf")).masked_fill(~sees_a_key, 0.0)  # no NaN rows, in values or grads
    p = torch.softmax(s, dim=-1) * sees_a_key
    return torch.matmul(p.to(v.dtype), v)


def check(q, k, v, block_mask, visible, scale=None, grads=True, **kw):
    out = flare.flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1], **kw)
    out_ref = reference(q, k, v, visible, scale)
    out_lowp = reference(q, k, v, visible, scale, upcast=False)
    assert out.shape == q.shape[:-1] + v.shape[-1:] and out.dtype == q.dtype and out.is_contiguous()
    assert_close_to_ref(out, out_ref, out_lowp)
    if not grads:
        return out
    dout = torch.randn_like(out)
    g = torch.autograd.grad(out, (q, k, v), dout)
    g_ref = torch.autograd.grad(out_ref, (q, k, v), dout)
    g_lowp = torch.autograd.grad(out_lowp, (q, k, v), dout)
    for name, a, b, c in zip(("dquery", "dkey", "dvalue"), g, g_ref, g_lowp):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert_close_to_ref(a, b, c, atol=1e-3, what=name)
    return out


# ---- forward and backward against the references ------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("native", [True, False], ids=["flare-native", "evaluated"])
@pytest.mark.parametrize("kind", MASK_KINDS)
def test_masks(kind, native, dtype):
    batch, heads, heads_kv, seqlen, head_dim = 2, 4, 2, 300, 64
    mask_mod = mask_mod_of(kind, native, seqlen, seqlen, batch, heads)
    per_head = kind in ("random", "causal_document")
    block_mask = create_block_mask(mask_mod, batch if per_head else None, heads if kind == "random" else None,
                                   seqlen, seqlen, device="cuda")
    assert (flare.masks.element_mask_of(mask_mod) is not None) == native
    visible = create_mask(mask_mod, batch, heads, seqlen, seqlen, device="cuda")
    q, k, v = make_qkv(batch, heads, heads_kv, seqlen, seqlen, head_dim, dtype)
    check(q, k, v, block_mask, visible)


@pytest.mark.parametrize("block_size", [128, 64, (64, 32), (32, 128), 48, 16])
@pytest.mark.parametrize("seqlens", [(200, 333), (333, 200), (128, 256), (1, 77)])
@pytest.mark.parametrize("kind", ["causal", "document", "random"])
def test_shapes_and_block_sizes(kind, seqlens, block_size):
    """Sequence lengths off the block grid, seqlen_q != seqlen_k, block sizes that are not the
    kernels' tiles (multiples of 16, including ones where a 32-bit mask word spans two blocks)."""
    batch, heads, heads_kv, head_dim = 2, 4, 4, 128
    mask_mod = mask_mod_of(kind, False, *seqlens, batch, heads)
    block_mask = create_block_mask(mask_mod, batch, heads, *seqlens, device="cuda", BLOCK_SIZE=block_size)
    visible = create_mask(mask_mod, batch, heads, *seqlens, device="cuda")
    q, k, v = make_qkv(batch, heads, heads_kv, *seqlens, head_dim, torch.bfloat16)
    check(q, k, v, block_mask, visible)


@pytest.mark.parametrize("heads", [(8, 2), (8, 1), (6, 3)])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_gqa_and_head_dims(heads, head_dim):
    mask_mod = mask_mod_of("sliding_window", True, 257, 257)
    block_mask = create_block_mask(mask_mod, None, None, 257, 257, device="cuda")
    visible = create_mask(mask_mod, 1, 1, 257, 257, device="cuda")
    q, k, v = make_qkv(2, *heads, 257, 257, head_dim, torch.float16)
    check(q, k, v, block_mask, visible, scale=0.1)


def test_head_dependent_mask_and_broadcast_dims():
    """A mask per (batch, head) against the same mask broadcast from one (batch, head)."""
    def per_head(b, h, q, kv):
        return (q - kv <= 16 * (h + 1)) & (q >= kv) | (kv < 8 * b)
    q, k, v = make_qkv(2, 4, 2, 256, 256, 64, torch.bfloat16)
    full = create_block_mask(per_head, 2, 4, 256, 256, device="cuda", BLOCK_SIZE=64)
    check(q, k, v, full, create_mask(per_head, 2, 4, 256, 256, device="cuda"))
    shared = create_block_mask(per_head, 1, 1, 256, 256, device="cuda", BLOCK_SIZE=64)  # b = h = 0 everywhere
    check(q, k, v, shared, create_mask(per_head, 1, 1, 256, 256, device="cuda"))


def test_no_block_mask_is_dense_attention():
    q, k, v = make_qkv(2, 8, 2, 190, 260, 128, torch.bfloat16)
    check(q, k, v, None, torch.ones(1, 1, 190, 260, dtype=torch.bool, device="cuda"))


def test_noop_mask_mod_and_full_blocks_only():
    """A BlockMask of torch's noop_mask (no predicate) and one whose mask_mod is never evaluated."""
    q, k, v = make_qkv(1, 2, 2, 256, 256, 64, torch.bfloat16)
    from torch.nn.attention.flex_attention import noop_mask
    block_mask = create_block_mask(noop_mask, None, None, 256, 256, device="cuda")
    check(q, k, v, block_mask, torch.ones(1, 1, 256, 256, dtype=torch.bool, device="cuda"))
    # Blocks only, no element mask: the lower block triangle of 64-blocks, all full.
    block_causal = create_block_mask(lambda b, h, q, kv: q // 64 >= kv // 64, None, None, 256, 256, device="cuda",
                                     BLOCK_SIZE=64)
    check(q, k, v, block_causal, create_mask(lambda b, h, q, kv: q // 64 >= kv // 64, 1, 1, 256, 256, "cuda"))


def test_rows_that_see_no_key():
    """Output 0 and LSE -inf (FlexAttention's convention) where a row sees no key; gradients 0."""
    def late_rows(b, h, q, kv):
        return (q >= 100) & (kv <= q)
    block_mask = create_block_mask(late_rows, None, None, 256, 256, device="cuda", BLOCK_SIZE=64)
    q, k, v = make_qkv(1, 2, 2, 256, 256, 64, torch.bfloat16)
    out, lse = flare.flex_attention(q, k, v, block_mask=block_mask, return_lse=True)
    assert torch.isneginf(lse[:, :, :100]).all() and torch.isfinite(lse[:, :, 100:]).all()
    assert (out[:, :, :100] == 0).all()
    (dq,) = torch.autograd.grad(out.float().sum(), q)
    assert (dq[:, :, :100] == 0).all()
    check(q, k, v, block_mask, create_mask(late_rows, 1, 1, 256, 256, device="cuda"))


@pytest.mark.parametrize("kind", ["causal", "document", "random"])
def test_matches_torch_flex_attention(kind):
    """Output and LSE against torch's flex_attention itself (its unfused eager path, fp32)."""
    batch, heads, heads_kv, seqlen = 2, 4, 2, 384
    mask_mod = mask_mod_of(kind, kind != "random", seqlen, seqlen, batch, heads)
    block_mask = create_block_mask(mask_mod, batch, heads, seqlen, seqlen, device="cuda")
    q, k, v = make_qkv(batch, heads, heads_kv, seqlen, seqlen, 64, torch.bfloat16, requires_grad=False)
    out, aux = flare.flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True, return_aux=AuxRequest(lse=True))
    out_t, lse_t = torch_flex_attention(q.float(), k.float(), v.float(), block_mask=block_mask, enable_gqa=True,
                                        return_lse=True)
    torch.testing.assert_close(out.float(), out_t, atol=2e-2, rtol=2e-2)
    assert torch.equal(torch.isneginf(aux.lse), torch.isneginf(lse_t))
    finite = torch.isfinite(lse_t)
    torch.testing.assert_close(aux.lse[finite], lse_t[finite], atol=2e-3, rtol=1e-3)


def test_lse_is_natural_log():
    block_mask = create_block_mask(flare.masks.causal(), None, None, 200, 200, device="cuda")
    q, k, v = make_qkv(1, 2, 2, 200, 200, 64, torch.float16, requires_grad=False)
    _, lse = flare.flex_attention(q, k, v, block_mask=block_mask, scale=0.3, return_lse=True)
    s = (q.float() @ k.float().transpose(-1, -2)) * 0.3
    s = s.masked_fill(~create_mask(flare.masks.causal(), 1, 1, 200, 200, "cuda"), -math.inf)
    torch.testing.assert_close(lse, torch.logsumexp(s, -1), atol=2e-3, rtol=1e-3)


# ---- the converted mask: cache, transposed lists, in-place changes ------------------------------

def test_mask_mod_is_evaluated_once_per_block_mask(monkeypatch):
    evaluations = []
    evaluate = flare.flex._evaluate_bits
    monkeypatch.setattr(flare.flex, "_evaluate_bits", lambda *a: evaluations.append(1) or evaluate(*a))
    mask_mod = mask_mod_of("random", False, 256, 256)
    block_mask = create_block_mask(mask_mod, 2, 4, 256, 256, device="cuda", BLOCK_SIZE=64)
    q, k, v = make_qkv(2, 4, 4, 256, 256, 64, torch.bfloat16)
    first = flare.flex_attention(q, k, v, block_mask=block_mask)
    for _ in range(3):
        again = flare.flex_attention(q, k, v, block_mask=block_mask)
    assert len(evaluations) == 1 and torch.equal(first, again)
    assert flare.prepare_block_mask(block_mask) is flare.prepare_block_mask(block_mask)
    block_mask.kv_num_blocks.add_(0)  # an in-place change (version bump) rebuilds the cached form
    flare.flex_attention(q, k, v, block_mask=block_mask)
    assert len(evaluations) == 2
    # flare-native masks are never evaluated
    native = create_block_mask(flare.masks.causal(), None, None, 256, 256, device="cuda")
    flare.flex_attention(q, k, v, block_mask=native)
    assert len(evaluations) == 2


def test_bits_match_the_dense_mask():
    """The evaluated bit words equal flare.masks.pack_bits of the dense mask inside partial blocks."""
    mask_mod = mask_mod_of("random", False, 200, 333)
    block_mask = create_block_mask(mask_mod, 2, 4, 200, 333, device="cuda", BLOCK_SIZE=(32, 48))
    bits = flare.prepare_block_mask(block_mask).element.bits
    dense = create_mask(mask_mod, 2, 4, 200, 333, device="cuda")
    packed = flare.masks.pack_bits(dense)
    slots = torch.arange(7, device="cuda")  # 7 x 7 blocks
    listed = slots < block_mask.kv_num_blocks[..., None]
    kinds = torch.zeros(2, 4, 7, 7, dtype=torch.int32, device="cuda")
    kinds = kinds.scatter_add_(-1, torch.where(listed, block_mask.kv_indices, 0).long(), listed.int()) > 0  # partial
    element_partial = kinds.repeat_interleave(32, 2)[:, :, :200].repeat_interleave(48, 3)[..., :333]
    unpacked = lambda w: ((w.long()[..., torch.arange(333, device="cuda") // 32] >> (torch.arange(333, device="cuda")
                                                                                        % 32)) & 1).bool()
    assert torch.equal(unpacked(bits) & element_partial, unpacked(packed) & element_partial)


def test_block_mask_without_transposed_lists():
    """BlockMask.from_kv_blocks without the q lists: flare builds them for the backward."""
    mask_mod = mask_mod_of("causal", False, 256, 256)
    made = create_block_mask(mask_mod, None, None, 256, 256, device="cuda", BLOCK_SIZE=64)
    bare = BlockMask.from_kv_blocks(made.kv_num_blocks, made.kv_indices, made.full_kv_num_blocks,
                                    made.full_kv_indices, BLOCK_SIZE=64, mask_mod=mask_mod, compute_q_blocks=False)
    assert bare.q_num_blocks is None
    converted, reference_lists = flare.prepare_block_mask(bare).lists, flare.prepare_block_mask(made).lists
    for counts, indices, counts_ref, indices_ref in ((converted[4], converted[5], reference_lists[4],
                                                      reference_lists[5]),
                                                     (converted[6], converted[7], reference_lists[6],
                                                      reference_lists[7])):
        assert torch.equal(counts, counts_ref)
        for row in range(counts.shape[-1]):
            n = int(counts[0, 0, row])
            assert torch.equal(indices[0, 0, row, :n].sort().values, indices_ref[0, 0, row, :n].sort().values)
    q, k, v = make_qkv(1, 2, 2, 256, 256, 64, torch.bfloat16)
    check(q, k, v, bare, create_mask(mask_mod, 1, 1, 256, 256, device="cuda"))


# ---- autograd, compile, op registration ---------------------------------------------------------

class TinyFlexAttention(torch.nn.Module):
    def __init__(self, dim=256, heads=4, heads_kv=2):
        super().__init__()
        self.heads, self.heads_kv, self.head_dim = heads, heads_kv, dim // heads
        self.q = torch.nn.Linear(dim, dim, bias=False)
        self.kv = torch.nn.Linear(dim, 2 * heads_kv * self.head_dim, bias=False)
        self.o = torch.nn.Linear(dim, dim, bias=False)

    def forward(self, x, block_mask):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(x).view(b, s, 2, self.heads_kv, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        y = flare.flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)
        return self.o(y.transpose(1, 2).reshape(b, s, -1))


@pytest.mark.parametrize("native", [True, False], ids=["flare-native", "evaluated-and-prepared"])
def test_compile_fullgraph_forward_backward(native):
    mask_mod = mask_mod_of("causal_document", native, 256, 256)
    block_mask = create_block_mask(mask_mod, 2, None, 256, 256, device="cuda")
    if not native:
        flare.prepare_block_mask(block_mask)  # evaluating a Python mask_mod is data-dependent: before compiling
    model = TinyFlexAttention().cuda().to(torch.bfloat16)
    x = torch.randn(2, 256, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    eager_out = model(x, block_mask)
    eager_out.float().square().mean().backward()
    eager_grads = [x.grad.clone()] + [p.grad.clone() for p in model.parameters()]
    x.grad = None
    model.zero_grad()

    compiled = torch.compile(model, fullgraph=True)
    out = compiled(x, block_mask)
    out.float().square().mean().backward()
    torch.testing.assert_close(out, eager_out, atol=2e-2, rtol=2e-2)
    for a, b in zip([x.grad] + [p.grad for p in model.parameters()], eager_grads):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)


def test_compile_evaluates_an_unprepared_mask_mod_outside_the_graph():
    """Without fullgraph, an unprepared Python mask_mod is converted eagerly at a graph break."""
    mask_mod = mask_mod_of("random", False, 128, 128)
    block_mask = create_block_mask(mask_mod, 2, 4, 128, 128, device="cuda")
    q, k, v = make_qkv(2, 4, 4, 128, 128, 64, torch.bfloat16, requires_grad=False)
    compiled = torch.compile(lambda q, k, v, m: flare.flex_attention(q, k, v, block_mask=m) * 2)
    out = compiled(q, k, v, block_mask)
    torch.testing.assert_close(out, 2 * flare.flex_attention(q, k, v, block_mask=block_mask), atol=0, rtol=0)


def test_opcheck_fake_implementations():
    mask_mod = mask_mod_of("random", False, 128, 160, 2, 4)
    block_mask = create_block_mask(mask_mod, 2, 4, 128, 160, device="cuda", BLOCK_SIZE=32)
    q = torch.randn(2, 4, 128, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(2, 2, 160, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    mask_args = flare.prepare_block_mask(block_mask).op_args(2)
    for args in (mask_args, flare.flex._NO_MASK):
        torch.library.opcheck(torch.ops.flare.flex_fwd.default, (q, k, k, *args, 0.0, False),
                              test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


@pytest.mark.parametrize("kind", ["causal", "document", "random"])
def test_deterministic(kind):
    """deterministic=True: with a block mask the deterministic block-sparse backward (its plan made
    on first use and kept with the mask), against the reference and bitwise reproducible; without
    one the dense deterministic backward, bitwise reproducible."""
    q, k, v = make_qkv(2, 4, 2, 512, 512, 128, torch.bfloat16)
    mask_mod = mask_mod_of(kind, True, 512, 512)
    block_mask = create_block_mask(mask_mod, 2, 4, 512, 512, device="cuda", BLOCK_SIZE=64)
    visible = create_mask(mask_mod, 2, 4, 512, 512, device="cuda")
    check(q, k, v, block_mask, visible, deterministic=True)
    assert len(flare.prepare_block_mask(block_mask).dq_plans) == 1  # made once, kept
    for mask in (block_mask, None):
        out = flare.flex_attention(q, k, v, block_mask=mask, enable_gqa=True, deterministic=True)
        dout = torch.randn_like(out)
        first = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
        for _ in range(3):
            again = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
            assert all(torch.equal(a, b) for a, b in zip(first, again))


def test_no_grad_fast_path_matches_the_op():
    block_mask = create_block_mask(flare.masks.prefix_lm(64), None, None, 200, 200, device="cuda")
    q, k, v = make_qkv(2, 4, 4, 200, 200, 64, torch.bfloat16, requires_grad=False)
    with torch.no_grad():
        fast = flare.flex_attention(q, k, v, block_mask=block_mask)
    op, _ = torch.ops.flare.flex_fwd(q, k, v, *flare.prepare_block_mask(block_mask).op_args(2), 0.0, False)
    assert torch.equal(fast, op)


# ---- bad inputs ---------------------------------------------------------------------------------

def test_errors_name_the_argument():
    q, k, v = make_qkv(2, 4, 2, 256, 256, 64, torch.bfloat16, requires_grad=False)
    block_mask = create_block_mask(flare.masks.causal(), None, None, 256, 256, device="cuda")

    def raises(exc, name, *args, **kw):
        with pytest.raises(exc, match=f"'{name}'"):
            flare.flex_attention(*args, **kw)

    raises(NotImplementedError, "score_mod", q, k, v, score_mod=lambda score, b, h, i, j: score, enable_gqa=True)
    raises(NotImplementedError, "score_mod", q, k, v, block_mask, enable_gqa=True)  # a BlockMask in score_mod's place
    raises(NotImplementedError, "return_aux", q, k, v, enable_gqa=True, return_aux=AuxRequest(max_scores=True))
    raises(ValueError, "enable_gqa", q, k, v)
    raises(TypeError, "key", q, [1, 2], v, enable_gqa=True)
    raises(ValueError, "query", q[0], k, v, enable_gqa=True)
    raises(ValueError, "key", q, k[:1], v[:1], enable_gqa=True)                       # batch 1 vs 2
    raises(TypeError, "query", q.float(), k.float(), v.float(), enable_gqa=True)      # fp32
    raises(TypeError, "key", q, k.half(), v, enable_gqa=True)
    raises(ValueError, "query", q.cpu(), k.cpu(), v.cpu(), enable_gqa=True)          # not CUDA
    raises(ValueError, "value", q, k, v[..., :32], enable_gqa=True)                   # value head dim
    raises(ValueError, "scale", q, k, v, scale=-1.0, enable_gqa=True)
    raises(TypeError, "scale", q, k, v, scale="0.1", enable_gqa=True)
    raises(TypeError, "block_mask", q, k, v, block_mask=torch.ones(256, 256, dtype=torch.bool), enable_gqa=True)
    raises(ValueError, "block_mask", q[:, :, :128], k, v, block_mask=block_mask, enable_gqa=True)  # other lengths
    other_batch = create_block_mask(flare.masks.causal(), 3, None, 256, 256, device="cuda")
    raises(ValueError, "block_mask", q, k, v, block_mask=other_batch, enable_gqa=True)
    raises(ValueError, "block_mask", q, k, v, block_mask=create_block_mask(flare.masks.causal(), None, None, 256, 256,
                                                                           device="cpu"), enable_gqa=True)
    int64_lists = BlockMask.from_kv_blocks(block_mask.kv_num_blocks.long(), block_mask.kv_indices.long(),
                                           mask_mod=flare.masks.causal())
    raises(TypeError, "block_mask.kv_num_blocks", q, k, v, block_mask=int64_lists, enable_gqa=True)
    odd_blocks = create_block_mask(flare.masks.causal(), None, None, 256, 256, device="cuda", BLOCK_SIZE=24)
    raises(ValueError, "block_mask.BLOCK_SIZE", q, k, v, block_mask=odd_blocks, enable_gqa=True)
    with pytest.raises(ValueError, match="'window_left'"):
        flare.masks.sliding_window(-3)
    with pytest.raises(TypeError, match="'doc_ids_q'"):
        flare.masks.document(torch.rand(256, device="cuda"))
