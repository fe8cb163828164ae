#!/usr/bin/env python3
"""Markdown table of flare's attention benchmark beside the SDPA peers of the same run: the portable
kernels against FA2 (issue 3's bar), the Hopper kernels against cuDNN (issues 4 and 5).
Usage: compare.py bench_attention.json[:D[,D...]] [more bench files...] peers_sdpa.json [next round...]
A bench file's ":D" suffix keeps only those head dims from it: a build with reduced FLARE_HEAD_DIMS
also times the other head dims on the next instantiated kernel up (d64 on a d256 build's kernel),
so merging several such builds' files needs it, e.g. d64.json:64 d128.json:128 d256.json:256.

Rounds: each peers file (sdpa_attention.py's records: backends cudnn and flash) closes a round of
the bench files before it. With several rounds (flare and the peers run alternately, so that each
round's pair saw the same machine state) every TFLOP/s cell is the median over the rounds and every
ratio the median of the rounds' own ratios, followed by their range: "1.08 (1.05-1.12)"."""
import json
import statistics
import sys

PEER_BACKENDS = {"cudnn", "flash"}


def load_round(bench_specs, peers_records):
    flare = {}
    for spec in bench_specs:
        path, _, dims = spec.partition(":")
        keep = set(dims.split(",")) if dims else None
        for r in json.load(open(path)):
            t = r["tags"]
            if keep is not None and t["head_dim"] not in keep:
                continue
            # "<case> backward <backend>" (older files: "<case> backward", the library's choice)
            kind = ("backward " + t["backend"]) if " backward" in r["name"] else t["backend"]
            flare.setdefault((t["head_dim"], t["seqlen"], t["causal"]), {})[kind] = r["metrics"]
    peers = {}
    for r in peers_records:
        t = r["tags"]
        peers[(t["head_dim"], t["seqlen"], t["causal"], t["backend"])] = r["metrics"]
    return flare, peers


def rounds_of(args):
    """[(bench specs, peers records)] in order: a file whose records are the peers' closes a round."""
    rounds, pending = [], []
    for spec in args:
        path = spec.partition(":")[0]
        records = json.load(open(path))
        if records and all(r["tags"].get("backend") in PEER_BACKENDS for r in records):
            rounds.append((pending, records))
            pending = []
        else:
            pending.append(spec)
    if pending or not rounds:
        sys.exit("compare.py: every round ends with a peers file (sdpa_attention.py --json)\n\n" + __doc__)
    return rounds


def row_values(flare_runs, peers, key):
    """The 19-column row's numbers for one round (None where a value is missing)."""
    fa, cu = peers.get(key + ("flash",)), peers.get(key + ("cudnn",))
    if fa is None or cu is None or key not in flare_runs:
        return None
    runs = flare_runs[key]
    hop = runs.get("hopper", {}).get("tflops")
    port = runs.get("portable", {}).get("tflops")
    pb, hb = runs.get("backward portable", {}), runs.get("backward hopper", {})

    def ratio(a, b):
        return a / b if a and b else None

    return [
        port, fa["fwd_tflops"], ratio(port, fa["fwd_tflops"]),
        pb.get("bwd_tflops"), pb.get("bwd_det_tflops"), ratio(pb.get("bwd_det_tflops"), pb.get("bwd_tflops")),
        fa["bwd_tflops"], ratio(pb.get("bwd_tflops"), fa["bwd_tflops"]),
        hop, cu["fwd_tflops"], ratio(hop, cu["fwd_tflops"]),
        hb.get("bwd_tflops"), hb.get("bwd_det_tflops"), ratio(hb.get("bwd_det_tflops"), hb.get("bwd_tflops")),
        cu["bwd_tflops"], ratio(hb.get("bwd_tflops"), cu["bwd_tflops"]),
    ]


RATIO_COLUMNS = {2, 5, 7, 10, 13, 15}


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    rounds = [load_round(specs, peers) for specs, peers in rounds_of(sys.argv[1:])]
    print("| head dim | seqlen | causal | portable fwd | FA2 fwd | portable / FA2 | portable bwd | portable det "
          "| det / ord | FA2 bwd | portable bwd / FA2 | Hopper fwd | cuDNN fwd | Hopper / cuDNN | Hopper bwd "
          "| Hopper det | det / ord | cuDNN bwd | Hopper bwd / cuDNN |")
    print("|" + "---|" * 19)
    for key in rounds[0][0]:
        per_round = [v for v in (row_values(f, p, key) for f, p in rounds) if v is not None]
        if not per_round:
            continue
        cells = []
        for col in range(len(per_round[0])):
            xs = [v[col] for v in per_round if v[col]]
            if not xs:
                cells.append("-")
            elif col in RATIO_COLUMNS:
                med = f"{statistics.median(xs):.2f}"
                cells.append(med if len(xs) == 1 else f"{med} ({min(xs):.2f}-{max(xs):.2f})")
            else:
                cells.append(f"{statistics.median(xs):.0f}")
        hd, s, causal = key
        print(f"| {hd} | {s} | {'yes' if causal == '1' else 'no'} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
