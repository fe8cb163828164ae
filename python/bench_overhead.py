"""Host time per call of flare's Python path against the C++ launch, on a small decode step.

The GPU is first put to sleep (torch.cuda._sleep) so that every timed launch only queues: the wall
time of a loop of launches is then the host's cost per call, whatever the kernel's duration.
Variants, each `--iters` calls, median of `--repeats` loops:
  cpp            flare::decode_run in a C++ loop (plan made once): the C++ launch
  op             torch.ops.flare.decode (dispatcher + binding, plan re-derived per call)
  direct         flare._C.decode: the binding without the dispatcher (the API's eager path)
  api            flare.flash_attn_with_kvcache with num_splits and workspace from plan_kvcache
  api_autoplan   flare.flash_attn_with_kvcache with no plan given (plans, allocates its workspace)
  api_wrapper_only  the API's Python code alone (flare._C.decode stubbed out)
  fwd_api        flare.flash_attn_func on a tiny prefill (no grad), for comparison; fwd_op the op
Usage: python3 python/bench_overhead.py [--json PATH]
"""

import argparse
import json
import statistics
import sys
import time
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import flare  # noqa: E402
from flare import _C, kvcache  # noqa: E402


def host_us_per_call(fn, iters, repeats):
    samples = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time: the launches below only queue
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        samples.append((time.perf_counter() - start) / iters * 1e6)
        torch.cuda.synchronize()
    return statistics.median(samples)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json")
    args = parser.parse_args()
    dev = "cuda"
    batch, heads, heads_kv, d, cache_len = 1, 32, 8, 128, 4096
    q = torch.randn(batch, 1, heads, d, device=dev, dtype=torch.bfloat16)
    k_cache = torch.randn(batch, cache_len, heads_kv, d, device=dev, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    seqlens = torch.full((batch,), cache_len, device=dev, dtype=torch.int32)
    plan = flare.plan_kvcache(q, k_cache, causal=True)
    ws = plan.workspace(dev)
    decode = torch.ops.flare.decode

    variants = {
        "cpp": None,
        "op": lambda: decode(q, k_cache, v_cache, seqlens, None, ws, 0.0, True, -1, plan.num_splits, False),
        "direct": lambda: _C.decode(q, k_cache, v_cache, seqlens, None, ws, 0.0, True, -1, plan.num_splits,
                                    False),
        "api": lambda: flare.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, causal=True,
                                                     num_splits=plan.num_splits, workspace=ws),
        "api_autoplan": lambda: flare.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens,
                                                              causal=True),
    }
    qf = torch.randn(1, 64, 8, 64, device=dev, dtype=torch.bfloat16)
    variants["fwd_api"] = lambda: flare.flash_attn_func(qf, qf, qf, causal=True)
    variants["fwd_op"] = lambda: torch.ops.flare.fwd(qf, qf, qf, None, None, 0, 0, None, 0.0, True, -1, -1, 0.0,
                                                     False)

    results = {}
    with torch.no_grad():
        for name, fn in variants.items():
            if name == "cpp":
                samples = []
                for _ in range(args.repeats):
                    torch.cuda.synchronize()
                    torch.cuda._sleep(200_000_000)
                    samples.append(1e6 * _C.bench_decode_run_loop(q, k_cache, v_cache, seqlens, ws,
                                                                  plan.num_splits, args.iters))
                    torch.cuda.synchronize()
                us = statistics.median(samples)
            else:
                for _ in range(20):
                    fn()
                us = host_us_per_call(fn, args.iters, args.repeats)
            results[name] = us
        # The Python wrapper alone: the API with flare._C.decode replaced by a stub that does nothing.
        real_c = kvcache._C
        kvcache._C = types.SimpleNamespace(decode=lambda q, *rest: (q, q))
        try:
            results["api_wrapper_only"] = host_us_per_call(variants["api"], args.iters, args.repeats)
        finally:
            kvcache._C = real_c
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; decode bf16 batch {batch}, heads "
          f"{heads}/{heads_kv}, d {d}, cache {cache_len}, plan {plan.kernel} x{plan.num_splits} ({plan.source})")
    for name, us in results.items():
        extra = f"  (+{us - results['cpp']:.2f} us over cpp)" if name in ("op", "direct", "api", "api_autoplan") else ""
        print(f"  {name:14s} {us:7.2f} us/call host{extra}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
