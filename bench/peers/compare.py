#!/usr/bin/env python3
"""Markdown table of flare's attention benchmark beside the SDPA peers of the same run: the portable
kernels against FA2 (issue 3's bar), the Hopper kernels against cuDNN (issues 4 and 5).
Usage: compare.py bench_attention.json[:D[,D...]] [more bench files...] peers_sdpa.json
A bench file's ":D" suffix keeps only those head dims from it: a build with reduced FLARE_HEAD_DIMS
also times the other head dims on the next instantiated kernel up (d64 on a d256 build's kernel),
so merging several such builds' files needs it, e.g. d64.json:64 d128.json:128 d256.json:256."""
import json
import sys


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    flare = {}
    records = []
    for spec in sys.argv[1:-1]:
        path, _, dims = spec.partition(":")
        keep = set(dims.split(",")) if dims else None
        records += [r for r in json.load(open(path)) if keep is None or r["tags"]["head_dim"] in keep]
    for r in records:
        t = r["tags"]
        # "<case> backward <backend>" (older files: "<case> backward", the library's choice)
        kind = ("backward " + t["backend"]) if " backward" in r["name"] else t["backend"]
        flare.setdefault((t["head_dim"], t["seqlen"], t["causal"]), {})[kind] = r["metrics"]
    peers = {}
    for r in json.load(open(sys.argv[-1])):
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
