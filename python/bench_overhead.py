"""Host time per call of flare's Python path against the C++ launch, on a small decode step.

The GPU is first put to sleep (torch.cuda._sleep) so that every timed launch only queues: the wall
time of a loop of launches is then the host's cost per call, whatever the kernel's duration.
Variants, each `--iters` calls per loop, one loop of each per round, `--repeats` rounds:
  cpp            flare::decode_run in a C++ loop (plan made once): the C++ launch
  op             torch.ops.flare.decode (dispatcher + binding, plan re-derived per call)
  direct         flare._C.decode: the binding without the dispatcher (the API's eager path)
  api            flare.flash_attn_with_kvcache with num_splits and workspace from plan_kvcache
  api_autoplan   flare.flash_attn_with_kvcache with no plan given (plans, allocates its workspace)
  api_wrapper_only  the API's Python code alone (flare._C.decode stubbed out)
  decoder        flare.KVCacheDecoder(...).run: planned once, the binding called with no Python between
  decoder_out    the same with out= (the step allocates nothing)
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


def asleep(measure):
    """measure() while the GPU sleeps (~0.1 s of GPU time): the launches it makes only queue."""
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)
    result = measure()
    torch.cuda.synchronize()
    return result


def host_us_per_call(fn, iters):
    def loop():
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - start) / iters * 1e6
    return asleep(loop)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=25)
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
    decoder = flare.KVCacheDecoder(q, k_cache, v_cache, causal=True, workspace=ws)
    run = decoder.run
    out_buf = torch.empty_like(q)

    variants = {
        "cpp": None,
        "op": lambda: decode(q, k_cache, v_cache, seqlens, None, ws, 0.0, True, -1, plan.num_splits, False),
        "direct": lambda: _C.decode(q, k_cache, v_cache, seqlens, None, ws, 0.0, True, -1, plan.num_splits,
                                    False),
        "api": lambda: flare.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, causal=True,
                                                     num_splits=plan.num_splits, workspace=ws),
        "api_autoplan": lambda: flare.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens,
                                                              causal=True),
        "decoder": lambda: run(q, k_cache, v_cache, seqlens),
        "decoder_out": lambda: run(q, k_cache, v_cache, seqlens, out=out_buf),
    }
    qf = torch.randn(1, 64, 8, 64, device=dev, dtype=torch.bfloat16)
    variants["fwd_api"] = lambda: flare.flash_attn_func(qf, qf, qf, causal=True)
    variants["fwd_op"] = lambda: torch.ops.flare.fwd(qf, qf, qf, None, None, 0, 0, None, 0.0, True, -1, -1, 0.0,
                                                     False)

    def cpp_loop():
        return 1e6 * _C.bench_decode_run_loop(q, k_cache, v_cache, seqlens, ws, plan.num_splits, args.iters)

    # The Python wrapper alone: the API with flare._C.decode replaced by a stub that does nothing.
    real_c = kvcache._C
    stub_c = types.SimpleNamespace(decode=lambda q, *rest: (q, q))

    def wrapper_only():
        kvcache._C = stub_c
        try:
            return host_us_per_call(variants["api"], args.iters)
        finally:
            kvcache._C = real_c

    # Rounds: every variant once per round, in the same order, so a slow stretch of the (virtual)
    # host hits all of them alike; each variant's figure is its median over the rounds, and the
    # overhead of a path is the median over rounds of (path - cpp) within the round.
    samples = {name: [] for name in variants}
    samples["api_wrapper_only"] = []
    with torch.no_grad():
        for name, fn in variants.items():
            if fn is not None:
                for _ in range(20):
                    fn()
        for _ in range(args.repeats):
            for name, fn in variants.items():
                samples[name].append(asleep(cpp_loop) if fn is None else host_us_per_call(fn, args.iters))
            samples["api_wrapper_only"].append(wrapper_only())
    results = {name: statistics.median(v) for name, v in samples.items()}
    over = {name: statistics.median(a - c for a, c in zip(samples[name], samples["cpp"]))
            for name in ("op", "direct", "api", "api_autoplan", "decoder", "decoder_out")}
    quartiles = {name: statistics.quantiles([a - c for a, c in zip(samples[name], samples["cpp"])], n=4)
                 for name in over}
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; decode bf16 batch {batch}, heads "
          f"{heads}/{heads_kv}, d {d}, cache {cache_len}, plan {plan.kernel} x{plan.num_splits} ({plan.source})")
    for name, us in results.items():
        extra = (f"  (+{over[name]:.2f} us over cpp, median of the rounds; quartiles {quartiles[name][0]:+.2f} "
                 f"{quartiles[name][2]:+.2f})" if name in over else "")
        print(f"  {name:14s} {us:7.2f} us/call host{extra}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"median_us": results, "over_cpp_us": over, "over_cpp_quartiles_us": quartiles,
                       "samples": samples}, f, indent=1)


if __name__ == "__main__":
    main()
