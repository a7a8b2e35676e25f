"""The server's account of a run's time: what each phase of its engine took between two
GetModelInfo answers (its step_s_* fields: engine.py STEP_PHASES), and what is left of the
run's wall time, when the engine waited for work. Where a served figure falls short, this
says whether the time went to prefill, to reading Warm, to choosing batches (Warm loads,
spills), to outputs (write-backs) or to nothing."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

PREFIX = "step_s_"


def phase_seconds(info: Any) -> dict[str, float]:
    """The step_s_* fields of a GetModelInfoResponse, by phase name."""
    names = type(info).DESCRIPTOR.fields_by_name
    return {n.removeprefix(PREFIX): float(getattr(info, n)) for n in names if n.startswith(PREFIX)}


def run_phases(
    before: dict[str, float], after: dict[str, float], wall_s: float
) -> dict[str, float]:
    """Seconds by phase over a run of `wall_s` seconds, with `idle` (the rest: the engine
    waited) and `wall`."""
    phases = {p: after[p] - before[p] for p in after}
    return {**phases, "idle": max(wall_s - sum(phases.values()), 0.0), "wall": wall_s}


def phase_line(phases: dict[str, float]) -> str:
    """`phases` as printed under a benchmark's table."""
    parts = ", ".join(f"{p} {s:.1f} s" for p, s in phases.items() if p != "wall")
    return f"server time over the run ({phases['wall']:.1f} s): {parts}"


def median_phases(runs: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Each phase's median over runs that carry a "server_time" (run_phases)."""
    return {k: statistics.median(r["server_time"][k] for r in runs) for k in runs[0]["server_time"]}
