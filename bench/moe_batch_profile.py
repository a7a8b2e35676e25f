"""Where a MoE model's decode step goes at batch 1, 2 and 4, in-process, from a served config
(default B4c's: qwen3-30b-a3b, int4 experts, 12 GB), the CPU's experts in the engine's thread.

    python bench/moe_batch_profile.py [--config bench/served/b4c.yaml] [--tokens 40]

Per batch: decode ms a step and tok/s, cache misses and hits a step, and the host time a step
spent in each part of the MoE layers' expert step (SparseMoeBlock.combine and what it calls:
the grouping, the table, the grouped launch or its graph, the misses, the cache's fetches).
`combine` includes the wait for the layer's routing ids (the device's work so far). Prints a
table; writes $OUT/moe_batch_profile.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

import hybridgen.models.moe as moe
from hybridgen.benchmarks.report import machine_info, write_out
from hybridgen.config.file import load_config
from hybridgen.engine.engine import Engine
from hybridgen.experts.grouped import HitLaunches
from hybridgen.experts.store import ExpertCache
from hybridgen.sampling.params import SamplingParams

PARTS: list[tuple[Any, str]] = [
    (moe.SparseMoeBlock, "combine"),
    (moe.SparseMoeBlock, "_combine_grouped"),
    (moe.SparseMoeBlock, "_place"),
    (moe.SparseMoeBlock, "_run_placed"),
    (moe, "pack_step"),
    (moe, "step_table"),
    (moe, "launch_hits"),
    (moe, "launch_many"),
    (moe, "finish_step"),
    (HitLaunches, "run"),
]


class Timed:
    """PARTS wrapped to add up their host time (and calls), and the cache's fetches split
    into hits and misses; `restore` puts the originals back."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._saved: list[tuple[Any, str, Callable[..., Any]]] = []
        for owner, name in PARTS:
            self._wrap(owner, name, lambda *a, name=name: name)
        # fetch() goes through fetch_beside() too
        self._wrap(
            ExpertCache, "fetch_beside", lambda c, layer, e, *_: f"fetch_{self._kind(c, layer, e)}"
        )

    @staticmethod
    def _kind(cache: ExpertCache, layer: int, expert: int) -> str:
        return "hit" if (layer, expert) in cache else "miss"

    def _wrap(self, owner: Any, name: str, label: Callable[..., str]) -> None:
        real = getattr(owner, name)
        self._saved.append((owner, name, real))

        def timed(*args: Any, **kwargs: Any) -> Any:
            key = label(*args)
            start = time.perf_counter()
            out = real(*args, **kwargs)
            self.seconds[key] += time.perf_counter() - start
            self.calls[key] += 1
            return out

        setattr(owner, name, timed)

    def restore(self) -> None:
        for owner, name, real in reversed(self._saved):
            setattr(owner, name, real)


def prompts(n: int, vocab: int, seed: int, length: int = 256) -> list[list[int]]:
    gen = random.Random(seed)
    return [[gen.randrange(vocab) for _ in range(length)] for _ in range(n)]


def batch_profile(engine: Engine, batch: int, tokens: int) -> dict[str, Any]:
    """`batch` requests decoding together: `tokens` tokens each timed, after their prefill."""
    assert engine.experts is not None
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    stats = engine.experts[0].stats
    params = SamplingParams(temperature=0.0, max_tokens=tokens + 8, ignore_eos=True)
    for i, p in enumerate(prompts(batch, engine.spec.vocab_size, seed=10 + batch)):
        engine.add_request(f"b{batch}_{i}", p, params)
    made = 0
    while made < 2 * batch:  # past every prefill
        made += sum(len(o.new_token_ids) for o in engine.step())
    sync()
    misses, hits = stats.cache_misses, stats.cache_hits
    timed = Timed()
    made, start = 0, time.perf_counter()
    try:
        while made < tokens * batch and engine.has_unfinished():
            made += sum(len(o.new_token_ids) for o in engine.step())
        sync()
    finally:
        timed.restore()
    seconds = time.perf_counter() - start
    while engine.has_unfinished():
        engine.step()
    steps = made / batch
    return {
        "batch": batch,
        "decode_step_ms": seconds / steps * 1e3,
        "tok_s": made / seconds,
        "misses_a_step": (stats.cache_misses - misses) / steps,
        "hits_a_step": (stats.cache_hits - hits) / steps,
        "host_ms_a_step": {k: v / steps * 1e3 for k, v in timed.seconds.items()},
        "calls_a_step": {k: v / steps for k, v in timed.calls.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="bench/served/b4c.yaml")
    parser.add_argument("--tokens", type=int, default=40)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    config = load_config(args.config)
    engine = Engine(dataclasses.replace(config.engine_config(args.device), prefix_reuse=False))
    try:
        assert engine.experts is not None, "a MoE model with experts in host memory"
        for i, p in enumerate(prompts(4, engine.spec.vocab_size, seed=1)):  # warm-up
            engine.add_request(f"w{i}", p, SamplingParams(max_tokens=16, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
        rows = [batch_profile(engine, b, args.tokens) for b in args.batches]
        slots = engine.experts[0].capacity
    finally:
        engine.release()
    command = "python bench/moe_batch_profile.py " + " ".join(sys.argv[1:])
    write_out(
        "moe_batch_profile.json",
        {"rows": rows, "slots": slots, "machine": machine_info(), "command": command},
    )
    for r in rows:
        print(
            f"batch {r['batch']}: {r['decode_step_ms']:.2f} ms a step, {r['tok_s']:.1f} tok/s, "
            f"{r['misses_a_step']:.1f} misses and {r['hits_a_step']:.1f} hits a step"
        )
        parts = sorted(r["host_ms_a_step"].items(), key=lambda kv: -kv[1])
        print("  host ms a step: " + ", ".join(f"{k} {v:.2f}" for k, v in parts))


if __name__ == "__main__":
    main()
