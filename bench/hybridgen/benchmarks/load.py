"""The project's load client: what a client of `hybridgen serve` sees, under a given load.

    python -m hybridgen.benchmarks.load --config FILE [--model M] [--device D]
        [--target HOST:PORT] --requests N [--concurrency C] --prompt-len L [--prompt-len-max H]
        [--max-new-tokens T] [--arrival all | poisson --rate R] [--runs 3] [--warmup 1]
        [--name LABEL] [--out FILE.json]
    python -m hybridgen.benchmarks.load --config FILE --chat WORKLOAD.json [--concurrency C] ...
        (a multi-turn chat workload, replayed as its users would send it: chat_replay.py)

Starts `hybridgen serve` with --config (or uses the server at --target) and streams Generate
over grpc.aio: N requests of random prompt token ids (distinct per request and run, so no
request reuses another's prefix), greedy, ignoring EOS so each makes exactly T tokens. They
arrive all at once (`all`: N in flight) or at Poisson times of rate R requests/s (`poisson`),
with at most C in flight either way. Each measured run (after --warmup untimed ones) reports:

- ttft_ms p50/p99: from sending a request to its first token;
- gap_ms p50/p99: between two streamed messages of one request (after its first);
- tokens_per_message: tokens a message carries, after the first;
- stream_tok_s p50: one request's tokens after its first, over the time they took;
- total_tok_s: every token over the run's wall time (first send to last token);
- steady_tok_s: tokens received while every request was decoding (from the last first token
  to the first finish), over that window: the decode throughput of the whole batch. Set only
  for `all` arrivals, where such a window exists.

With --inprocess the same requests first run through the engine in this process (all at
once, as engine_bench times it, prefix reuse off as its warm-up repeats them): its TTFT,
decode tok/s and decode step time go beside the served figures, with gap_over_step = the
served gap p50 over that step time. gap_over_served_step is the gap p50 over the server's
own decode step at the run's concurrency (GetModelInfo decode_step_ms): whether tokens leave
as they are made, apart from what sharing the machine with the client costs the step.

The figures are the median over --runs; every run is in the JSON (--out), which also records
the machine, the commit, the command and the server's GetModelInfo. A table is printed last.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import structlog

from hybridgen.benchmarks.chat_workload import WorkloadError
from hybridgen.benchmarks.chat_workload import load as load_chat
from hybridgen.benchmarks.e2e_benchmark import BenchmarkError, int_range, served
from hybridgen.benchmarks.e2e_plot import percentile
from hybridgen.benchmarks.report import machine_info
from hybridgen.benchmarks.server_time import (
    median_passes,
    median_phases,
    pass_counts,
    passes_line,
    phase_line,
    phase_seconds,
    run_passes,
    run_phases,
)
from hybridgen.config.file import ConfigError, load_config
from hybridgen.runtime import log as hlog

log = structlog.get_logger()


@dataclass
class Stream:
    """One request as the client saw it."""

    prompt_tokens: int
    """Tokens of its prompt."""
    sent: float = 0.0
    """When it was sent (perf_counter seconds)."""
    arrivals: list[float] = field(default_factory=list)
    """When each message that carried tokens arrived."""
    counts: list[int] = field(default_factory=list)
    """Tokens each of those messages carried."""
    error: str | None = None
    """The status it ended with, if not OK."""

    @property
    def tokens(self) -> int:
        return sum(self.counts)


@dataclass(frozen=True)
class Workload:
    """What one run sends."""

    requests: int
    """Requests in a run."""
    concurrency: int
    """Most requests in flight at once."""
    prompt_len: tuple[int, int]
    """Prompt length range, inclusive (drawn uniformly per request)."""
    max_new_tokens: int
    """Tokens each request generates (EOS ignored)."""
    arrival: str
    """all: every request at once; poisson: at exponential gaps of mean 1 / rate."""
    rate: float
    """Poisson arrival rate, requests per second."""


def prompts(work: Workload, vocab: int, seed: int) -> list[list[int]]:
    """Random prompt ids in [vocab / 8, vocab) (clear of most special tokens), one list per
    request; distinct seeds give prompts that share no block with each other."""
    rng = random.Random(seed)
    lo, hi = work.prompt_len
    low_id = vocab // 8
    return [
        [rng.randrange(low_id, vocab) for _ in range(rng.randint(lo, hi))]
        for _ in range(work.requests)
    ]


async def _one(stub: Any, ids: list[int], work: Workload, stream: Stream, timeout: float) -> None:
    import grpc

    from hybridgen.v1 import generation_pb2 as pb

    request = pb.GenerateRequest(
        prompt_token_ids=ids,
        max_tokens=work.max_new_tokens,
        ignore_eos=True,
        sampling=pb.SamplingParams(temperature=0.0),
    )
    stream.sent = time.perf_counter()
    try:
        async for message in stub.Generate(request, timeout=timeout):
            if message.token_ids:
                stream.arrivals.append(time.perf_counter())
                stream.counts.append(len(message.token_ids))
    except grpc.RpcError as exc:
        stream.error = f"{exc.code().name}: {exc.details()}"


async def run_once(
    target: str, work: Workload, ids: list[list[int]], seed: int, timeout: float
) -> list[Stream]:
    """One run of the workload against the server at `target`."""
    import grpc

    from hybridgen.v1 import generation_pb2_grpc as pb_grpc

    streams = [Stream(len(p)) for p in ids]
    slots = asyncio.Semaphore(work.concurrency)
    rng = random.Random(seed)
    options = [("grpc.max_receive_message_length", 64 << 20)]
    async with grpc.aio.insecure_channel(target, options=options) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)

        async def go(i: int) -> None:
            async with slots:
                await _one(stub, ids[i], work, streams[i], timeout)

        tasks = []
        for i in range(work.requests):
            if work.arrival == "poisson" and i:
                await asyncio.sleep(rng.expovariate(work.rate))
            tasks.append(asyncio.create_task(go(i)))
        await asyncio.gather(*tasks)
    return streams


def summarize(streams: Sequence[Stream], arrival: str) -> dict[str, Any]:
    """The figures of one run (module docstring)."""
    ok = [s for s in streams if s.error is None and s.arrivals]
    gaps = [(b - a) * 1e3 for s in ok for a, b in zip(s.arrivals, s.arrivals[1:], strict=False)]
    later_counts = [c for s in ok for c in s.counts[1:]]
    ttft = [(s.arrivals[0] - s.sent) * 1e3 for s in ok]
    rates = [
        (s.tokens - s.counts[0]) / (s.arrivals[-1] - s.arrivals[0])
        for s in ok
        if len(s.arrivals) > 1 and s.arrivals[-1] > s.arrivals[0]
    ]
    result: dict[str, Any] = {
        "requests": len(streams),
        "failed": len(streams) - len(ok),
        "errors": sorted({s.error for s in streams if s.error})[:5],
        "tokens": sum(s.tokens for s in ok),
        "ttft_ms_p50": percentile(ttft, 50) if ttft else None,
        "ttft_ms_p99": percentile(ttft, 99) if ttft else None,
        "gap_ms_p50": percentile(gaps, 50) if gaps else None,
        "gap_ms_p99": percentile(gaps, 99) if gaps else None,
        "tokens_per_message": statistics.fmean(later_counts) if later_counts else None,
        "stream_tok_s_p50": percentile(rates, 50) if rates else None,
        "total_tok_s": None,
        "steady_tok_s": None,
    }
    if ok:
        wall = max(s.arrivals[-1] for s in ok) - min(s.sent for s in streams)
        result["total_tok_s"] = result["tokens"] / wall if wall > 0 else None
    if ok and arrival == "all":
        result["steady_tok_s"] = _steady(ok)
    return result


def _steady(streams: Sequence[Stream]) -> float | None:
    """Tokens received while every stream was decoding, over that window."""
    start = max(s.arrivals[0] for s in streams)
    end = min(s.arrivals[-1] for s in streams)
    if end <= start:
        return None
    tokens = sum(
        c for s in streams for t, c in zip(s.arrivals, s.counts, strict=True) if start < t <= end
    )
    return tokens / (end - start)


FIGURES = (
    "ttft_ms_p50",
    "ttft_ms_p99",
    "gap_ms_p50",
    "gap_ms_p99",
    "tokens_per_message",
    "stream_tok_s_p50",
    "total_tok_s",
    "steady_tok_s",
)


def median_of(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Each figure's median over the runs that have it."""
    out: dict[str, Any] = {}
    for name in FIGURES:
        values = [r[name] for r in runs if r.get(name) is not None]
        out[name] = statistics.median(values) if values else None
    out["failed"] = sum(r["failed"] for r in runs)
    return out


def model_info(target: str) -> Any:
    """The GetModelInfoResponse of the server at `target` (BenchmarkError: none answers)."""
    import grpc

    from hybridgen.v1 import generation_pb2 as pb
    from hybridgen.v1 import generation_pb2_grpc as pb_grpc

    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        try:
            return stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
        except grpc.RpcError as exc:
            why = f"{exc.code().name}: {exc.details()}"
            raise BenchmarkError(f"no HybridGen server answering at {target} ({why})") from exc


def bench(target: str, args: argparse.Namespace) -> dict[str, Any]:
    """Warm-up and measured runs against the server at `target`."""
    info = model_info(target)
    work: Workload = args.workload
    if work.prompt_len[1] + work.max_new_tokens > info.max_model_len:
        raise BenchmarkError(
            f"--prompt-len {work.prompt_len[1]} plus --max-new-tokens {work.max_new_tokens} is "
            f"beyond the served context of {info.max_model_len} tokens ({info.model}); shorten "
            "them or serve a longer context (model.max_model_len)"
        )
    runs = []
    for r in range(args.warmup + args.runs):
        ids = prompts(work, info.vocab_size, seed=args.seed + r)
        before, counted = phase_seconds(info), pass_counts(info)  # the last answer's
        start = time.perf_counter()
        streams = asyncio.run(run_once(target, work, ids, args.seed + r, args.timeout))
        wall_s = time.perf_counter() - start
        info = model_info(target)
        figures = summarize(streams, work.arrival)
        log.info("load_run", run=r, warmup=r < args.warmup, **_rounded(figures))
        if r >= args.warmup:
            figures["server_time"] = run_phases(before, phase_seconds(info), wall_s)
            figures["server_passes"] = run_passes(
                counted, pass_counts(info), figures["server_time"]
            )
            runs.append(figures)
    from google.protobuf.json_format import MessageToDict

    median = median_of(runs)
    median["server_time"] = median_phases(runs)
    median["server_passes"] = median_passes(runs)
    bucket = 1 << max(work.concurrency - 1, 0).bit_length()  # step_budget's batch buckets
    step = info.decode_step_ms.get(bucket)
    median["served_step_ms"] = step
    gap = median["gap_ms_p50"]
    median["gap_over_served_step"] = gap / step if gap and step else None
    return {
        "workload": asdict(work),
        "median": median,
        "runs": runs,
        "server_info": MessageToDict(info, preserving_proto_field_name=True),
    }


def inprocess(args: argparse.Namespace) -> dict[str, Any]:
    """The workload's requests through the engine in this process, all at once."""
    from hybridgen.benchmarks.engine_bench import median_runs
    from hybridgen.engine.engine import Engine

    config = load_config(args.config).with_model(args.model)
    # engine_bench's warm-up repeats the timed prompts: without prefix reuse they are
    # computed again, as the served runs' fresh prompts are.
    engine = Engine(dataclasses.replace(config.engine_config(args.device), prefix_reuse=False))
    work: Workload = args.workload
    batch = prompts(work, engine.spec.vocab_size, seed=args.seed)[: work.concurrency]
    try:
        timing = median_runs(engine, batch, work.max_new_tokens, args.runs)
    finally:
        engine.release()
    timing["decode_step_ms"] = len(batch) / timing["decode_tok_s"] * 1e3
    return timing


def _rounded(figures: dict[str, Any]) -> dict[str, Any]:
    return {k: round(v, 2) if isinstance(v, float) else v for k, v in figures.items()}


def print_table(name: str, result: dict[str, Any]) -> None:
    med = result["median"]
    cells = [f"{med[k]:.2f}" if med[k] is not None else "-" for k in FIGURES]
    print(f"| load | {' | '.join(FIGURES)} | failed |")
    print(f"|---|{'---|' * len(FIGURES)}---|")
    print(f"| {name} | {' | '.join(cells)} | {med['failed']} |")
    if "counters" in med:  # a chat run (chat_replay.py)
        from hybridgen.benchmarks.chat_replay import prefix_line

        print(prefix_line(med["counters"]))
    if "server_time" in med:
        print(phase_line(med["server_time"]))
    if "server_passes" in med:
        print(passes_line(med["server_passes"]))
    if med.get("served_step_ms"):
        print(
            f"served: the server's decode step {med['served_step_ms']:.2f} ms"
            f" (GetModelInfo decode_step_ms); gap_ms_p50 over it: {med['gap_over_served_step']:.2f}"
        )
    local = result.get("inprocess")
    if local is not None:
        print(
            f"in-process: ttft_ms {local['ttft_ms']:.1f}, decode_tok_s {local['decode_tok_s']:.1f},"
            f" decode_step_ms {local['decode_step_ms']:.2f}; served gap_ms_p50 over that step:"
            f" {med['gap_over_step'] or 0:.2f}"
        )


# -- arguments ------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m hybridgen.benchmarks.load", description=(__doc__ or "").splitlines()[0]
    )
    ap.add_argument("--config", type=Path, default=None, help="hybridgen_config.yaml to serve")
    ap.add_argument("--model", default=None, help="checkpoint folder or preset (config's)")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--target", default=None, help="HOST:PORT of a running server")
    ap.add_argument("--requests", type=int_range(1), default=1, help="requests in a run")
    ap.add_argument("--concurrency", type=int_range(1), default=None, help="most in flight")
    ap.add_argument("--prompt-len", type=int_range(1), default=512)
    ap.add_argument("--prompt-len-max", type=int_range(1), default=None)
    ap.add_argument("--max-new-tokens", type=int_range(1), default=256)
    ap.add_argument("--arrival", choices=("all", "poisson"), default="all")
    ap.add_argument("--rate", type=float, default=None, help="poisson: requests per second")
    ap.add_argument("--runs", type=int_range(1), default=3, help="measured runs (median)")
    ap.add_argument("--warmup", type=int_range(0), default=1, help="untimed runs first")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per request")
    ap.add_argument("--name", default="load", help="the label of this load in the table")
    ap.add_argument("--out", type=Path, default=None, help="JSON results file")
    ap.add_argument("--port", type=int_range(1, 65535), default=None, help="port to serve on")
    ap.add_argument(
        "--serve-dir", type=Path, default=None, help="the server's config and logs (beside --out)"
    )
    ap.add_argument(
        "--inprocess", action="store_true", help="time the engine in this process first"
    )
    ap.add_argument(
        "--chat",
        type=Path,
        default=None,
        metavar="WORKLOAD",
        help="replay a multi-turn chat workload (bench/make_chat_workload.py) instead; "
        "--concurrency: conversations in flight (chat_replay.py)",
    )
    return ap


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.arrival == "poisson" and not (args.rate and args.rate > 0):
        ap.error("argument --rate: poisson arrivals need a rate > 0 (requests per second)")
    high = args.prompt_len_max or args.prompt_len
    if high < args.prompt_len:
        ap.error(f"argument --prompt-len-max: {high} is below --prompt-len {args.prompt_len}")
    args.workload = Workload(
        args.requests,
        args.concurrency or args.requests,
        (args.prompt_len, high),
        args.max_new_tokens,
        args.arrival,
        args.rate or 0.0,
    )
    try:
        args.mode = load_config(args.config).mode
    except ConfigError as exc:
        ap.error(f"argument --config: {exc}")
    if args.chat is not None and args.inprocess:
        ap.error("argument --inprocess: not with --chat (it times one batch of fresh prompts)")
    if args.chat is not None:
        try:
            load_chat(args.chat)
        except WorkloadError as exc:
            ap.error(f"argument --chat: {exc}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    hlog.configure()
    head = {
        "name": args.name,
        "machine": machine_info(),
        "command": " ".join(["python -m hybridgen.benchmarks.load", *argv]),
    }
    try:
        local = inprocess(args) if args.inprocess else None
        run = bench
        if args.chat is not None:
            from hybridgen.benchmarks.chat_replay import bench_chat

            run = bench_chat
        if args.target:
            result = run(args.target, args)
        else:
            report: dict[str, Any] = {}
            folder = args.serve_dir or (args.out.parent if args.out else Path("bench/out"))
            folder = folder / f"serve-{args.name}"
            with served(args, args.mode, folder, report) as target:
                result = run(target, args)
            result["server"] = report
    except (BenchmarkError, RuntimeError, TimeoutError) as exc:
        log.error("load_failed", error=str(exc))
        return 1
    result = {**head, **result}
    if local is not None:
        gap = result["median"]["gap_ms_p50"]
        result["inprocess"] = local
        result["median"]["gap_over_step"] = gap / local["decode_step_ms"] if gap else None
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    print_table(args.name, result)
    return 1 if result["median"]["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
