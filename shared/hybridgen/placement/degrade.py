"""Backpressure degrade (DESIGN.md "Dual-heartbeat scheduling").

When the GPU daemon cannot take waiting requests (no free Hot blocks, or every sequence slot
busy) it sends BACKPRESSURE; the CPU daemon answers with a degrade command, and while it
holds the engine shifts hybrid-aware regions toward the CPU:

    region      normal                      degraded
    sample      placements.sample (gpu)     cpu: the softmax and the pick in fp32 on the CPU
                                            daemon, from each row's top-k logits (unless
                                            placements.softmax pins gpu, or its work is at
                                            or above offload_threshold.softmax)
    attn_warm   as placed                   the CPU attends DEGRADE_WARM_SHARE more of each
                                            sequence's Warm blocks (gpu -> split)

When the pressure ends the CPU daemon lifts the command and every placement goes back. The
Warm tier already spills Hot blocks on demand, so eviction needs no extra step here. Exact
modes give the same tokens either way: the CPU pick and the split attention are exact. Not in
mode pure_gpu, which keeps the CPU out of the step.

A shift must pay: a region whose CPU side was measured slower at start (sample's timing,
attn_warm's probe when it placed the Warm blocks on the device) stays where it is, since
moving it would only slow every step while requests wait (on the H200 the CPU's pick cost
8.2x the device's per token, B5). Unmeasured or pinned regions shift as the table says.
"""

from __future__ import annotations

from dataclasses import dataclass

import structlog

from hybridgen.config.engine import EngineConfig
from hybridgen.kvtiers.warm_tier import WarmTier

log = structlog.get_logger()

DEGRADE_WARM_SHARE = 0.25
"""CPU share of Warm blocks added while degraded."""
SOFTMAX_FLOPS_PER_LOGIT = 5
"""max, subtract, exp, sum and scale: the softmax's work per logit."""


@dataclass
class DegradeStats:
    """Counters since start."""

    entries: int = 0
    """Times the degrade path engaged."""
    steps: int = 0
    """Engine steps run degraded."""


class Degrade:
    """The engine's degrade state: which placements hold now."""

    def __init__(
        self,
        config: EngineConfig,
        warm: WarmTier | None,
        vocab_size: int,
        measured_warm: bool = False,
    ) -> None:
        """`measured_warm`: attn_warm was placed by its start-up timing."""
        self.allowed = config.mode != "pure_gpu"
        self.active = False
        self.sample_placement = config.sample_placement
        """Where tokens are picked this step."""
        self.normal_sample = config.sample_placement
        """Where tokens are picked when not degraded."""
        self.softmax_mflops = config.max_num_seqs * vocab_size * SOFTMAX_FLOPS_PER_LOGIT / 1e6
        """The degrade-path softmax's work per step at a full batch."""
        self.softmax_threshold = config.softmax_threshold_mflops
        self._softmax = self._pinned_softmax = config.degrade_softmax
        if self._softmax == "auto":  # offload_threshold.softmax
            self._softmax = "cpu" if self.softmax_mflops < self.softmax_threshold else "gpu"
        self._warm = warm
        self._normal_warm = (warm.mode, warm.split) if warm is not None else None
        self.stays: set[str] = set()
        """Regions whose CPU side was measured slower: the degrade path leaves them."""
        if warm is not None and measured_warm and warm.mode == "gpu":
            self.stays.add("attn_warm")
        self.stats = DegradeStats()

    def set(self, on: bool) -> bool:
        """Engage or lift the degrade path; returns whether anything changed."""
        if not self.allowed or on == self.active:
            return False
        self.active = on
        cpu_pick = on and self._softmax == "cpu" and "sample" not in self.stays
        self.sample_placement = "cpu" if cpu_pick else self.normal_sample
        warm = self._warm
        if warm is not None and self._normal_warm is not None:
            mode, share = self._normal_warm
            if on and mode != "cpu" and "attn_warm" not in self.stays:
                warm.mode, warm.split = "split", min(1.0, share + DEGRADE_WARM_SHARE)
            else:
                warm.mode, warm.split = mode, share
        self.stats.entries += on
        log.info(
            "degrade",
            active=on,
            sample=self.sample_placement,
            attn_warm=None if warm is None else f"{warm.mode}:{warm.split:.3f}",
        )
        return True

    def place_sample(self, placement: str) -> None:
        """Set where tokens are picked when not degraded (measured at start): on the device,
        the CPU was measured slower, and the degrade path keeps the pick there unless
        placements.softmax pins the CPU."""
        self.normal_sample = placement
        if placement == "gpu" and self._pinned_softmax != "cpu":
            self.stays.add("sample")
        if not self.active:
            self.sample_placement = placement

    def info(self) -> dict[str, bool | int]:
        """The figures, keyed by GetModelInfo field names."""
        return {
            "degraded": self.active,
            "degrade_entries": self.stats.entries,
            "degraded_steps": self.stats.steps,
        }
