"""The e2e benchmark's figures: per-request records, their percentiles and summary, the
hybrid/pure_gpu ratios, the latency-percentile plot and the closing table."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import structlog

from hybridgen.benchmarks.server_time import passes_line, phase_line

log = structlog.get_logger()

PERCENTILES = (50, 90, 95, 99)
PEAK_FIELD = "gpu_mem_peak_reserved_mb"
"""The GetModelInfo field that carries the GPU daemon's peak reserved memory (MiB)."""
Run = Mapping[str, Any]
"""One mode's summary, as e2e_benchmark.bench_target returns it."""

METRICS = (("first_token", "Time to first token"), ("e2e", "End-to-end latency"))
# hybrid / pure_gpu as the article claims them (BENCHMARKS.md B6): TTFT -23 %, throughput
# 1.7x, peak GPU memory 64 %.
ARTICLE_RATIOS = {"avg_first_token_latency_ms": 0.77, "tok_per_s": 1.7, "gpu_mem_peak_mb": 0.64}


@dataclass
class RequestResult:
    """One timed request: a row of the JSON's per_request list."""

    index: int
    line: int
    max_new_tokens: int
    round: int = 0
    """The timed pass it belongs to (e2e_benchmark --rounds)."""
    prompt_tokens: int = 0
    tokens: int = 0
    ttft_ms: float | None = None
    """Call start to the first streamed message that carries tokens."""
    e2e_ms: float | None = None
    finish_reason: str = ""
    error: str | None = None


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0 <= q <= 100), interpolated linearly between the closest ranks
    (numpy's default method)."""
    if not values or not 0 <= q <= 100:
        raise ValueError(f"percentile needs values and 0 <= q <= 100, got {len(values)}, {q}")
    return float(np.percentile(values, q))


def summarize(results: Sequence[RequestResult], wall_s: float) -> dict[str, Any]:
    """Latency percentiles over the requests that succeeded, and tok/s over the wall time."""
    ok = [r for r in results if r.error is None and r.ttft_ms is not None]
    tokens = sum(r.tokens for r in results)
    out: dict[str, Any] = {
        "requests": len(results),
        "failed": len(results) - len(ok),
        "wall_s": wall_s,
        "generated_tokens": tokens,
        "tok_per_s": tokens / wall_s if wall_s > 0 else 0.0,
    }
    series = {"first_token": [r.ttft_ms for r in ok], "e2e": [r.e2e_ms for r in ok]}
    for name, raw in series.items():
        values = [float(v) for v in raw if v is not None]
        out[f"avg_{name}_latency_ms"] = sum(values) / len(values) if values else None
        for q in PERCENTILES:
            out[f"p{q}_{name}_latency_ms"] = percentile(values, q) if values else None
    return out


def round_line(rounds: Sequence[Mapping[str, Any]]) -> str:
    """Each timed round's tok/s and TTFT p50: how far the rounds pooled above spread."""
    tok = ", ".join(_num(r["tok_per_s"], 0, 1) for r in rounds)
    p50 = ", ".join(_num(r["p50_first_token_latency_ms"], 0, 1) for r in rounds)
    return f"{len(rounds)} rounds: tok/s {tok}; TTFT p50 {p50} ms"


def ratios(hybrid: dict[str, Any], pure: dict[str, Any]) -> dict[str, float | None]:
    """hybrid / pure_gpu for each headline figure; None where either side has none."""
    keys = (
        "avg_first_token_latency_ms",
        "p50_first_token_latency_ms",
        "p95_e2e_latency_ms",
        "tok_per_s",
        "gpu_mem_peak_mb",
    )
    out: dict[str, float | None] = {}
    for key in keys:
        a, b = hybrid.get(key), pure.get(key)
        out[key] = a / b if a is not None and b else None
    return out


def gpu_mem_peak(info: Any) -> tuple[float | None, str]:
    """Peak reserved GPU memory (MiB) as the server reports it, and where it came from."""
    if PEAK_FIELD not in info.DESCRIPTOR.fields_by_name:
        return None, f"not reported: GetModelInfo has no {PEAK_FIELD} field"
    if not info.device.startswith("cuda"):
        return None, f"not applicable: CPU device (the server runs on {info.device})"
    peak = float(getattr(info, PEAK_FIELD))
    if peak <= 0:  # a server from before the field, or one that leaves it unset
        return None, f"not reported: GetModelInfo.{PEAK_FIELD} is 0 on {info.device}"
    return peak, f"GetModelInfo.{PEAK_FIELD}"


def plot_latency(runs: Mapping[str, Run], path: Path, percentiles: Sequence[int]) -> Path | None:
    """Grouped bars of the TTFT and e2e percentiles, one colour per mode; None without
    matplotlib (the JSON holds every figure anyway)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        log.warning("plot_skipped", reason="matplotlib is not installed: pip install matplotlib")
        return None
    fig = Figure(figsize=(10, 4.5), layout="constrained")
    FigureCanvasAgg(fig)  # Agg, without pyplot's global state
    width = 0.8 / len(runs)
    for ax, (metric, title) in zip(fig.subplots(1, 2), METRICS, strict=True):
        for i, (mode, run) in enumerate(runs.items()):
            values = [run.get(f"p{q}_{metric}_latency_ms") or 0.0 for q in percentiles]
            xs = [j + (i - (len(runs) - 1) / 2) * width for j in range(len(percentiles))]
            bars = ax.bar(xs, values, width, label=mode)
            ax.bar_label(bars, fmt="%.0f", fontsize=7)
        ax.set_xticks(range(len(percentiles)), [f"p{q}" for q in percentiles])
        ax.set_ylabel("ms")
        ax.set_title(title)
        ax.legend()
    first = next(iter(runs.values()))
    synthetic = " (synthetic weights)" if first.get("synthetic") else ""
    fig.suptitle(
        f"{first['model']}{synthetic} on {first['device']}: {first['requests']} requests, "
        f"batch {first['batch_size']}, {first['max_new_tokens']} new tokens"
    )
    fig.savefig(path, dpi=120)
    return path


def _num(value: float | None, width: int, digits: int = 1) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:{width}.{digits}f}"


def print_table(result: Mapping[str, Any], runs: Mapping[str, Run]) -> None:
    """One row per mode, then the hybrid/pure_gpu ratios beside the article's claims."""
    first = next(iter(runs.values()))
    synthetic = " (synthetic)" if first.get("synthetic") else ""
    print(
        f"\nE2E benchmark (B6): model={first['model']}{synthetic} device={first['device']} "
        f"batch={first['batch_size']} max_new_tokens={first['max_new_tokens']} "
        f"commit={result['machine']['commit'][:10]}"
    )
    columns = ("ttft_avg", "ttft_p50", "ttft_p95", "e2e_p50", "e2e_p95", "e2e_p99")
    header = "".join(f"{c:>10}" for c in columns)
    print(f"{'mode':10}{'requests':>9}{'failed':>7}{header}{'tok/s':>10}{'gpu_peak_mb':>12}")
    for mode, run in runs.items():
        figures = [run["avg_first_token_latency_ms"]]
        figures += [run[f"p{q}_first_token_latency_ms"] for q in (50, 95)]
        figures += [run[f"p{q}_e2e_latency_ms"] for q in (50, 95, 99)]
        print(
            f"{mode:10}{run['requests']:>9}{run['failed']:>7}"
            + "".join(_num(v, 10) for v in figures)
            + f"{_num(run['tok_per_s'], 10)}{_num(run['gpu_mem_peak_mb'], 12, 0)}"
        )
    print("latencies in ms")
    for mode, run in runs.items():
        if len(run.get("per_round", ())) > 1:
            print(f"{mode}: {round_line(run['per_round'])}")
    for mode, run in runs.items():
        if "server_time" in run:
            print(f"{mode}: {phase_line(run['server_time'])}")
        if "server_passes" in run:
            print(f"{mode}: {passes_line(run['server_passes'])}")
    if first["gpu_mem_peak_mb"] is None:
        print(f"gpu_mem_peak_mb: {first['gpu_mem_peak_source']}")
    if "ratios" in result:
        print("hybrid / pure_gpu (the article's claim in brackets):")
        for key, value in result["ratios"].items():
            claim = ARTICLE_RATIOS.get(key)
            print(f"  {key:28}{_num(value, 8, 3)}" + (f"  [{claim:.2f}]" if claim else ""))
