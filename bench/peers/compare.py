#!/usr/bin/env python3
"""Markdown table of flare's attention benchmark beside the SDPA peers of the same run.
Usage: compare.py bench_attention.json peers_sdpa.json"""
import json
import sys


def main():
    flare = json.load(open(sys.argv[1]))
    peers = {}
    for r in json.load(open(sys.argv[2])):
        t = r["tags"]
        peers[(t["head_dim"], t["seqlen"], t["causal"], t["backend"])] = r["metrics"]
    print("| head dim | seqlen | causal | flare fwd | FA2 fwd | cuDNN fwd | fwd / FA2 | flare bwd | flare det bwd"
          " | det / ord | FA2 bwd | cuDNN bwd | bwd / FA2 |")
    print("|" + "---|" * 13)
    for r in flare:
        t, m = r["tags"], r["metrics"]
        key = (t["head_dim"], t["seqlen"], t["causal"])
        fa, cu = peers.get(key + ("flash",)), peers.get(key + ("cudnn",))
        if fa is None or cu is None:
            continue
        det = m["bwd_ms"] / m["bwd_det_ms"] if m.get("bwd_det_ms") else float("nan")
        print(f"| {t['head_dim']} | {t['seqlen']} | {'yes' if t['causal'] == '1' else 'no'} | {m['tflops']:.0f} "
              f"| {fa['fwd_tflops']:.0f} | {cu['fwd_tflops']:.0f} | {m['tflops'] / fa['fwd_tflops']:.2f} "
              f"| {m['bwd_tflops']:.0f} | {m['bwd_det_tflops']:.0f} | {det:.2f} | {fa['bwd_tflops']:.0f} "
              f"| {cu['bwd_tflops']:.0f} | {m['bwd_tflops'] / fa['bwd_tflops']:.2f} |")


if __name__ == "__main__":
    main()
