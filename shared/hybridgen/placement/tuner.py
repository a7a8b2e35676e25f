"""Dynamic tuning (config `dynamic_tuning`): attn_warm's split re-balanced from live timings.

The start-up probe times 512 synthetic blocks of one layer; serving has other shapes (more
sequences, longer Warm prefixes, a busy CPU). So while attn_warm runs split, every decode step
times both shares (the device's with CUDA events, read later, so that no step waits; the
CPU's with the host clock) and counts their blocks. After `warmup_steps`, every
`interval_s` the tuner sets the CPU share so that both would finish together at the measured
per-block costs::

    share = gpu_s_per_block / (cpu_s_per_block + gpu_s_per_block)

Its own cost (the bookkeeping per step and the updates) is measured against the wall time
since start; above MAX_OVERHEAD it halves its update rate.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

import structlog
import torch

log = structlog.get_logger()

MAX_OVERHEAD = 0.03
"""The tuner's CPU time as a share of wall time it may take."""


@dataclass
class SplitTiming:
    """One interval's cost of the two shares of attn_warm split."""

    cpu_s: float = 0.0
    cpu_blocks: int = 0
    gpu_s: float = 0.0
    gpu_blocks: int = 0
    pending: list[tuple[torch.cuda.Event, torch.cuda.Event, int]] = field(default_factory=list)
    """Device shares timed by CUDA events, read at the next update (by then complete)."""

    def settle(self) -> None:
        for start, end, blocks in self.pending:
            self.gpu_s += start.elapsed_time(end) / 1e3
            self.gpu_blocks += blocks
        self.pending.clear()


class SplitOwner(Protocol):
    """What the tuner changes: the Warm tier's attn_warm mode and CPU share."""

    mode: str
    split: float


class Tuner:
    """Re-decides the Warm tier's CPU share (warm.split) while serving."""

    def __init__(self, warm_split: SplitOwner, warmup_steps: int, interval_ms: int) -> None:
        self.warm = warm_split
        self.warmup_steps, self.interval_s = warmup_steps, interval_ms / 1e3
        self.timing = SplitTiming()
        self.updates = 0
        self.busy_s = 0.0
        """The tuner's own time: bookkeeping in the step and the updates."""
        self._start = time.perf_counter()
        self._next = self._start + self.interval_s

    def overhead(self) -> float:
        """The tuner's time as a share of the wall time since start."""
        return self.busy_s / max(time.perf_counter() - self._start, 1e-9)

    def on_step(self, steps: int) -> None:
        """After each engine step: update the share when an interval has passed."""
        now = time.perf_counter()
        if steps < self.warmup_steps or now < self._next:
            return
        t = self.timing
        t.settle()
        if t.cpu_blocks and t.gpu_blocks and self.warm.mode == "split":
            cpu, gpu = t.cpu_s / t.cpu_blocks, t.gpu_s / t.gpu_blocks
            old, self.warm.split = self.warm.split, gpu / (cpu + gpu)
            self.updates += 1
            log.info(
                "attn_warm_tuned",
                cpu_share=round(self.warm.split, 3),
                was=round(old, 3),
                cpu_ms_per_block=cpu * 1e3,
                gpu_ms_per_block=gpu * 1e3,
                overhead=round(self.overhead(), 4),
            )
        self.timing = SplitTiming()
        if self.overhead() > MAX_OVERHEAD:
            self.interval_s *= 2
        done = time.perf_counter()
        self.busy_s += done - now
        self._next = done + self.interval_s
