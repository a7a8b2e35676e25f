"""The 99th percentile of a heartbeat's recent samples, as both daemons report it."""

from __future__ import annotations

from collections.abc import Collection


def p99(samples: Collection[float]) -> float:
    """99th percentile of recent samples (0 when there are none)."""
    if not samples:
        return 0.0
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
