"""flare beside its PyTorch peers, from Python: forward and backward TFLOP/s against sequence length.

Implementations (each on its own layout's contiguous inputs):
  flare        flare.flash_attn_func (the dense kernels: Hopper on sm_90), [B, S, H, D]
  flare_flex   flare.flex_attention with a BlockMask (flare's block-sparse kernels; no mask: dense)
  cudnn, flash PyTorch SDPA backends (cuDNN, FlashAttention-2), [B, H, S, D]; no sliding window
  flex         torch.compile(torch.nn.attention.flex_attention) with the same BlockMask
Configuration as bench/bench_attention and bench/peers/sdpa_attention.py: bf16, 16k tokens, hidden
2048 (heads = 2048 / head_dim, batch = 16384 / seqlen); masks none, causal and a causal sliding
window. FLOPs as FlashAttention counts them (4 * b * h * s * s * d, halved for causal; the window
counts its visible pairs; backward 2.5x), median of CUDA-event timings after warm-up.

Writes markdown tables (stdout), JSON (--json) and, where matplotlib imports, one PNG per mask and
head dim under --results (default: $OUT/results, else bench/results): TFLOP/s against sequence
length, forward and backward side by side. --plot-only JSON redraws the plots from a saved run.

    python3 python/bench_peers.py [--quick] [--head-dims 64,128] [--masks none,causal,window]
"""

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
IMPLS = ("flare", "flare_flex", "cudnn", "flash", "flex")
LABELS = {"flare": "flare (flash_attn_func)", "flare_flex": "flare flex_attention", "cudnn": "SDPA cuDNN",
          "flash": "SDPA flash (FA2)", "flex": "FlexAttention (torch.compile)"}
COLORS = {"flare": "C0", "flare_flex": "C1", "cudnn": "C2", "flash": "C3", "flex": "C4"}  # the same in every plot
TOKENS, HIDDEN = 16384, 2048
_compiled_flex = None  # torch.compile(flex_attention), made once


def time_ms(fn, warmup=5, repeats=20):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def visible_pairs(seqlen, mask, window):
    if mask == "none":
        return seqlen * seqlen
    if mask == "causal":
        return seqlen * seqlen / 2  # FlashAttention's count
    w = min(window, seqlen - 1)  # causal window: row i sees min(i, w) + 1 keys
    return seqlen * (w + 1) - w * (w + 1) / 2


def mask_mod_of(mask, window):
    import flare
    return {"none": None, "causal": flare.masks.causal(), "window": flare.masks.sliding_window(window)}[mask]


def runners(mask, window, b, h, s, d):
    """Per implementation: a function building its inputs and returning (forward, inputs)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    import flare

    dtype = torch.bfloat16

    def tensors(shape):
        return [torch.randn(*shape, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3)]

    mask_mod = mask_mod_of(mask, window)
    block_mask = None if mask_mod is None else create_block_mask(mask_mod, None, None, s, s, device="cuda")
    window_size = (window, 0) if mask == "window" else (-1, -1)

    def flare_dense():
        q, k, v = tensors((b, s, h, d))
        return (lambda: flare.flash_attn_func(q, k, v, causal=mask == "causal", window_size=window_size)), (q, k, v)

    def flare_flex():
        q, k, v = tensors((b, h, s, d))
        if block_mask is not None:
            flare.prepare_block_mask(block_mask)
        return (lambda: flare.flex_attention(q, k, v, block_mask=block_mask)), (q, k, v)

    def sdpa(backend):
        def make():
            if mask == "window":
                raise RuntimeError("no sliding window in SDPA's fused backends")
            q, k, v = tensors((b, h, s, d))

            def fwd():
                with sdpa_kernel([backend]):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=mask == "causal")
            return fwd, (q, k, v)
        return make

    def torch_flex():
        global _compiled_flex
        if _compiled_flex is None:
            _compiled_flex = torch.compile(flex_attention, dynamic=False)
        q, k, v = tensors((b, h, s, d))
        return (lambda: _compiled_flex(q, k, v, block_mask=block_mask)), (q, k, v)

    return {"flare": flare_dense, "flare_flex": flare_flex, "cudnn": sdpa(SDPBackend.CUDNN_ATTENTION),
            "flash": sdpa(SDPBackend.FLASH_ATTENTION), "flex": torch_flex}


def measure(args):
    seqlens = [1024, 4096] if args.quick else [1024, 2048, 4096, 8192, 16384]
    records = []
    for mask in args.masks:
        for d in args.head_dims:
            for s in seqlens:
                b, h = max(1, TOKENS // s), HIDDEN // d
                flops = 4 * b * h * d * visible_pairs(s, mask, args.window)
                for impl, make in runners(mask, args.window, b, h, s, d).items():
                    if impl not in args.impls:
                        continue
                    name = f"{mask} d{d} s{s} {impl}"
                    try:
                        fwd, inputs = make()
                        fwd_ms = time_ms(fwd)
                        bwd_ms = float("nan")
                        if not args.no_backward:
                            out = fwd()
                            grad = torch.randn_like(out)
                            bwd_ms = time_ms(lambda: torch.autograd.grad(out, inputs, grad, retain_graph=True))
                    except Exception as e:  # an implementation without this case: say so, go on
                        print(f"{name:32s} unsupported: {str(e).splitlines()[0][:90]}", flush=True)
                        continue
                    finally:
                        fwd = inputs = out = grad = None
                        torch.cuda.empty_cache()
                    rec = {"mask": mask, "head_dim": d, "seqlen": s, "batch": b, "heads": h, "impl": impl,
                           "fwd_ms": fwd_ms, "fwd_tflops": flops / fwd_ms / 1e9,
                           "bwd_ms": bwd_ms, "bwd_tflops": 2.5 * flops / bwd_ms / 1e9}
                    records.append(rec)
                    print(f"{name:32s} fwd {fwd_ms:8.3f} ms {rec['fwd_tflops']:7.1f} TF/s   "
                          f"bwd {bwd_ms:8.3f} ms {rec['bwd_tflops']:7.1f} TF/s", flush=True)
    return records


def tables(records, window):
    """Markdown tables, one per mask: TFLOP/s per implementation, and flare over the best peer."""
    by_key = {}
    for r in records:
        by_key.setdefault((r["mask"], r["head_dim"], r["seqlen"]), {})[r["impl"]] = r
    impls = [i for i in IMPLS if any(r["impl"] == i for r in records)]
    peers = [i for i in impls if not i.startswith("flare")]
    for mask in dict.fromkeys(r["mask"] for r in records):
        title = {"none": "no mask", "causal": "causal", "window": f"causal sliding window {window}"}[mask]
        print(f"\n### {title} (bf16, {TOKENS} tokens, hidden {HIDDEN}): TFLOP/s forward / backward\n")
        print("| head dim | seqlen | " + " | ".join(LABELS[i] for i in impls) + " | flare / best peer fwd | "
              "flare / best peer bwd |")
        print("|" + "---|" * (len(impls) + 4))
        for (m, d, s), runs in sorted(by_key.items()):
            if m != mask:
                continue
            cells = []
            for i in impls:
                r = runs.get(i)
                cells.append("-" if r is None else f"{r['fwd_tflops']:.0f} / {r['bwd_tflops']:.0f}")

            def ratio(field):
                best_flare = max((runs[i][field] for i in ("flare", "flare_flex") if i in runs), default=None)
                best_peer = max((runs[i][field] for i in peers if i in runs and runs[i][field] == runs[i][field]),
                                default=None)
                return f"{best_flare / best_peer:.2f}" if best_flare and best_peer else "-"
            print(f"| {d} | {s} | " + " | ".join(cells) + f" | {ratio('fwd_tflops')} | {ratio('bwd_tflops')} |")


def plots(records, results, window):
    """One PNG per (mask, head dim): TFLOP/s against sequence length, forward and backward."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("\nplots: matplotlib is not importable here; skipped (pip install matplotlib, then "
              "python3 python/bench_peers.py --plot-only RESULTS.json)")
        return []
    results.mkdir(parents=True, exist_ok=True)
    written = []
    groups = dict.fromkeys((r["mask"], r["head_dim"]) for r in records)
    for mask, d in groups:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=False)
        for ax, field, what in ((axes[0], "fwd_tflops", "forward"), (axes[1], "bwd_tflops", "backward")):
            for impl in IMPLS:
                rows = sorted((r["seqlen"], r[field]) for r in records
                              if r["mask"] == mask and r["head_dim"] == d and r["impl"] == impl
                              and r[field] == r[field])
                if rows:
                    style = "-o" if impl.startswith("flare") else "--s"
                    ax.plot([x for x, _ in rows], [y for _, y in rows], style, color=COLORS[impl], label=LABELS[impl],
                            markersize=4)
            ax.set_xscale("log", base=2)
            seqlens = sorted({r["seqlen"] for r in records})
            ax.set_xticks(seqlens, [f"{x // 1024}k" if x >= 1024 else str(x) for x in seqlens])
            ax.set_ylim(bottom=0)
            ax.set_xlabel("sequence length (tokens per sequence; 16k tokens per batch)")
            ax.set_ylabel("TFLOP/s")
            ax.set_title(what)
            ax.grid(True, alpha=0.3)
        title = {"none": "no mask", "causal": "causal", "window": f"causal sliding window {window}"}[mask]
        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "saved run"
        fig.suptitle(f"attention, bf16, head dim {d}, {title} ({device})")
        axes[1].legend(fontsize=8, loc="lower right")
        fig.tight_layout()
        path = results / f"peers_{mask}_d{d}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
        print(f"plot: {path}")
    return written


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="seqlens 1k and 4k only")
    ap.add_argument("--head-dims", default="64,128", help="comma-separated (default 64,128)")
    ap.add_argument("--masks", default="none,causal,window", help="none, causal, window (comma-separated)")
    ap.add_argument("--window", type=int, default=1024, help="left window of the sliding-window mask")
    ap.add_argument("--impls", default=",".join(IMPLS), help=f"comma-separated subset of {','.join(IMPLS)}")
    ap.add_argument("--no-backward", action="store_true")
    ap.add_argument("--json", help="write the measurements here")
    ap.add_argument("--results", help="folder of the PNG plots (default: $OUT/results, else bench/results)")
    ap.add_argument("--plot-only", metavar="JSON", help="redraw tables and plots from a saved --json, no GPU")
    args = ap.parse_args()
    args.head_dims = [int(x) for x in args.head_dims.split(",")]
    args.masks = args.masks.split(",")
    args.impls = args.impls.split(",")
    results = Path(args.results) if args.results else (Path(os.environ["OUT"]) / "results" if os.environ.get("OUT")
                                                       else ROOT / "bench" / "results")
    if args.plot_only:
        records = json.load(open(args.plot_only))
    else:
        if not torch.cuda.is_available():
            print("bench_peers: no CUDA device (use --plot-only JSON to redraw a saved run)")
            return 1
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        records = measure(args)
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            with open(args.json, "w") as f:
                json.dump(records, f, indent=1)
    tables(records, args.window)
    plots(records, results, args.window)
    return 0


if __name__ == "__main__":
    sys.exit(main())
