#!/usr/bin/env python3
"""Markdown table of flare's attention benchmark beside the SDPA peers of the same run.
Usage: compare.py bench_attention.json peers_sdpa.json"""
import json
import sys


def main():
    flare = {}
    for r in json.load(open(sys.argv[1])):
        t = r["tags"]
        kind = "backward" if r["name"].endswith(" backward") else t["backend"]
        flare.setdefault((t["head_dim"], t["seqlen"], t["causal"]), {})[kind] = r["metrics"]
    peers = {}
    for r in json.load(open(sys.argv[2])):
        t = r["tags"]
        peers[(t["head_dim"], t["seqlen"], t["causal"], t["backend"])] = r["metrics"]

    def num(x, fmt="{:.0f}"):
        return fmt.format(x) if x else "-"

    print("| head dim | seqlen | causal | flare Hopper fwd | flare portable fwd | FA2 fwd | cuDNN fwd "
          "| Hopper / cuDNN | portable / FA2 | flare bwd | flare det bwd | det / ord | FA2 bwd | cuDNN bwd | bwd / FA2 "
          "| bwd / cuDNN |")
    print("|" + "---|" * 17)
    for key, runs in flare.items():
        fa, cu = peers.get(key + ("flash",)), peers.get(key + ("cudnn",))
        if fa is None or cu is None:
            continue
        hop = runs.get("hopper", {}).get("tflops")
        port = runs.get("portable", {}).get("tflops")
        bwd = runs.get("backward", {})
        det = bwd["bwd_ms"] / bwd["bwd_det_ms"] if bwd.get("bwd_det_ms") else None
        hd, s, causal = key
        print(f"| {hd} | {s} | {'yes' if causal == '1' else 'no'} | {num(hop)} | {num(port)} "
              f"| {fa['fwd_tflops']:.0f} | {cu['fwd_tflops']:.0f} "
              f"| {num(hop and hop / cu['fwd_tflops'], '{:.2f}')} | {num(port and port / fa['fwd_tflops'], '{:.2f}')} "
              f"| {num(bwd.get('bwd_tflops'))} | {num(bwd.get('bwd_det_tflops'))} | {num(det, '{:.2f}')} "
              f"| {fa['bwd_tflops']:.0f} | {cu['bwd_tflops']:.0f} "
              f"| {num(bwd.get('bwd_tflops') and bwd['bwd_tflops'] / fa['bwd_tflops'], '{:.2f}')} "
              f"| {num(bwd.get('bwd_tflops') and bwd['bwd_tflops'] / cu['bwd_tflops'], '{:.2f}')} |")


if __name__ == "__main__":
    main()
