"""A training step of a small transformer block on flare's attention, end to end.

A tiny language model (embedding, one pre-norm transformer block, LM head) trains with AdamW in
bf16 autocast on sequences of a fixed random Markov chain (every token has two likely successors).
The block is RMSNorm -> QKV projection -> flare.flash_attn_func (causal, GQA: 8 query heads share
2 KV heads) -> output projection, and RMSNorm -> SwiGLU MLP, each with a residual. The script checks
that the block with flare's attention matches the block with PyTorch's SDPA and that the loss falls
(from chance, ln 64, towards ln 2) over the steps, and exits non-zero otherwise. The task is easy on
purpose: it shows a whole training step (forward, flare's backward, optimizer) working, not what
attention can learn. A few seconds on one GPU.

    PYTHONPATH=python python3 python/examples/train_block.py [--steps 30] [--compile] [--attention sdpa]
"""

import argparse
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # python/, where the in-place build puts flare


def attention(q, k, v, impl):
    """Causal attention of q [B, S, H, D] over k/v [B, S, Hkv, D] (H a multiple of Hkv)."""
    if impl == "flare":
        import flare
        return flare.flash_attn_func(q, k, v, causal=True)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                         enable_gqa=True)
    return out.transpose(1, 2)


class Block(nn.Module):
    """A pre-norm transformer block with grouped-query attention and a SwiGLU MLP."""

    def __init__(self, dim, heads, heads_kv, mlp_hidden, impl):
        super().__init__()
        self.heads, self.heads_kv, self.head_dim, self.impl = heads, heads_kv, dim // heads, impl
        self.attn_norm = nn.RMSNorm(dim)
        self.qkv = nn.Linear(dim, (heads + 2 * heads_kv) * self.head_dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)
        self.mlp_norm = nn.RMSNorm(dim)
        self.gate_up = nn.Linear(dim, 2 * mlp_hidden, bias=False)
        self.down = nn.Linear(mlp_hidden, dim, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        qkv = self.qkv(self.attn_norm(x))
        q, k, v = qkv.split([self.heads * self.head_dim, self.heads_kv * self.head_dim,
                             self.heads_kv * self.head_dim], dim=-1)
        q = q.view(b, s, self.heads, self.head_dim)
        k = k.view(b, s, self.heads_kv, self.head_dim)
        v = v.view(b, s, self.heads_kv, self.head_dim)
        x = x + self.out(attention(q, k, v, self.impl).reshape(b, s, -1))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class TinyLM(nn.Module):
    def __init__(self, vocab, dim, heads, heads_kv, impl):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(1, 1024, dim) * 0.02)
        self.block = Block(dim, heads, heads_kv, 4 * dim, impl)
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens) + self.pos[:, :tokens.shape[1]]
        return self.head(self.norm(self.block(x)))


def markov_chains(num, seqlen, vocab, device, successors=2):
    """`num` token sequences of a fixed random Markov chain in which every token has `successors`
    equally likely next tokens: a loss of ln(successors) is reachable, ln(vocab) is chance."""
    gen = torch.Generator(device="cpu").manual_seed(1)
    table = torch.randint(0, vocab, (vocab, successors), generator=gen).to(device)
    tokens = torch.empty(num, seqlen, dtype=torch.long, device=device)
    tokens[:, 0] = torch.randint(0, vocab, (num,), device=device)
    for i in range(1, seqlen):
        pick = torch.randint(0, successors, (num,), device=device)
        tokens[:, i] = table[tokens[:, i - 1], pick]
    return tokens


def loss_of(model, tokens):
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--compile", action="store_true", help="torch.compile the model (flare's ops trace through)")
    ap.add_argument("--attention", choices=["flare", "sdpa"], default="flare", help="sdpa: PyTorch's, to compare")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("train_block: needs a CUDA device (flare's kernels)")
        return 1
    torch.manual_seed(0)
    device, vocab = "cuda", 64
    model = TinyLM(vocab, dim=512, heads=8, heads_kv=2, impl=args.attention).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.0)
    step_fn = torch.compile(model) if args.compile else model

    data = markov_chains(16 * args.batch, args.seqlen + 1, vocab, device)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        # flare's attention agrees with SDPA's on the same block (bf16 tolerance).
        x = torch.randn(2, 128, 512, device=device)
        flare_out = model.block(x)
        model.block.impl = "sdpa"
        sdpa_out = model.block(x)
        model.block.impl = args.attention
    err = (flare_out.float() - sdpa_out.float()).abs().max().item()
    print(f"block output, {args.attention} vs SDPA: max abs difference {err:.2e}")
    if err > 5e-2:
        print("train_block: FAILED (attention differs from SDPA)")
        return 1

    losses = []
    start = time.perf_counter()
    for step in range(args.steps):
        tokens = data[torch.randint(0, data.shape[0], (args.batch,), device=device)]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_of(step_fn, tokens)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if step % 5 == 0 or step == args.steps - 1:
            print(f"step {step:3d}  loss {losses[-1]:.4f}")
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    print(f"{args.steps} steps in {elapsed:.1f} s; loss {first:.3f} -> {last:.3f} (chance ln {vocab} = "
          f"{math.log(vocab):.3f}, reachable ln 2 = {math.log(2):.3f})")
    if not last < 0.7 * first:
        print("train_block: FAILED (the loss did not fall by 30 %)")
        return 1
    print("train_block: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
