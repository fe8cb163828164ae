#!/usr/bin/env python3
"""flash-linear-attention's chunk_kda forward, and forward + backward, on bench_kda's configuration: bf16, H = HV = 32,
K = V = 128, 32k tokens (B x T = 32768), plain mode (pre-computed fp32 log-space gate, unit-norm
k, beta in (0, 1)) and layer mode (gate, q/k l2norm, beta sigmoid in the kernel), T from --seqlens
plus bench_kda's varlen batch (12 sequences, cu_seqlens). Forward + backward is one forward with
autograd and torch.autograd.grad of (o, final state) against random (do, dht), every input's
gradient (and A_log's, dt_bias's in layer mode) as bench_kda's kda_backward computes. Median of
CUDA-event timings after warm-up (Triton compiles during the warm-up), L2 flushed before each
sample as bench_kda does (--no-flush: not; the figures of sessions 6-15 were taken without). fla
is not installed on the GPU machine: carry the fla-core and einops wheels (pip download --no-deps into .whl/) and put
them on PYTHONPATH. Prints a note and exits 0 when fla cannot be imported. Writes JSON with --json."""
import argparse
import json
import sys

import torch

from cuda_timing import time_ms


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--seqlens", default="1024,4096,32768")
    ap.add_argument("--modes", default="plain,layer")
    ap.add_argument("--no-varlen", action="store_true")
    ap.add_argument("--no-backward", action="store_true")
    ap.add_argument("--no-flush", action="store_true", help="keep L2 warm between samples (flushed by default, as bench_kda)")
    args = ap.parse_args()
    try:
        from fla.ops.kda import chunk_kda
    except Exception as e:  # noqa: BLE001
        print(f"fla not importable ({type(e).__name__}: {e}); FLA's figure from issue 8: ~4.1 ms forward")
        return 0
    tokens, H, D = 32768, 32, 128
    records = []
    dev = "cuda"
    varlen = [8000, 100, 3000, 1, 6000, 4567, 2222, 64, 5000, 1800, 1000, 1014]  # bench_kda's batch
    shapes = [(f"B{tokens // int(t)} T{t}", tokens // int(t), int(t), None) for t in args.seqlens.split(",")]
    if not args.no_varlen:
        offsets = torch.tensor([0] + varlen, device=dev).cumsum(0)
        shapes.append(("varlen 12", 1, sum(varlen), offsets))
    for mode in args.modes.split(","):
        layer = mode == "layer"
        for label, B, T, cu_seqlens in shapes:
            torch.manual_seed(0)
            q = torch.randn(B, T, H, D, device=dev, dtype=torch.bfloat16)
            k = torch.randn(B, T, H, D, device=dev, dtype=torch.bfloat16)
            v = torch.randn(B, T, H, D, device=dev, dtype=torch.bfloat16)
            g = torch.randn(B, T, H, D, device=dev, dtype=torch.float32)
            beta = torch.randn(B, T, H, device=dev, dtype=torch.bfloat16)
            kw = {}
            if layer:
                kw = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                          A_log=torch.log(1 + 15 * torch.arange(H, device=dev, dtype=torch.float32) / H),
                          dt_bias=torch.zeros(H * D, device=dev, dtype=torch.float32))
            else:
                k = torch.nn.functional.normalize(k.float(), dim=-1).to(torch.bfloat16)
                g = -0.01 - 0.2 * g.abs()
                beta = (0.5 + 0.4 * torch.tanh(beta.float())).to(torch.bfloat16)
            if cu_seqlens is not None:
                kw["cu_seqlens"] = cu_seqlens

            def fwd():
                with torch.no_grad():
                    return chunk_kda(q, k, v, g, beta, scale=D ** -0.5, output_final_state=True, **kw)

            name = label + (" layer" if layer else "")
            ms = time_ms(fwd, 3, 10, flush=not args.no_flush)
            print(f"fla chunk_kda fwd {name}: {ms:.3f} ms", flush=True)
            records.append({"name": "fla_kda_fwd " + name, "metrics": {"median_ms": ms}})
            if args.no_backward:
                continue
            leaves = [t.requires_grad_() for t in (q, k, v, g, beta)]
            if layer:
                leaves += [kw["A_log"].requires_grad_(), kw["dt_bias"].requires_grad_()]
            n_states = len(varlen) if cu_seqlens is not None else B
            do = torch.randn_like(v)
            dht = torch.randn(n_states, H, D, D, device=dev, dtype=torch.float32) * 0.1

            def fwd_bwd():
                o, ht = chunk_kda(q, k, v, g, beta, scale=D ** -0.5, output_final_state=True, **kw)
                return torch.autograd.grad([o, ht], leaves, [do, dht])

            ms = time_ms(fwd_bwd, 3, 10, flush=not args.no_flush)
            print(f"fla chunk_kda fwd+bwd {name}: {ms:.3f} ms", flush=True)
            records.append({"name": "fla_kda_fwd_bwd " + name, "metrics": {"median_ms": ms}})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
