#!/usr/bin/env python3
"""Markdown table of flare's attention benchmark beside the SDPA peers of the same run: the portable
kernels against FA2 (issue 3's bar), the Hopper kernels against cuDNN (issues 4 and 5).
Usage: compare.py bench_attention.json peers_sdpa.json"""
import json
import sys


def main():
    flare = {}
    for r in json.load(open(sys.argv[1])):
        t = r["tags"]
        # "<case> backward <backend>" (older files: "<case> backward", the library's choice)
        kind = ("backward " + t["backend"]) if " backward" in r["name"] else t["backend"]
        flare.setdefault((t["head_dim"], t["seqlen"], t["causal"]), {})[kind] = r["metrics"]
    peers = {}
    for r in json.load(open(sys.argv[2])):
        t = r["tags"]
        peers[(t["head_dim"], t["seqlen"], t["causal"], t["backend"])] = r["metrics"]

    def num(x, fmt="{:.0f}"):
        return fmt.format(x) if x else "-"

    def ratio(a, b):
        return num(a and b and a / b, "{:.2f}")

    print("| head dim | seqlen | causal | portable fwd | FA2 fwd | portable / FA2 | portable bwd | portable det "
          "| det / ord | FA2 bwd | portable bwd / FA2 | Hopper fwd | cuDNN fwd | Hopper / cuDNN | Hopper bwd "
          "| Hopper det | det / ord | cuDNN bwd | Hopper bwd / cuDNN |")
    print("|" + "---|" * 19)
    for key, runs in flare.items():
        fa, cu = peers.get(key + ("flash",)), peers.get(key + ("cudnn",))
        if fa is None or cu is None:
            continue
        hop = runs.get("hopper", {}).get("tflops")
        port = runs.get("portable", {}).get("tflops")
        pb, hb = runs.get("backward portable", {}), runs.get("backward hopper", {})
        hd, s, causal = key
        print(f"| {hd} | {s} | {'yes' if causal == '1' else 'no'} "
              f"| {num(port)} | {fa['fwd_tflops']:.0f} | {ratio(port, fa['fwd_tflops'])} "
              f"| {num(pb.get('bwd_tflops'))} | {num(pb.get('bwd_det_tflops'))} "
              f"| {ratio(pb.get('bwd_det_tflops'), pb.get('bwd_tflops'))} | {fa['bwd_tflops']:.0f} "
              f"| {ratio(pb.get('bwd_tflops'), fa['bwd_tflops'])} "
              f"| {num(hop)} | {cu['fwd_tflops']:.0f} | {ratio(hop, cu['fwd_tflops'])} "
              f"| {num(hb.get('bwd_tflops'))} | {num(hb.get('bwd_det_tflops'))} "
              f"| {ratio(hb.get('bwd_det_tflops'), hb.get('bwd_tflops'))} | {cu['bwd_tflops']:.0f} "
              f"| {ratio(hb.get('bwd_tflops'), cu['bwd_tflops'])} |")


if __name__ == "__main__":
    main()
