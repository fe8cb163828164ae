#!/usr/bin/env python3
"""PyTorch SDPA backends (cuDNN, flash = FlashAttention-2, efficient) on the attention benchmark's
configuration: bf16, 16k tokens, hidden 2048 (heads = 2048 / head_dim, batch = 16384 / seqlen).
Forward and backward, median of CUDA-event timings after warm-up (L2 flushed before each sample
unless --no-flush), FLOPs counted as FlashAttention
counts them (4*b*h*s*s*d forward, halved for causal; backward 2.5x). Writes JSON with --json."""
import argparse
import json

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from cuda_timing import time_ms

BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--backends", default="cudnn,flash")
    ap.add_argument("--no-backward", action="store_true")
    ap.add_argument("--no-flush", action="store_true", help="keep L2 warm between samples (flushed by default, as flare's bench)")
    ap.add_argument("--head-dims", default="64,128,256", help="comma-separated head dims to time")
    args = ap.parse_args()
    seqlens = [1024, 4096] if args.quick else [1024, 2048, 4096, 8192, 16384]
    records = []
    print(f"{'case':28s} {'backend':10s} {'fwd ms':>8s} {'fwd TF/s':>9s} {'bwd ms':>8s} {'bwd TF/s':>9s}")
    for d in [int(x) for x in args.head_dims.split(",")]:
        for causal in (False, True):
            for s in seqlens:
                b, h = 16384 // s, 2048 // d
                q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                           for _ in range(3))
                flops = 4 * b * h * s * s * d / (2 if causal else 1)
                name = f"fwd d{d} s{s}" + (" causal" if causal else "")
                for be in args.backends.split(","):
                    try:
                        with sdpa_kernel([BACKENDS[be]]):
                            fwd = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                            fms = time_ms(fwd, 5, 30, flush=not args.no_flush)
                            bms = float("nan")
                            if not args.no_backward:
                                out = fwd()
                                g = torch.randn_like(out)
                                bms = time_ms(lambda: torch.autograd.grad(out, (q, k, v), g, retain_graph=True), 5, 30,
                                              flush=not args.no_flush)
                    except RuntimeError as e:
                        print(f"{name:28s} {be:10s} unsupported: {str(e).splitlines()[0][:60]}")
                        continue
                    ftf, btf = flops / fms / 1e9, 2.5 * flops / bms / 1e9
                    print(f"{name:28s} {be:10s} {fms:8.3f} {ftf:9.1f} {bms:8.3f} {btf:9.1f}")
                    records.append({"name": f"{name} {be}", "metrics": {"fwd_ms": fms, "fwd_tflops": ftf,
                                    "bwd_ms": bms, "bwd_tflops": btf},
                                    "tags": {"backend": be, "head_dim": str(d), "seqlen": str(s),
                                             "causal": str(int(causal))}})
                q = k = v = None  # free before the next shape
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
