"""Where a B4 decode token's time goes: mixtral-8x7b, int4 experts, 24 GB, uniform routing,
the CPU's experts through the expert worker, as moe_bench's `uniform` case runs it.

    python bench/moe_step_profile.py [--model mixtral-8x7b] [--new-tokens 48] [--cpu-max-tokens 0]

Host wall time per token, split into the MoE layers' expert steps (SparseMoeBlock.combine:
by what each layer did: only cache hits, CPU experts, fetches) and the rest (the graph
pieces' replays and syncs, sampling); the time the expert steps waited on the worker against
the worker's own compute time; then one CPU expert through the worker against the same
expert computed in this thread, and one fetch into the cache. --cpu-max-tokens 0: every
miss fetched. Prints a table, writes JSON under $OUT.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from typing import Any

import torch

from hybridgen.benchmarks import moe_bench
from hybridgen.benchmarks.report import machine_info, write_out
from hybridgen.engine.engine import Engine
from hybridgen.experts.link import ExpertLinkClient
from hybridgen.models.moe import SparseMoeBlock, moe_blocks
from hybridgen.placement.timing import best_of
from hybridgen.sampling.params import SamplingParams

RESULT: dict[str, Any] = {}


def profile(engine: Engine, args: argparse.Namespace, cuda: bool) -> dict[str, Any]:
    assert engine.experts is not None
    cache, latency = engine.experts
    stats = cache.stats
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    calls: list[tuple[str, float]] = []
    waits: list[float] = []
    combine, wait = SparseMoeBlock.combine, ExpertLinkClient.wait

    def timed_combine(self: SparseMoeBlock, x, ids, weights):  # type: ignore[no-untyped-def]
        before = (stats.cpu_experts, stats.cache_misses)
        start = time.perf_counter()
        out = combine(self, x, ids, weights)
        sync()
        kind = "cpu" if stats.cpu_experts > before[0] else "hits"
        kind = f"{kind}+fetch" if stats.cache_misses > before[1] else kind
        calls.append((kind, time.perf_counter() - start))
        return out

    def timed_wait(self: ExpertLinkClient, seq, jobs):  # type: ignore[no-untyped-def]
        start = time.perf_counter()
        out = wait(self, seq, jobs)
        waits.append(time.perf_counter() - start)
        return out

    prompt, other = moe_bench.random_prompts(2, args.prompt_len, engine.spec.vocab_size, seed=1)
    engine.generate([other], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    engine.add_request(
        "p", prompt, SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    )
    engine.step()  # the prefill
    sync()
    SparseMoeBlock.combine = timed_combine  # type: ignore[method-assign]
    ExpertLinkClient.wait = timed_wait  # type: ignore[method-assign]
    client = cache.remote
    cpu_before = client.cpu_s if isinstance(client, ExpertLinkClient) else 0.0
    tokens, start = 0, time.perf_counter()
    while engine.has_unfinished():
        tokens += sum(len(o.new_token_ids) for o in engine.step())
    sync()
    total = time.perf_counter() - start
    SparseMoeBlock.combine, ExpertLinkClient.wait = combine, wait  # type: ignore[method-assign]
    by_kind: dict[str, list[float]] = defaultdict(list)
    for kind, seconds in calls:
        by_kind[kind].append(seconds)
    per_token = {k: sum(v) / tokens * 1e3 for k, v in by_kind.items()}
    out: dict[str, Any] = {
        "tokens": tokens,
        "ms_per_token": total / tokens * 1e3,
        "combine_ms_per_token": per_token,
        "combine_calls_per_token": {k: len(v) / tokens for k, v in by_kind.items()},
        "combine_median_us": {k: statistics.median(v) * 1e6 for k, v in by_kind.items()},
        "rest_ms_per_token": (total - sum(s for _, s in calls)) / tokens * 1e3,
        "worker_wait_ms_per_token": sum(waits) / tokens * 1e3,
        "worker_compute_ms_per_token": (client.cpu_s - cpu_before) / tokens * 1e3
        if isinstance(client, ExpertLinkClient)
        else None,
        "latency_model": latency.figures(),
    }
    # One expert at one token: through the worker, in this thread, fetched and run on the device.
    block = moe_blocks(engine.loaded.model)[0]
    assert block.store is not None
    x = torch.randn(1, engine.spec.hidden_size, dtype=engine.spec.dtype)
    cpu = torch.device("cpu")
    if isinstance(client, ExpertLinkClient):
        out["worker_round_trip_us"] = (
            best_of(10, lambda: client.wait(client.submit(0, [(3, x)]), [(3, x)]), cpu) * 1e6
        )
    out["in_thread_cpu_us"] = best_of(10, lambda: block.store.run_cpu(3, x), cpu) * 1e6
    dev = engine.device

    def fetch() -> None:
        cache.gate_up.copy_(0, block.store.gate_up, 3, non_blocking=True)
        cache.down.copy_(0, block.store.down, 3, non_blocking=True)

    out["fetch_us"] = best_of(10, fetch, dev) * 1e6
    out["device_expert_us"] = best_of(10, lambda: cache.run(0, x.to(dev)), dev) * 1e6
    RESULT.update(out)
    return {"decode_tok_s": tokens / total}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="mixtral-8x7b")
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--budget-mb", type=int, default=24576)
    parser.add_argument("--cpu-max-tokens", type=int, default=None)
    args = parser.parse_args()
    bench_args = moe_bench.build_parser().parse_args(
        [
            "--model",
            args.model,
            "--budget-mb",
            str(args.budget_mb),
            "--expert-format",
            "int4",
            "--new-tokens",
            str(args.new_tokens),
            "--in-process",
        ]
    )
    bench_args.cpu_max_tokens = args.cpu_max_tokens
    moe_bench._decode = profile  # type: ignore[assignment]
    moe_bench.ours(bench_args, skewed=False)
    RESULT["machine"] = machine_info()
    RESULT["command"] = "python bench/moe_step_profile.py " + " ".join(sys.argv[1:])
    name = "moe_step_profile" if args.cpu_max_tokens is None else "moe_step_profile_fetch"
    write_out(f"{name}.json", RESULT)
    r = RESULT
    print(
        f"\n{args.model} int4, {args.budget_mb} MiB, uniform, batch 1: "
        f"{r['ms_per_token']:.1f} ms/token"
    )
    for kind, ms in sorted(r["combine_ms_per_token"].items()):
        print(
            f"  experts {kind:10s} {ms:6.1f} ms/token  {r['combine_calls_per_token'][kind]:5.1f} "
            f"layers/token  median {r['combine_median_us'][kind]:7.0f} us"
        )
    print(f"  rest (pieces, syncs, sampling) {r['rest_ms_per_token']:.1f} ms/token")
    print(
        f"  worker: waited {r['worker_wait_ms_per_token']:.1f} ms/token, computed "
        f"{r['worker_compute_ms_per_token']} ms/token"
    )
    print(
        f"  one expert, 1 token: worker round trip {r.get('worker_round_trip_us', 0):.0f} us, "
        f"in thread {r['in_thread_cpu_us']:.0f} us, fetch {r['fetch_us']:.0f} us, "
        f"device {r['device_expert_us']:.0f} us"
    )


if __name__ == "__main__":
    main()
