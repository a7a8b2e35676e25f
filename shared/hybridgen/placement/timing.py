"""The one timer of the start-up measurements: the op-region timings (placement/region_timing.py)
and the Cold-Weights latency model's calibration (experts/latency.py); the CPU expert
benchmark (bench/cpu_expert_bench.py) times with it too, so it times what the model sees."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch


def best_of(n: int, fn: Callable[[], object], device: torch.device) -> float:
    """Shortest wall time in seconds of n calls, after one warm-up call, each call waited
    for on the device."""
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    fn()
    sync()
    best = math.inf
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


@contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """torch's intra-op pool at `n` threads inside the block (None: as it is), then back:
    the CPU's share is timed at the thread count it will run at."""
    before = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
