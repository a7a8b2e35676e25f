"""The Warm tier's counters since start: what GetModelInfo, the metrics and the logs report."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from hybridgen.kvtiers.warm_attention import WarmAttnStats


@dataclass
class WarmStats:
    """Counters of the Warm tier since start (the engine's "Warm" metrics)."""

    spilled_blocks: int = 0
    """Hot blocks moved to Warm to make room."""
    swapped_blocks: int = 0
    """Hot blocks moved to Warm by preemption (instead of recomputing them later)."""
    loaded_blocks: int = 0
    """Warm blocks copied back into Hot when their sequence was (re)admitted with room."""
    d2h_bytes: int = 0
    """Compressed bytes written to the Warm pool."""
    h2d_bytes: int = 0
    """Compressed bytes copied to the device or read by it in place (gpu and split modes,
    prefill)."""
    hot_keys: int = 0
    """Keys decode steps attended in Hot (per step, not per layer)."""
    warm_keys: int = 0
    """Keys decode steps attended in Warm (per step, not per layer)."""
    cold_blocks: int = 0
    """Cached Warm blocks moved to Cold after cold_threshold_ms unused."""
    promoted_blocks: int = 0
    """Cold blocks brought back to Warm by a prefix hit."""
    cpu: WarmAttnStats = field(default_factory=WarmAttnStats)
    """CPU mode: decompression and attention time, summed."""
    decompress_ms: deque[float] = field(default_factory=lambda: deque(maxlen=4096))
    """Recent Warm Decompress Latencies: one per (layer, step) call that decoded blocks,
    host-side time including the copy out of shm (and to the device in gpu mode). Kernels
    that read the pool in place on CUDA (warm_device) decode on the device: not counted."""

    def record_decompress(self, seconds: float) -> None:
        self.decompress_ms.append(seconds * 1e3)

    def decompress_percentile(self, q: float) -> float:
        """The q-th percentile (0..100) of the recent decompress latencies in ms; 0 if none."""
        return float(np.percentile(self.decompress_ms, q)) if self.decompress_ms else 0.0

    @property
    def hot_hit_rate(self) -> float:
        """Share of attended keys that were in Hot (1.0 before any Warm use)."""
        total = self.hot_keys + self.warm_keys
        return self.hot_keys / total if total else 1.0
