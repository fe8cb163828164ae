#!/usr/bin/env python3
"""PyTorch SDPA backends (cuDNN, flash, efficient, math) on bench_decode's shapes: bf16, one query
token, heads 32 query / 8 KV, head dim 128, batches 1 and 8, cache lengths 256 to 65536.

GQA is given to SDPA two ways, each timed where the backend accepts it (both read K/V once):
  gqa:    q [B, 32, 1, 128], k/v [B, 8, L, 128], enable_gqa=True;
  packed: the 4 query heads of a KV head as 4 query rows, q [B, 8, 4, 128], k/v [B, 8, L, 128]
          (exact for one query token without a causal mask: every row sees every key).
Each is timed under CUDA-graph replay and as plain calls: median, p10 and p90 of CUDA-event
timings after warm-up, L2 flushed (a 2x-L2 buffer rewritten) before every sample, outside the
events. KV bytes per second count K and V once. Every output is checked against the math backend.
Writes JSON records with --json."""
import argparse
import json
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from cuda_timing import L2Flush

BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
HEADS_Q, HEADS_KV, HEAD_DIM = 32, 8, 128
GROUP = HEADS_Q // HEADS_KV


def percentiles(samples):
    s = sorted(samples)
    q = statistics.quantiles(s, n=10, method="inclusive")
    return statistics.median(s), q[0], q[-1]


def time_us(fn, flush, warmup, repeats):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
    for a, b in events:
        flush()
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return percentiles([1e3 * a.elapsed_time(b) for a, b in events])


def graphed(fn):
    """fn captured in a CUDA graph; returns (replay, output of the capture)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph.replay, out


def make_call(mode, q, k, v):
    b = q.shape[0]
    if mode == "gqa":
        return lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    qp = q.view(b, HEADS_KV, GROUP, HEAD_DIM)  # heads h = hk * GROUP + j are rows j of KV head hk
    return lambda: F.scaled_dot_product_attention(qp, k, v).reshape(b, HEADS_Q, 1, HEAD_DIM)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--backends", default="cudnn,flash,efficient,math")
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=10)
    args = ap.parse_args()
    lens = [1024, 4096, 65536] if args.quick else [256 << i for i in range(9)]
    flush = L2Flush()
    records = []
    print(f"{'shape':14s} {'backend':10s} {'mode':7s} {'graph us':>9s} {'p10':>8s} {'p90':>8s} {'plain us':>9s}"
          f" {'KV GB/s':>8s} {'max err':>8s}")
    torch.manual_seed(0)
    for b in (1, 8):
        for L in lens:
            q = torch.randn(b, HEADS_Q, 1, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(b, HEADS_KV, L, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
            v = torch.randn(b, HEADS_KV, L, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
            kv_bytes = 2 * k.numel() * k.element_size()
            with sdpa_kernel([SDPBackend.MATH]):  # fp32, packed (no 4x copy of K/V)
                expected = make_call("packed", q.float(), k.float(), v.float())()
            shape = f"b{b} L{L}"
            for be in args.backends.split(","):
                for mode in ("gqa", "packed"):
                    call = make_call(mode, q, k, v)
                    try:
                        with sdpa_kernel([BACKENDS[be]]):
                            err = (call().float() - expected).abs().max().item()
                            replay, _ = graphed(call)
                            g = time_us(replay, flush, args.warmup, args.repeats)
                            p = time_us(call, flush, args.warmup, args.repeats)
                    except RuntimeError as e:
                        print(f"{shape:14s} {be:10s} {mode:7s} unsupported: {str(e).splitlines()[0][:70]}")
                        continue
                    gbps = kv_bytes / g[0] / 1e3
                    print(f"{shape:14s} {be:10s} {mode:7s} {g[0]:9.2f} {g[1]:8.2f} {g[2]:8.2f} {p[0]:9.2f}"
                          f" {gbps:8.0f} {err:8.4f}", flush=True)
                    records.append({"name": f"{shape} {be} {mode}",
                                    "metrics": {"graph_us": g[0], "graph_p10_us": g[1], "graph_p90_us": g[2],
                                                "plain_us": p[0], "plain_p10_us": p[1], "plain_p90_us": p[2],
                                                "kv_gbps": gbps, "max_abs_err": err},
                                    "tags": {"backend": be, "mode": mode, "batch": str(b), "cache_len": str(L)}})
            del q, k, v, expected
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
