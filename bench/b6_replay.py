"""B6's closed loop in one process, without the daemons: the engine of bench/b6.yaml in mode
hybrid, then in mode pure_gpu, on the same weights, 4 requests in flight, each prompt of
bench/prompts_b6.jsonl with 128 new tokens. Separates the engine's cost from the serving
path's (e2e_benchmark measures both together).

    python bench/b6_replay.py [--config bench/b6.yaml] [--device cuda] [--model M] \
        [--hot-mb MB]

Prints, per mode: wall time and tok/s; steps that had a Warm prefix in the batch, that ran
several decode steps at once (CUDA graphs), and the rest (prefill chunks), with their
seconds; preemptions, Warm blocks swapped out and loaded back, the tier figures, the CUDA
allocator's retries and peak; and each request's end-to-end seconds.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch

from hybridgen.config.file import load_config
from hybridgen.engine.engine import Engine
from hybridgen.runtime import log as hlog
from hybridgen.sampling.params import SamplingParams

HERE = Path(__file__).parent
IN_FLIGHT, NEW_TOKENS = 4, 128


def replay(engine: Engine, prompts: list[str], cuda: bool) -> dict[str, object]:
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    warm_up = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for i, text in enumerate(prompts[:IN_FLIGHT]):  # compile the prefill shapes, untimed
        engine.add_request(f"w{i}", f"Warm-up {i}.\n{text}", warm_up)
    while engine.has_unfinished():
        engine.step()
    before = torch.cuda.memory_stats() if cuda else {}
    queue, started, e2e = list(enumerate(prompts)), {}, {}
    kinds = {k: [0, 0.0] for k in ("warm", "multi_step", "other")}
    t0 = time.perf_counter()
    while queue or engine.has_unfinished():
        while queue and len(started) < IN_FLIGHT:
            i, text = queue.pop(0)
            engine.add_request(f"r{i}", text, params)
            started[f"r{i}"] = time.perf_counter()
        s0 = time.perf_counter()
        outs = engine.step()
        if cuda:
            torch.cuda.synchronize()
        dt = time.perf_counter() - s0
        if any(s.warm_slots for s in engine.scheduler.running):
            kind = "warm"
        elif any(len(o.new_token_ids) > 1 for o in outs):
            kind = "multi_step"
        else:
            kind = "other"
        kinds[kind][0] += 1
        kinds[kind][1] += dt
        for o in outs:
            if o.finished:
                e2e[o.request_id] = time.perf_counter() - started.pop(o.request_id)
    wall = time.perf_counter() - t0
    out: dict[str, object] = {
        "wall_s": wall,
        "tok_per_s": len(prompts) * NEW_TOKENS / wall,
        "steps": {k: {"count": n, "seconds": s} for k, (n, s) in kinds.items()},
        "preemptions": engine.stats.preemptions,
        "e2e_s": [e2e[f"r{i}"] for i in range(len(prompts))],
    }
    if engine.warm is not None:
        st = engine.warm.stats
        out["warm"] = {
            "swapped_out": st.swapped_blocks,
            "loaded_back": st.loaded_blocks,
            "spilled": st.spilled_blocks,
            **engine.tier_stats(),
        }
    if cuda:
        after = torch.cuda.memory_stats()
        out["alloc_retries"] = after["num_alloc_retries"] - before.get("num_alloc_retries", 0)
        out["peak_reserved_mb"] = torch.cuda.max_memory_reserved() / 2**20
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--config", type=Path, default=HERE / "b6.yaml")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", default=None)
    ap.add_argument("--hot-mb", type=float, default=None, help="hybrid's Hot pool (MB)")
    args = ap.parse_args()
    hlog.configure()
    base = load_config(args.config).with_model(args.model)
    prompts = [json.loads(line)["prompt"] for line in (HERE / "prompts_b6.jsonl").open()]
    cuda, loaded = args.device.startswith("cuda"), None
    for mode in ("hybrid", "pure_gpu"):
        config = base
        if mode == "pure_gpu":
            kv = dataclasses.replace(base.kv_cache, warm_region_mb=None)
            config = dataclasses.replace(base, mode=mode, kv_cache=kv)
        engine_config = config.engine_config(args.device)
        if mode == "hybrid" and args.hot_mb is not None:
            engine_config = dataclasses.replace(engine_config, kv_pool_mb=args.hot_mb)
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        engine = Engine(engine_config, loaded=loaded)
        loaded = engine.loaded
        result = replay(engine, prompts, cuda)
        print(mode, json.dumps(result, default=lambda x: round(x, 3)), flush=True)
        engine.release()
        del engine


if __name__ == "__main__":
    main()
