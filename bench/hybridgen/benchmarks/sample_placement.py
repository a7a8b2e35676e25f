"""Where to sample: the device sampler vs the CPU daemon picking from top-k candidates.

    python -m hybridgen.benchmarks.sample_placement [--model tiny-llama] [--device auto]

Serves the same model twice through `hybridgen serve`, once per `placements.sample`, and
times one greedy request's decode (ms/token, median of --runs after a warm-up). With CPU
sampling every token makes a round trip over the rings (candidates out, the pick back), so
the GPU waits for the CPU once per step; the figures decide the default (bench/NOTES.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from hybridgen.benchmarks.report import machine_info
from hybridgen.benchmarks.serving_overhead import PROMPT_LEN, served, served_once, write_config
from hybridgen.runtime import log as hlog


def measure(model: str, device: str, tokens: int, runs: int) -> dict[str, Any]:
    prompt = list(range(1, PROMPT_LEN + 1))
    result: dict[str, Any] = {}
    for sample in ("gpu", "cpu"):
        with tempfile.TemporaryDirectory() as tmp:
            config = write_config(Path(tmp), model, tokens, sample)
            report: dict[str, Any] = {}
            with served(model, device, config, report) as stub:
                served_once(stub, prompt, tokens)  # warm-up
                timings = [served_once(stub, prompt, tokens) for _ in range(runs)]
        result[sample] = {
            "decode_ms_per_token": statistics.median(t.decode_ms_per_token for t in timings),
            "ttft_ms": statistics.median(t.ttft_ms for t in timings),
            "runs": runs,
            "server": report,
        }
    result["cpu_over_gpu"] = (
        result["cpu"]["decode_ms_per_token"] / result["gpu"]["decode_ms_per_token"]
    )
    return result


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("bench/results/sample_placement.json"))
    args = ap.parse_args(argv)
    hlog.configure()
    result = {
        "machine": machine_info(),
        "command": " ".join(sys.argv),
        "model": args.model,
        **measure(args.model, args.device, args.tokens, args.runs),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"\nsample placement, {args.model} on {args.device}, {args.tokens} tokens, greedy:")
    for sample in ("gpu", "cpu"):
        r = result[sample]
        print(f"  {sample}: {r['decode_ms_per_token']:.3f} ms/token, TTFT {r['ttft_ms']:.1f} ms")
    print(f"  cpu / gpu: {result['cpu_over_gpu']:.2f}x")


if __name__ == "__main__":
    main()
