"""The load client's chat mode: a multi-turn workload (chat_workload.py) replayed through
`hybridgen serve` as its users would send it.

    python -m hybridgen.benchmarks.load --config FILE --chat WORKLOAD.json [--concurrency C]
        [--runs 1] [--warmup 1] [--name LABEL] [--out FILE.json]

Each conversation sends its next turn when the answer to the previous one has ended, plus a
think time (exponential, of the file's mean): its prompt is the system prompt, every earlier
turn's user tokens and the token ids the server answered with, then the new user tokens,
greedy with EOS ignored. At most C conversations are in flight (one holds its slot from its
first turn to its last answer). Each turn is one request of the load client's figures
(load.py: TTFT, gaps, tok/s; no steady window, as turns never all decode at once), and each
run also reports what GetModelInfo counted during it: prefix hits and tokens not computed,
by tier (hot, warm, cold), the blocks written back for reuse and those the keep gate skipped,
and the spill decisions.

A warm-up run replays the first 4 conversations' first 2 turns with ids of their own (it
compiles the kernels at the lengths that matter without warming the cache of the timed run).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from typing import Any

import structlog

from hybridgen.benchmarks.chat_workload import ChatWorkload, Conversation, load
from hybridgen.benchmarks.e2e_benchmark import BenchmarkError
from hybridgen.benchmarks.load import Stream, median_of, model_info, summarize
from hybridgen.benchmarks.server_time import (
    median_passes,
    median_phases,
    pass_counts,
    phase_seconds,
    run_passes,
    run_phases,
)

log = structlog.get_logger()

COUNTERS = (
    *(f"prefix_{tier}_{what}" for what in ("hits", "tokens") for tier in ("hot", "warm", "cold")),
    "prefix_cached_tokens",
    "warm_kept_blocks",
    "warm_keep_skipped",
    "warm_keep_recomputed",
    *(f"spill_decisions_{c}" for c in ("wait", "swap", "turns", "spill")),
)
"""GetModelInfo counters a run reports the growth of."""
WARMUP_CONVERSATIONS, WARMUP_TURNS = 4, 2


async def _turn(
    stub: Any, prompt: list[int], max_tokens: int, stream: Stream, timeout: float
) -> list[int]:
    """One turn's Generate, timed into `stream`; returns the answer's token ids."""
    import grpc

    from hybridgen.v1 import generation_pb2 as pb

    request = pb.GenerateRequest(
        prompt_token_ids=prompt,
        max_tokens=max_tokens,
        ignore_eos=True,
        sampling=pb.SamplingParams(temperature=0.0),
    )
    answer: list[int] = []
    stream.sent = time.perf_counter()
    try:
        async for message in stub.Generate(request, timeout=timeout):
            if message.token_ids:
                stream.arrivals.append(time.perf_counter())
                stream.counts.append(len(message.token_ids))
                answer += message.token_ids
    except grpc.RpcError as exc:
        stream.error = f"{exc.code().name}: {exc.details()}"
    return answer


async def replay(
    target: str, work: ChatWorkload, vocab: int, run: int, concurrency: int, timeout: float
) -> list[Stream]:
    """One run of `work` (run-specific token ids) against the server at `target`."""
    import grpc

    from hybridgen.v1 import generation_pb2_grpc as pb_grpc

    options = [("grpc.max_receive_message_length", 64 << 20)]
    async with grpc.aio.insecure_channel(target, options=options) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        return await replay_on(stub, work, vocab, run, concurrency, timeout)


async def replay_on(
    stub: Any, work: ChatWorkload, vocab: int, run: int, concurrency: int, timeout: float
) -> list[Stream]:
    """`replay` through a GenerationService stub (module doc); the streams in send order."""
    system, users = work.token_ids(vocab, run)
    rng = random.Random(f"think-{work.seed}-{run}")
    streams: list[Stream] = []
    slots = asyncio.Semaphore(concurrency)

    async def conversation(conv: Conversation, user: list[list[int]]) -> None:
        async with slots:
            history = list(system)
            for t, want in enumerate(conv.answer_tokens):
                prompt = history + user[t]
                stream = Stream(len(prompt))
                streams.append(stream)
                answer = await _turn(stub, prompt, want, stream, timeout)
                if stream.error is not None:
                    return  # the rest of a conversation needs this answer
                history = prompt + answer
                if work.think_s and t + 1 < len(conv.answer_tokens):
                    await asyncio.sleep(rng.expovariate(1 / work.think_s))

    pairs = zip(work.conversations, users, strict=True)
    await asyncio.gather(*(conversation(c, u) for c, u in pairs))
    return streams


def warmup_slice(work: ChatWorkload) -> ChatWorkload:
    """The warm-up run's workload: the first conversations' first turns, no think time."""
    convs = tuple(
        Conversation(c.user_tokens[:WARMUP_TURNS], c.answer_tokens[:WARMUP_TURNS])
        for c in work.conversations[:WARMUP_CONVERSATIONS]
    )
    return ChatWorkload(work.system_tokens, convs, 0.0, work.seed)


def counters(info: Any) -> dict[str, int]:
    """The COUNTERS of a GetModelInfoResponse."""
    return {name: int(getattr(info, name)) for name in COUNTERS}


def bench_chat(target: str, args: argparse.Namespace) -> dict[str, Any]:
    """Warm-up and measured runs of the --chat workload against the server at `target`."""
    from google.protobuf.json_format import MessageToDict

    work: ChatWorkload = load(args.chat)
    concurrency = args.concurrency or len(work.conversations)
    info = model_info(target)
    if work.max_context > info.max_model_len:
        raise BenchmarkError(
            f"--chat {args.chat}: a conversation grows to {work.max_context} tokens, beyond the "
            f"served context of {info.max_model_len} ({info.model}); serve a longer "
            "model.max_model_len or make the workload with a lower --context"
        )
    for r in range(args.warmup):
        first = warmup_slice(work)
        streams = asyncio.run(
            replay(target, first, info.vocab_size, -1 - r, concurrency, args.timeout)
        )
        log.info("chat_warmup", run=r, failed=sum(s.error is not None for s in streams))
    runs = []
    after = model_info(target)  # each run starts from the last answer
    for r in range(args.runs):
        first, start = after, time.perf_counter()
        streams = asyncio.run(
            replay(target, work, info.vocab_size, args.seed + r, concurrency, args.timeout)
        )
        wall_s = time.perf_counter() - start
        after = model_info(target)
        figures = summarize(streams, "chat")
        before = counters(first)
        figures["counters"] = {k: v - before[k] for k, v in counters(after).items()}
        figures["server_time"] = run_phases(phase_seconds(first), phase_seconds(after), wall_s)
        figures["server_passes"] = run_passes(
            pass_counts(first), pass_counts(after), figures["server_time"]
        )
        log.info("chat_run", run=r, **{k: v for k, v in figures.items() if k != "counters"})
        runs.append(figures)
    median = median_of(runs)
    median["counters"] = {k: statistics.median(r["counters"][k] for r in runs) for k in COUNTERS}
    median["server_time"] = median_phases(runs)
    median["server_passes"] = median_passes(runs)
    shape = {
        "file": str(args.chat),
        "concurrency": concurrency,
        "conversations": len(work.conversations),
        "turns": work.turns,
        "max_context": work.max_context,
    }
    return {
        "workload": {**work.to_json(), **shape, "kind": "chat"},
        "median": median,
        "runs": runs,
        "server_info": MessageToDict(after, preserving_proto_field_name=True),
    }


def prefix_line(counts: dict[str, float]) -> str:
    """The prefix cache's part of a chat run, as printed under the load client's table."""
    tiers = ", ".join(
        f"{t} {counts[f'prefix_{t}_hits']:.0f} turns / {counts[f'prefix_{t}_tokens']:.0f} tokens"
        for t in ("hot", "warm", "cold")
    )
    decisions = ", ".join(
        f"{c} {counts[f'spill_decisions_{c}']:.0f}" for c in ("wait", "swap", "turns", "spill")
    )
    return (
        f"prefix cache: {counts['prefix_cached_tokens']:.0f} prompt tokens not computed ({tiers});"
        f" {counts['warm_kept_blocks']:.0f} blocks kept in Warm"
        f" ({counts['warm_keep_skipped']:.0f} skipped, {counts['warm_keep_recomputed']:.0f} of"
        f" their blocks computed again); spill decisions: {decisions}"
    )
