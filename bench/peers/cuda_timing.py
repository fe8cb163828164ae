"""The peer scripts' timer: median of CUDA-event timings of fn() after `warmup` untimed calls
(Triton and torch.compile compile during the warm-up), L2 flushed before every sample as flare's
own benchmarks do (bench/common: a buffer of twice the L2 rewritten, outside the events), so that a
peer's inputs start in HBM as flare's do. Imported by the scripts beside it (run as
`python3 bench/peers/NAME.py`, which puts this folder on sys.path)."""
import statistics


class L2Flush:
    """Rewrites a buffer of twice the device's L2 (a different byte each time, so no rewrite is a
    no-op): nothing of the previous sample stays in L2. FLARE_BENCH_FLUSH=read reads it instead
    (L2 left full of clean lines), as the C++ harness does under the same variable."""

    def __init__(self):
        import os

        import torch

        l2 = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
        self.buf = torch.zeros(2 * max(l2, 1 << 20), dtype=torch.uint8, device="cuda")
        self.words = self.buf.view(torch.int32)
        self.read = os.environ.get("FLARE_BENCH_FLUSH") == "read"
        self.value = 0

    def __call__(self):
        if self.read:
            self.words.max()  # reads every byte; the one-element result is dropped
            return
        self.value ^= 1
        self.buf.fill_(self.value)


_flush = None


def l2_flush():
    """The process's one flush buffer (allocated on first use)."""
    global _flush
    if _flush is None:
        _flush = L2Flush()
    return _flush


def cool_down():
    """FLARE_BENCH_COOLDOWN_MS=N: the device idle N ms before a measurement's samples (after its
    warm-up; the caller has synchronized), as the C++ harness does under the same variable."""
    import os
    import time

    ms = int(os.environ.get("FLARE_BENCH_COOLDOWN_MS", "0") or 0)
    if ms > 0:
        time.sleep(ms / 1000)


def time_ms(fn, warmup, repeats, calls=1, flush=True):
    """calls > 1: each sample times that many back-to-back calls (divided by them), so that the host's
    time per call, which an isolated call puts between the events while the GPU waits, overlaps the
    GPU's work instead: the difference to calls=1 is the host overhead a single call exposes. The
    flush (flush=False: none, L2 kept warm between samples) precedes the first call of a sample."""
    import torch  # here, so that a script without torch can still import this module and say so

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    cool_down()
    times = []
    for _ in range(repeats):
        if flush:
            l2_flush()()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)
