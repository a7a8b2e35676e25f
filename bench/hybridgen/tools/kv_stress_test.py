"""Stress the KV tiers with one long context and report how the Hot and Warm tiers served it.

    python -m hybridgen.tools.kv_stress_test --model llama3-8b --context-len 8192 \\
        --warmup-tokens 64

Builds the engine from the config file (if given) with the overrides below, runs one
request with a --context-len token prompt (random token ids) and --warmup-tokens greedy
tokens, --runs times, and prints for each run the Hot Hit Rate, the Warm Decompress Latency
(p50 / p95) and the decode speed, then what the figures mean. With no Warm region in the
config, one large enough for the whole context is used; Warm is exercised when the Hot region
(--hot-region-mb) is smaller than the context. One sequence runs, prefilled in chunks of at
most 512 tokens.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from typing import Any

import structlog
import torch

from hybridgen.benchmarks.engine_bench import random_prompts
from hybridgen.config.engine import ConfigError
from hybridgen.config.file import load_config
from hybridgen.engine.engine import Engine
from hybridgen.engine.memory import BudgetTooSmall
from hybridgen.kvtiers.warm_stats import WarmStats
from hybridgen.kvtiers.warm_tier import warm_mb_for
from hybridgen.models.loader import load_model
from hybridgen.runtime import log as hlog
from hybridgen.sampling.params import SamplingParams

log = structlog.get_logger()

HIT_RATE_TARGET = 0.92
"""The article's healthy Hot Hit Rate."""
DECOMPRESS_TARGET_MS = 0.8
"""The article's healthy Warm Decompress Latency."""
CHUNK = 512
"""Prefill chunk (tokens per step) at most, so that a small Hot region still takes a step."""


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--model", required=True, help="a synthetic preset or a checkpoint path")
    ap.add_argument("--context-len", type=int, required=True, help="prompt tokens")
    ap.add_argument("--warmup-tokens", type=int, default=64, help="tokens generated per run")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--config", help="hybridgen_config.yaml (default: built-in defaults)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--hot-region-mb", type=float, help="override kv_cache.hot_region_mb")
    ap.add_argument("--warm-region-mb", type=float, help="override kv_cache.warm_region_mb")
    ap.add_argument("--warm-codec", choices=("lossless", "lz4", "int8", "int4"))
    ap.add_argument("--attn-warm", choices=("cpu", "gpu", "split"))
    args = ap.parse_args(argv)
    if args.context_len < 1 or args.warmup_tokens < 1 or args.runs < 1:
        ap.error("--context-len, --warmup-tokens and --runs must be >= 1")
    return args


def _engine(args: argparse.Namespace) -> Engine:
    config = load_config(args.config).with_model(args.model).engine_config(args.device)
    length = args.context_len + args.warmup_tokens
    overrides: dict[str, Any] = {
        "max_model_len": max(length, config.max_model_len or 0),
        "max_num_seqs": 1,  # one sequence: Hot needs only a prefill chunk and a block
        "max_num_batched_tokens": min(config.max_num_batched_tokens, CHUNK),
        "prefix_reuse": False,  # every run repeats the prompt: each must fill the tiers anew
    }
    if args.hot_region_mb is not None:
        overrides["kv_pool_mb"] = args.hot_region_mb
    if args.warm_codec:
        overrides["warm_codec"] = args.warm_codec
    if args.attn_warm:
        overrides["attn_warm"] = args.attn_warm
    config = dataclasses.replace(config, **overrides)
    loaded = load_model(config.model, config.torch_device(), config.torch_dtype(), config.seed)
    warm_mb = args.warm_region_mb if args.warm_region_mb is not None else config.warm_pool_mb
    if not warm_mb:  # enough Warm for the whole context
        warm_mb = warm_mb_for(
            loaded.model.spec, config.warm_codec, config.block_size, length, config.hot_codec
        )
    return Engine(dataclasses.replace(config, warm_pool_mb=warm_mb), loaded=loaded)


def run(args: argparse.Namespace) -> list[dict[str, float | int | str]]:
    engine = _engine(args)
    assert engine.warm is not None
    prompt = random_prompts(1, args.context_len, engine.spec.vocab_size, seed=0)[0]
    params = SamplingParams(temperature=0.0, max_tokens=args.warmup_tokens, ignore_eos=True)
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    results = []
    for r in range(args.runs):
        log.info("kv_stress_run", run=r + 1, of=args.runs, context_len=args.context_len)
        engine.warm.stats = WarmStats()
        engine.add_request(f"stress-{r}", prompt, params)
        engine.step()  # the first prefill chunk: decode is timed from the first decode step
        tokens, t0 = 0, 0.0
        while engine.has_unfinished():
            outs = engine.step()
            if not t0 and any(o.output_tokens > 1 for o in outs):
                sync()
                t0, tokens = time.perf_counter(), 0
            tokens += sum(len(o.new_token_ids) for o in outs)
        sync()
        stats = engine.tier_stats()
        stats["decode_tok_s"] = tokens / (time.perf_counter() - t0) if t0 else 0.0
        stats["spilled_blocks"] = engine.warm.stats.spilled_blocks
        results.append(stats)
    engine.release()
    return results


def report(args: argparse.Namespace, results: list[dict[str, float | int | str]]) -> None:
    print(
        f"\nkv_stress_test: model={args.model} context={args.context_len} "
        f"warmup_tokens={args.warmup_tokens}"
    )
    print(f"{'run':>4} {'Hot Hit Rate':>13} {'Warm Decompress p50 / p95 ms':>29} {'tok/s':>8}")
    for i, r in enumerate(results, 1):
        print(
            f"{i:>4} {r['hot_hit_rate']:>12.1%} {r['warm_decompress_p50_ms']:>15.3f} / "
            f"{r['warm_decompress_p95_ms']:<11.3f} {r['decode_tok_s']:>8.1f}"
        )
    last = results[-1]
    print(
        f"\nHot Hit Rate {last['hot_hit_rate']:.1%}: the share of the keys each decode step "
        f"read from GPU memory. Below {HIT_RATE_TARGET:.0%} a large share of the context "
        "sits in Warm, and every step waits on the CPU or PCIe: raise kv_cache.hot_region_mb, "
        "or store Hot compressed "
        "(kv_cache.hot_codec int8/int4) to fit more of it."
    )
    print(
        f"Warm Decompress Latency p50 {last['warm_decompress_p50_ms']:.3f} ms: decoding one "
        "layer's Warm blocks in one step (per layer, so a step pays it once per layer). Above "
        f"{DECOMPRESS_TARGET_MS} ms the decoder is the bottleneck: use a cheaper warm_codec "
        "(lossless or int8), placements.attn_warm gpu or split, or more CPU cores. The first "
        "run also pays one-time warm-up; judge the later runs."
    )


def main(argv: list[str] | None = None) -> list[dict[str, float | int | str]]:
    args = _args(argv)
    hlog.configure()
    try:
        results = run(args)
    except (ConfigError, BudgetTooSmall) as exc:
        print(f"kv_stress_test: {exc}", file=sys.stderr)
        raise SystemExit(2) from exc
    report(args, results)
    return results


if __name__ == "__main__":
    main()
