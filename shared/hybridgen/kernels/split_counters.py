"""Counters at zero on a device, for kernels whose last program to finish a piece of work
sums what the others left (a split-K GEMV's slices, triton_dense_quant): each
program adds 1 to its piece's counter; the one that reads `programs - 1` does the sum and
puts the counter back to 0, so the next launch, or the next replay of a CUDA graph that
captured the same counters, finds them at zero. No launch of its own for the sum.

Shared by the launches of one stream (the engine's forward runs on one): two launches on
streams that run at once must not share them.
"""

from __future__ import annotations

import torch
from torch import Tensor

_HELD: dict[torch.device, list[Tensor]] = {}
"""Each device's counters, the newest last (older ones stay alive: a captured CUDA graph may
hold them)."""

MIN_COUNTERS = 4096


def counters(device: torch.device, n: int) -> Tensor:
    """At least n int32 counters at zero on `device`, which every launch leaves at zero."""
    held = _HELD.setdefault(device, [])
    if not held or held[-1].numel() < n:
        held.append(torch.zeros(max(n, MIN_COUNTERS), dtype=torch.int32, device=device))
    return held[-1]
