#!/usr/bin/env python3
"""Markdown tables of flare's decode benchmark beside the SDPA peers of the same run.
Usage: compare_decode.py bench_decode.json peers_sdpa_decode.json [graph|plain]

Each peer backend is shown with the faster of its two GQA modes (gqa: enable_gqa=True; packed:
query heads folded into query rows), marked g or p. Speed-up = peer time / flare time."""
import json
import sys


def main():
    flare = json.load(open(sys.argv[1]))
    timing = sys.argv[3] if len(sys.argv) > 3 else "graph"
    metric = f"{timing}_us"
    peers = {}
    for r in json.load(open(sys.argv[2])):
        t, m = r["tags"], r["metrics"]
        key = (t["batch"], t["cache_len"], t["backend"])
        if key not in peers or m[metric] < peers[key][0]:
            peers[key] = (m[metric], t["mode"][0])
    by_layout = {}
    for r in flare:
        t = r["tags"]
        by_layout[(t["batch"], t["cache_len"], t["layout"])] = r["metrics"]

    backends = ["cudnn", "flash", "efficient", "math"]
    print(f"Timing: {timing} (us, median). Peers: faster GQA mode (g = enable_gqa, p = packed rows).\n")
    print("| batch | cache | flare us | splits | KV GB/s | of copy | cuDNN us | flash us | efficient us | math us"
          " | vs cuDNN | vs flash | page16 / contig | page64 / contig |")
    print("|" + "---|" * 14)
    for (b, L, layout), m in sorted(by_layout.items(), key=lambda x: (int(x[0][0]), int(x[0][1]))):
        if layout != "contiguous":
            continue
        us = m[metric]
        cells = []
        for be in backends:
            p = peers.get((b, L, be))
            cells.append(f"{p[0]:.1f} ({p[1]})" if p else "-")
        cu, fa = peers.get((b, L, "cudnn")), peers.get((b, L, "flash"))
        ratio = lambda layout: by_layout[(b, L, layout)][metric] / us if (b, L, layout) in by_layout else float("nan")
        gbps = m["kv_gbps"] * m["graph_us"] / us  # kv_gbps is measured from the graph time
        print(f"| {b} | {L} | {us:.1f} | {int(m['num_splits'])} | {gbps:.0f} | {gbps / m['copy_gbps']:.2f} | "
              + " | ".join(cells)
              + f" | {cu[0] / us:.2f} | {fa[0] / us:.2f} | {ratio('page16'):.3f} | {ratio('page64'):.3f} |"
              if cu and fa else f"| {b} | {L} | {us:.1f} | ... peers missing |")


if __name__ == "__main__":
    main()
