"""The server's account of a run's time: what each phase of its engine took between two
GetModelInfo answers (its step_s_* fields: engine.py STEP_PHASES), and what is left of the
run's wall time, when the engine waited for work. Where a served figure falls short, this
says whether the time went to prefill, to reading Warm, to choosing batches (Warm loads,
spills), to outputs (write-backs) or to nothing; and, for the forward passes, how many ran
and how long each took with how many decode rows and prompt tokens."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
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


FORWARD = ("decode", "prefill", "warm")
"""The phases that are forward passes, whose passes the server counts (step_n_*, step_rows_*,
step_tokens_*)."""


def pass_counts(info: Any) -> dict[str, float]:
    """The step_n_*, step_rows_* and step_tokens_* fields of a GetModelInfoResponse."""
    names = type(info).DESCRIPTOR.fields_by_name
    return {
        n: float(getattr(info, n))
        for n in names
        if n.startswith(("step_n_", "step_rows_", "step_tokens_"))
    }


def run_passes(
    before: Mapping[str, float], after: Mapping[str, float], seconds: Mapping[str, float]
) -> dict[str, dict[str, float]]:
    """Each forward phase's passes over a run (pass_counts before and after it; `seconds`:
    run_phases' figures): how many, and per pass its mean milliseconds, decode rows and
    prompt tokens. Phases with no pass are left out."""
    out = {}
    for phase in FORWARD:
        n = after[f"step_n_{phase}"] - before[f"step_n_{phase}"]
        if n <= 0:
            continue
        key = f"step_tokens_{phase}"
        tokens = after.get(key, 0.0) - before.get(key, 0.0)
        out[phase] = {
            "passes": n,
            "ms_per_pass": seconds[phase] / n * 1e3,
            "rows_per_pass": (after[f"step_rows_{phase}"] - before[f"step_rows_{phase}"]) / n,
            "prompt_tokens_per_pass": tokens / n,
        }
    return out


def passes_line(passes: dict[str, dict[str, float]]) -> str:
    """`passes` as printed under a benchmark's table."""
    parts = [
        f"{phase} {p['passes']:,.0f} x {p['ms_per_pass']:.1f} ms"
        f" ({p['rows_per_pass']:.1f} decode rows"
        + (f", {p['prompt_tokens_per_pass']:.0f} prompt tokens)" if phase != "decode" else ")")
        for phase, p in passes.items()
    ]
    return "server passes over the run: " + ("; ".join(parts) or "none")


def median_passes(runs: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Each phase's figures' medians over runs that carry "server_passes" (run_passes); a
    phase some run lacks counts as none there."""
    phases = {p for r in runs for p in r["server_passes"]}
    empty = dict.fromkeys(("passes", "ms_per_pass", "rows_per_pass", "prompt_tokens_per_pass"), 0.0)
    return {
        phase: {
            k: statistics.median(r["server_passes"].get(phase, empty)[k] for r in runs)
            for k in empty
        }
        for phase in FORWARD
        if phase in phases
    }
