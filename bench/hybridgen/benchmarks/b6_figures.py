"""The article's three figures for each B6 workload, side by side with what was measured
(BENCHMARKS.md B6; bench/run_h200_b6.sh writes the inputs, `table` prints this).

    python -m hybridgen.benchmarks.b6_figures DIR [--budget-mb 24576]

DIR holds the runs' JSON files:

    b6i.json, b6ii.json          e2e_benchmark --compare: hybrid and pure_gpu at the budget
    chat_hybrid.json, chat_pure_gpu.json   the load client's --chat runs at the budget
    mem_<workload>_<MB>.json     hybrid alone at a smaller budget of MB MiB (workload b6i,
                                 b6ii or chat): e2e_benchmark's JSON, or the load client's
    int8_<workload>.json         hybrid with kv_cache.hot_codec int8 at the budget (the
                                 int8-as-default question): its TTFT and throughput rows too

For each workload, hybrid / pure_gpu at the same budget:

    TTFT        TTFT p50 (the article: -23 %, a ratio of 0.77)
    throughput  generated tokens over the wall time (the article: 1.7x)
    memory      the GPU memory hybrid needs to reach pure_gpu's TTFT p50 at the budget, as a
                share of that budget: the smallest budget measured (the budget itself, or a
                mem_ run) at which hybrid's TTFT p50 is no higher (the article: 64 %). Both
                modes fill whatever budget they get with Hot-KV blocks, so their peak is the
                budget and its ratio says nothing; what Warm buys is that a smaller card
                serves as fast, which is what this figure measures.

It prints the table and writes DIR/b6_figures.json (and b6_figures.png with matplotlib).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ARTICLE = {"ttft": 0.77, "throughput": 1.7, "memory": 0.64}
TITLES = {
    "ttft": "TTFT p50, hybrid / pure_gpu",
    "throughput": "tok/s, hybrid / pure_gpu",
    "memory": "GPU memory for pure_gpu's TTFT",
}
TARGETS = {  # BENCHMARKS.md B6 (issue 18): hybrid / pure_gpu
    "b6i": {"ttft": ("<=", 1.03), "throughput": (">=", 0.97)},
    "b6ii": {"ttft": ("<=", 1.03), "throughput": (">=", 0.97)},
    "chat": {"ttft": ("<=", 0.5), "throughput": (">=", 1.5)},
}
NAMES = {
    "b6i": "B6 (i) mixed 1K-33K prompts, batch 4",
    "b6ii": "B6 (ii) many short prompts, batch 16",
    "chat": "B6 (iii) multi-turn, 48 x 6, 32 in flight",
}


@dataclass(frozen=True)
class Point:
    """One mode's run at one budget."""

    ttft_ms: float | None
    """TTFT p50."""
    tok_s: float | None
    """Generated tokens over the wall time."""
    peak_mb: float | None
    """Peak reserved GPU memory the server reported."""


def point(data: dict[str, Any], mode: str | None = None) -> Point:
    """A run's figures from e2e_benchmark's JSON (`mode`: its side of a --compare) or the
    load client's."""
    if "median" in data:  # the load client
        med, peak = data["median"], data.get("server_info", {}).get("gpu_mem_peak_reserved_mb")
        return Point(med.get("ttft_ms_p50"), med.get("total_tok_s"), peak)
    run = data[mode] if mode is not None else data
    ttft = run.get("p50_first_token_latency_ms")
    return Point(ttft, run.get("tok_per_s"), run.get("gpu_mem_peak_mb"))


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def memory_share(pure_ttft: float | None, hybrid: dict[int, Point], budget: int) -> float | None:
    """The smallest measured budget at which hybrid's TTFT p50 is at most pure_gpu's at
    `budget`, as a share of it; None when none of them reaches it."""
    if pure_ttft is None:
        return None
    reached = [mb for mb, p in hybrid.items() if p.ttft_ms is not None and p.ttft_ms <= pure_ttft]
    return min(reached) / budget if reached else None


def load_runs(folder: Path, budget: int) -> dict[str, tuple[Point, dict[int, Point]]]:
    """Per workload found in `folder`: pure_gpu's point and hybrid's by budget."""
    runs: dict[str, tuple[Point, dict[int, Point]]] = {}
    for name in ("b6i", "b6ii"):
        path = folder / f"{name}.json"
        if path.exists():
            data = json.loads(path.read_text())
            runs[name] = (point(data, "pure_gpu"), {budget: point(data, "hybrid")})
    pure, hybrid = folder / "chat_pure_gpu.json", folder / "chat_hybrid.json"
    if pure.exists() and hybrid.exists():
        same = point(json.loads(hybrid.read_text()))
        runs["chat"] = (point(json.loads(pure.read_text())), {budget: same})
    for path in sorted(folder.glob("mem_*_*.json")):
        match = re.fullmatch(r"mem_(b6i|b6ii|chat)_(\d+)\.json", path.name)
        if match and match[1] in runs:
            runs[match[1]][1][int(match[2])] = point(json.loads(path.read_text()))
    return runs


def figures(
    runs: dict[str, tuple[Point, dict[int, Point]]], budget: int, folder: Path | None = None
) -> dict[str, Any]:
    """hybrid / pure_gpu per workload (module doc), with the article's and the target; with
    `folder`, int8 Hot's runs found there too."""
    out: dict[str, Any] = {}
    for name, (pure, hybrid) in runs.items():
        same = hybrid.get(budget)
        out[name] = {
            "ttft": _ratio(same.ttft_ms, pure.ttft_ms) if same else None,
            "throughput": _ratio(same.tok_s, pure.tok_s) if same else None,
            "memory": memory_share(pure.ttft_ms, hybrid, budget),
            "budgets_measured_mb": sorted(hybrid),
            "pure_gpu": vars(pure),
            "hybrid": {mb: vars(p) for mb, p in sorted(hybrid.items())},
        }
        int8 = folder / f"int8_{name}.json" if folder is not None else None
        if int8 is not None and int8.exists():
            p = point(json.loads(int8.read_text()))
            out[name]["int8_hot"] = {
                "ttft": _ratio(p.ttft_ms, pure.ttft_ms),
                "throughput": _ratio(p.tok_s, pure.tok_s),
                "run": vars(p),
            }
    return out


def _cell(value: float | None, kind: str) -> str:
    if value is None:
        return "not reached" if kind == "memory" else "-"
    if kind == "ttft":
        return f"{value:.2f} ({(value - 1) * 100:+.0f} %)"
    return f"{value:.2f}x" if kind == "throughput" else f"{value * 100:.0f} %"


def _met(value: float | None, target: tuple[str, float] | None) -> str:
    if target is None or value is None:
        return "-"
    op, bound = target
    ok = value <= bound if op == "<=" else value >= bound
    return f"{op} {bound}: {'met' if ok else 'MISSED'}"


def table(result: dict[str, Any], budget: int) -> str:
    """The article's three figures beside the measured ones, one row per workload and
    figure."""
    lines = [
        f"hybrid / pure_gpu at device_topology.gpu.memory_mb {budget} (memory: the share of it "
        "hybrid needs for pure_gpu's TTFT p50)",
        "| workload | figure | article | measured | target |",
        "|---|---|---|---|---|",
    ]
    for name, row in result.items():
        for kind in ("ttft", "throughput", "memory"):
            target = TARGETS[name].get(kind)
            lines.append(
                f"| {NAMES[name]} | {kind} | {_cell(ARTICLE[kind], kind)} | "
                f"{_cell(row[kind], kind)} | {_met(row[kind], target)} |"
            )
        for kind, value in row.get("int8_hot", {}).items():
            if kind != "run":
                lines.append(
                    f"| {NAMES[name]} | {kind}, int8 Hot | {_cell(ARTICLE[kind], kind)} | "
                    f"{_cell(value, kind)} | {_met(value, TARGETS[name].get(kind))} |"
                )
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> Path | None:
    """The three figures per workload beside the article's, as bars; None without
    matplotlib."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return None
    fig = Figure(figsize=(11, 3.8), layout="constrained")
    FigureCanvasAgg(fig)
    for i, kind in enumerate(("ttft", "throughput", "memory")):
        ax = fig.add_subplot(1, 3, i + 1)
        names = list(result)
        values = [result[n][kind] or 0.0 for n in names]
        ax.bar(range(len(names)), values, color="tab:blue", label="measured")
        ax.axhline(ARTICLE[kind], color="tab:red", linestyle="--", label="article")
        ax.set_xticks(range(len(names)), names)
        ax.set_title(TITLES[kind])
        ax.legend(fontsize=8)
    fig.savefig(path, dpi=110)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("folder", type=Path, help="the runs' JSON files (bench/run_h200_b6.sh)")
    ap.add_argument("--budget-mb", type=int, default=24576, help="the budget both modes ran at")
    args = ap.parse_args(argv)
    runs = load_runs(args.folder, args.budget_mb)
    if not runs:
        print(f"no B6 runs in {args.folder} (b6i.json, b6ii.json, chat_*.json)", file=sys.stderr)
        return 1
    result = figures(runs, args.budget_mb, args.folder)
    (args.folder / "b6_figures.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result, args.folder / "b6_figures.png")
    print(table(result, args.budget_mb))
    return 0


if __name__ == "__main__":
    sys.exit(main())
