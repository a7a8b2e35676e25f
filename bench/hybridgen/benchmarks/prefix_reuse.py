"""What prefix reuse saves: the TTFT of a chat's second turn, with and without the cache.

    python -m hybridgen.benchmarks.prefix_reuse --model llama3-8b --prefix-len 8192

Turn 1 is a prompt of --prefix-len tokens answered with --answer-tokens greedy tokens; turn 2
is turn 1's prompt and answer plus --new-len new tokens. Each engine (prefix_reuse on, then
off, on the same weights) runs turn 1 and then turn 2, --runs times with fresh prompts; the
figure is the median TTFT of turn 2. Writes the JSON results file and prints the table last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import structlog
import torch

from hybridgen.benchmarks.engine_bench import random_prompts
from hybridgen.benchmarks.report import machine_info
from hybridgen.config.engine import EngineConfig
from hybridgen.engine.engine import Engine
from hybridgen.models.loader import LoadedModel, load_model
from hybridgen.runtime import log as hlog
from hybridgen.sampling.params import SamplingParams

log = structlog.get_logger()


def ttft_ms(engine: Engine, prompt: list[int], max_tokens: int) -> tuple[float, list[int]]:
    """Submit one greedy request, time it to its first token, and run it to the end."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    sync()
    start, first = time.perf_counter(), None
    rid = f"turn-{start}"
    engine.add_request(rid, prompt, params)
    tokens: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid:
                tokens += out.new_token_ids
                if first is None and tokens:
                    first = time.perf_counter()
    assert first is not None
    return (first - start) * 1e3, tokens


def measure(loaded: LoadedModel, config: EngineConfig, args: argparse.Namespace) -> dict:
    engine = Engine(config, loaded=loaded)
    vocab = engine.spec.vocab_size
    ttft_ms(engine, random_prompts(1, 64, vocab, seed=0)[0], 2)  # warm-up
    turn1, turn2, hits = [], [], []
    for run in range(args.runs):
        log.info("prefix_reuse_run", prefix_reuse=config.prefix_reuse, run=run)
        first, extra = random_prompts(2, args.prefix_len, vocab, seed=run + 1)
        t1, answer = ttft_ms(engine, first, args.answer_tokens)
        before = engine.scheduler.prefix_hit_tokens
        t2, _ = ttft_ms(engine, first + answer + extra[: args.new_len], 1)
        turn1.append(t1)
        turn2.append(t2)
        hits.append(engine.scheduler.prefix_hit_tokens - before)
    engine.release()
    return {
        "turn1_ttft_ms": statistics.median(turn1),
        "turn2_ttft_ms": statistics.median(turn2),
        "turn2_ttft_runs_ms": turn2,
        "turn2_cached_tokens": hits,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--prefix-len", type=int, default=2048)
    ap.add_argument("--answer-tokens", type=int, default=32)
    ap.add_argument("--new-len", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--gpu-memory-mb", type=int, default=None)
    ap.add_argument("--out", type=Path, default=Path("bench/results/prefix_reuse.json"))
    args = ap.parse_args(argv)
    if args.prefix_len < 16 or args.new_len < 1 or args.answer_tokens < 1 or args.runs < 1:
        ap.error("need --prefix-len >= 16, --new-len >= 1, --answer-tokens >= 1, --runs >= 1")
    hlog.configure()
    base = EngineConfig(
        model=args.model,
        device=args.device,
        gpu_memory_mb=args.gpu_memory_mb,
        max_num_seqs=1,
        max_model_len=args.prefix_len + args.answer_tokens + args.new_len + 16,
    )
    loaded = load_model(base.model, base.torch_device(), base.torch_dtype(), base.seed)
    result: dict[str, Any] = {
        "machine": machine_info(),
        "command": " ".join(["python -m hybridgen.benchmarks.prefix_reuse", *sys.argv[1:]]),
        "model": args.model,
        "synthetic": loaded.model.spec.synthetic,
        "prefix_len": args.prefix_len,
        "answer_tokens": args.answer_tokens,
        "new_len": args.new_len,
    }
    for reuse in (True, False):
        config = EngineConfig(**{**base.__dict__, "prefix_reuse": reuse})
        result["reuse" if reuse else "no_reuse"] = measure(loaded, config, args)
    on, off = result["reuse"], result["no_reuse"]
    result["turn2_ttft_speedup"] = off["turn2_ttft_ms"] / on["turn2_ttft_ms"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(
        f"\nprefix reuse: model={args.model} synthetic={result['synthetic']} "
        f"prefix={args.prefix_len} answer={args.answer_tokens} new={args.new_len} "
        f"commit={result['machine']['commit']}"
    )
    print(f"{'':12} {'turn-1 TTFT ms':>15} {'turn-2 TTFT ms':>15}  cached tokens (turn 2)")
    for name, r in (("reuse", on), ("no reuse", off)):
        print(
            f"{name:12} {r['turn1_ttft_ms']:15.1f} {r['turn2_ttft_ms']:15.1f}  "
            f"{r['turn2_cached_tokens']}"
        )
    print(f"turn-2 TTFT, no reuse / reuse: {result['turn2_ttft_speedup']:.1f}x")
    return result


if __name__ == "__main__":
    main()
