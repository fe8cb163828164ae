"""torch.compile traces through flare's ops (fake implementations, autograd) with fullgraph=True."""

import torch

import flare


class TinyAttention(torch.nn.Module):
    def __init__(self, dim=256, heads=4, heads_kv=2):
        super().__init__()
        self.heads, self.heads_kv, self.head_dim = heads, heads_kv, dim // heads
        self.q = torch.nn.Linear(dim, dim, bias=False)
        self.kv = torch.nn.Linear(dim, 2 * heads_kv * self.head_dim, bias=False)
        self.o = torch.nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.heads, self.head_dim)
        k, v = self.kv(x).view(b, s, 2, self.heads_kv, self.head_dim).unbind(2)
        y = flare.flash_attn_func(q, k, v, causal=True, window_size=(-1, -1))
        return self.o(y.reshape(b, s, -1))


def test_compile_fullgraph_forward_backward():
    model = TinyAttention().cuda().to(torch.bfloat16)
    x = torch.randn(2, 128, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    eager_out = model(x)
    eager_out.float().square().mean().backward()
    eager_grads = [x.grad.clone()] + [p.grad.clone() for p in model.parameters()]
    x.grad = None
    model.zero_grad()

    compiled = torch.compile(model, fullgraph=True)
    out = compiled(x)
    out.float().square().mean().backward()
    grads = [x.grad] + [p.grad for p in model.parameters()]
    torch.testing.assert_close(out, eager_out, atol=2e-2, rtol=2e-2)
    for a, b in zip(grads, eager_grads):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)


def test_opcheck_fake_implementations():
    """torch.library.opcheck: schema, fake implementation and autograd registration agree."""
    q = torch.randn(1, 64, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, 80, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, 80, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    torch.library.opcheck(torch.ops.flare.fwd.default,
                          (q, k, v, None, None, 0, 0, None, 0.0, True, -1, -1, 0.0, False),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
    kc = torch.randn(2, 512, 2, 64, device="cuda", dtype=torch.bfloat16)
    qd = torch.randn(2, 1, 4, 64, device="cuda", dtype=torch.bfloat16)
    seqlens = torch.tensor([100, 512], device="cuda", dtype=torch.int32)
    torch.library.opcheck(torch.ops.flare.decode.default, (qd, kc, kc, seqlens, None, None, 0.0, True, -1, 0, True),
                          test_utils=("test_schema", "test_faketensor"))
    po = torch.randn(3, 4, 64, device="cuda")
    pl = torch.randn(3, 4, device="cuda")
    torch.library.opcheck(torch.ops.flare.merge_states.default, (po, pl, torch.bfloat16),
                          test_utils=("test_schema", "test_faketensor"))


def test_fake_tensor_mode_takes_the_op():
    """Under a dispatch mode (here FakeTensorMode) the API calls the op, never the C++ directly."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    q = torch.randn(2, 32, 4, 64, device="cuda", dtype=torch.bfloat16)
    with FakeTensorMode() as mode:
        fq = mode.from_tensor(q)
        out, lse = flare.flash_attn_func(fq, fq, fq, causal=True, return_lse=True)
        assert out.shape == q.shape and lse.shape == (2, 4, 32)
        kc = torch.empty(2, 256, 4, 64, device="cuda", dtype=torch.bfloat16)
        seqlens = torch.empty(2, device="cuda", dtype=torch.int32)
        assert flare.flash_attn_with_kvcache(fq[:, :1], kc, kc, cache_seqlens=seqlens, num_splits=1).shape == (
            2, 1, 4, 64)


def test_eager_fast_path_matches_the_op():
    q = torch.randn(2, 100, 4, 64, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        fast = flare.flash_attn_func(q, q, q, causal=True)
    op, _ = torch.ops.flare.fwd(q, q, q, None, None, 0, 0, None, 0.0, True, -1, -1, 0.0, False)
    assert torch.equal(fast, op)
