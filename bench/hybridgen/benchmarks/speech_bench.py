"""Speech-shaped streaming input (issue 22): the time to first token after the end of speech.

    python -m hybridgen.benchmarks.speech_bench --model llama3-8b [--config FILE] \\
        [--sessions 16] [--concurrency 1] [--out DIR] [--target HOST:PORT]

A speaker's transcript (--transcript-tokens, 4K) arrives as ASR would send it: a chunk of
words every --chunk-ms (200 ms) over --speech-s (20 s), after a --system-tokens (1K) system
prompt sent with the start. Each session sends it twice:

- streamed: StreamGenerate, the system prompt in `start`, each chunk as it is "spoken"; the
  server prefills each chunk as it comes. TTFT counts from the last chunk's send.
- whole: Generate with the same system prompt and a transcript of the same length sent at
  the end of speech (another text, so that nothing of it is cached; the system prompt is,
  as it would be in a deployment). TTFT counts from the send.

Starts `hybridgen serve` (or uses --target), runs one short warm-up session, then the timed
ones (--concurrency at a time), and writes <out>/speech.json: TTFT p50 / p99 / mean of both
and their ratio, with the chunk sizes in tokens. Greedy, EOS ignored, --max-tokens tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import statistics
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import grpc

from hybridgen.benchmarks.e2e_benchmark import served
from hybridgen.benchmarks.report import machine_info, write_out
from hybridgen.runtime import log as hlog
from hybridgen.v1 import generation_pb2 as pb
from hybridgen.v1 import generation_pb2_grpc as pb_grpc

WORDS = (
    "the",
    "patient",
    "reports",
    "a",
    "mild",
    "headache",
    "since",
    "yesterday",
    "morning",
    "and",
    "some",
    "dizziness",
    "when",
    "standing",
    "up",
    "quickly",
    "after",
    "lunch",
    "we",
    "checked",
    "blood",
    "pressure",
    "which",
    "was",
    "slightly",
    "elevated",
    "please",
    "schedule",
    "follow-up",
    "visit",
    "next",
    "week",
    "send",
    "lab",
    "results",
    "clinic",
)
TIMEOUT_S = 600.0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hybridgen.benchmarks.speech_bench")
    p.add_argument("--model", default=None, help="checkpoint or preset (default: the config's)")
    p.add_argument("--config", type=Path, default=None, help="hybridgen_config.yaml")
    p.add_argument("--device", default="auto")
    p.add_argument("--port", type=int, default=None)
    p.add_argument("--target", default=None, help="HOST:PORT of a running server instead")
    p.add_argument("--system-tokens", type=int, default=1024)
    p.add_argument("--transcript-tokens", type=int, default=4096)
    p.add_argument("--speech-s", type=float, default=20.0)
    p.add_argument("--chunk-ms", type=float, default=200.0)
    p.add_argument("--sessions", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--out", type=Path, default=Path("."))
    return p


async def make_text(stub: Any, tokens: int, seed: int) -> str:
    """Words (seeded) until the text has `tokens` tokens in the served tokenizer, or one word
    more."""
    rng = random.Random(seed)
    words, count = [rng.choice(WORDS) for _ in range(8)], 0
    while True:
        request = pb.TokenizeRequest(text=" ".join(words), add_special_tokens=False)
        count = len((await stub.Tokenize(request, timeout=60)).token_ids)
        if count >= tokens:
            return " ".join(words)
        per_word = count / len(words)
        more = max(1, int(0.9 * (tokens - count) / per_word))
        words += [rng.choice(WORDS) for _ in range(more)]


def split_words(text: str, parts: int) -> list[str]:
    """`text` in `parts` pieces of about as many words each (each but the first starts with
    the space before its first word, as ASR deltas do)."""
    words = text.split(" ")
    bounds = [round(i * len(words) / parts) for i in range(parts + 1)]
    pieces = [" ".join(words[a:b]) for a, b in itertools.pairwise(bounds)]
    return [pieces[0], *(" " + p for p in pieces[1:])]


def _request(prompt: str, max_tokens: int) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(temperature=0.0)
    return pb.GenerateRequest(
        prompt=prompt, max_tokens=max_tokens, ignore_eos=True, sampling=sampling
    )


async def streamed(
    stub: Any, system: str, chunks: Sequence[str], chunk_s: float, max_tokens: int
) -> dict[str, float]:
    """One spoken transcript through StreamGenerate; TTFT from the last chunk's send."""
    sent: list[float] = []

    async def messages() -> AsyncIterator[pb.StreamGenerateRequest]:
        yield pb.StreamGenerateRequest(start=_request(system, max_tokens))
        for i, text in enumerate(chunks):
            await asyncio.sleep(chunk_s)
            last = i == len(chunks) - 1
            sent.append(time.perf_counter())
            yield pb.StreamGenerateRequest(chunk=pb.PromptChunk(text=text, last=last))

    first, prompt_tokens = None, 0
    async for reply in stub.StreamGenerate(messages(), timeout=TIMEOUT_S):
        if first is None and reply.token_ids:
            first = time.perf_counter()
        prompt_tokens = reply.usage.prompt_tokens or prompt_tokens
    assert first is not None and len(sent) == len(chunks)
    return {"ttft_ms": (first - sent[-1]) * 1e3, "prompt_tokens": prompt_tokens}


async def whole(stub: Any, prompt: str, max_tokens: int) -> dict[str, float]:
    """The same shape of prompt sent at once; TTFT from the send."""
    start, first, prompt_tokens = time.perf_counter(), None, 0
    async for reply in stub.Generate(_request(prompt, max_tokens), timeout=TIMEOUT_S):
        if first is None and reply.token_ids:
            first = time.perf_counter()
        prompt_tokens = reply.usage.prompt_tokens or prompt_tokens
    assert first is not None
    return {"ttft_ms": (first - start) * 1e3, "prompt_tokens": prompt_tokens}


async def session(stub: Any, args: argparse.Namespace, system: str, i: int) -> dict[str, Any]:
    """Session i: a streamed transcript, then another one sent whole."""
    parts = max(1, round(args.speech_s * 1000 / args.chunk_ms))
    spoken = await make_text(stub, args.transcript_tokens, 2 * i + 1)
    at_end = await make_text(stub, args.transcript_tokens, 2 * i + 2)
    chunks = split_words(spoken, parts)
    out = {"streamed": await streamed(stub, system, chunks, args.chunk_ms / 1e3, args.max_tokens)}
    out["whole"] = await whole(stub, system + at_end, args.max_tokens)
    return out


def summary(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {"p50": statistics.median(ordered), "p99": p99, "mean": statistics.fmean(ordered)}


async def bench(target: str, args: argparse.Namespace) -> dict[str, Any]:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        system = await make_text(stub, args.system_tokens, 0) + "\n"
        warm = argparse.Namespace(**{**vars(args), "speech_s": 1.0, "chunk_ms": 100.0})
        await session(stub, warm, system, 10_000)  # compiles the shapes; not timed
        gate = asyncio.Semaphore(args.concurrency)

        async def slot(i: int) -> dict[str, Any]:
            async with gate:
                return await session(stub, args, system, i)

        runs = await asyncio.gather(*(slot(i) for i in range(args.sessions)))
        info = await stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=60)
    parts = max(1, round(args.speech_s * 1000 / args.chunk_ms))
    streamed_ms = [r["streamed"]["ttft_ms"] for r in runs]
    whole_ms = [r["whole"]["ttft_ms"] for r in runs]
    result = {
        "model": info.model,
        "device": info.device,
        "synthetic": info.synthetic,
        "prompt_tokens": runs[0]["streamed"]["prompt_tokens"],
        "chunks": parts,
        "chunk_tokens": args.transcript_tokens / parts,
        "ttft_after_last_chunk_ms": summary(streamed_ms),
        "ttft_whole_prompt_ms": summary(whole_ms),
        "runs": runs,
    }
    result["ratio_p50_whole_over_streamed"] = (
        result["ttft_whole_prompt_ms"]["p50"] / result["ttft_after_last_chunk_ms"]["p50"]
    )
    return result


def print_table(result: dict[str, Any]) -> None:
    s, w = result["ttft_after_last_chunk_ms"], result["ttft_whole_prompt_ms"]
    print(
        f"speech bench: {result['model']} on {result['device']}, "
        f"{result['prompt_tokens']} prompt tokens, {result['chunks']} chunks of "
        f"~{result['chunk_tokens']:.0f} tokens, {len(result['runs'])} sessions"
    )
    print(f"{'TTFT (ms)':<28}{'p50':>10}{'p99':>10}{'mean':>10}")
    for name, row in (("after the last chunk", s), ("whole prompt at the end", w)):
        print(f"{name:<28}{row['p50']:>10.1f}{row['p99']:>10.1f}{row['mean']:>10.1f}")
    print(f"ratio p50 whole / streamed: {result['ratio_p50_whole_over_streamed']:.2f}")


def run(args: argparse.Namespace) -> dict[str, Any]:
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}}
    if args.target is not None:
        result = asyncio.run(bench(args.target, args))
    else:
        folder = Path(tempfile.mkdtemp(prefix="speech-", dir=args.out))
        with served(args, "hybrid", folder, report) as target:
            result = asyncio.run(bench(target, args))
    result = {**report, **result, "machine": machine_info()}
    (args.out / "speech.json").write_text(json.dumps(result, indent=1))
    write_out("speech.json", result)
    print_table(result)
    return result


def main(argv: list[str] | None = None) -> int:
    hlog.configure(json=False)
    run(build_parser().parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
