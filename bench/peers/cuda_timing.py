"""The peer scripts' timer: median of CUDA-event timings of fn() after `warmup` untimed calls
(Triton and torch.compile compile during the warm-up). Imported by the scripts beside it (run as
`python3 bench/peers/NAME.py`, which puts this folder on sys.path)."""
import statistics


def time_ms(fn, warmup, repeats, calls=1):
    """calls > 1: each sample times that many back-to-back calls (divided by them), so that the host's
    time per call, which an isolated call puts between the events while the GPU waits, overlaps the
    GPU's work instead: the difference to calls=1 is the host overhead a single call exposes."""
    import torch  # here, so that a script without torch can still import this module and say so

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)
