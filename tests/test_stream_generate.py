"""StreamGenerate through `hybridgen serve` on the default model: a prompt sent in chunks, text
or token ids, gives exactly Generate's greedy tokens for the whole prompt; its KV grows while
the chunks come; a chunk after the last one, or a cancel mid-prompt, ends the call cleanly
and frees the KV."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import Iterator

import grpc
import pytest

from hybridgen.v1 import generation_pb2 as pb
from tests.served import DefaultServer

pytestmark = pytest.mark.slow  # a served default model shared by the module: ~55 s in all

NEW = 24
TEXT = (
    "Speech arrives in pieces: the recognizer sends what it heard so far, every 200 ms.\n"
    "Numbers like 12345 and 3.14, naïve café words, 日本語, and emoji 🙂 split anywhere!  "
    "The server tokenizes each piece as it comes and computes its KV at once."
)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DefaultServer]:
    srv = DefaultServer(tmp_path_factory.mktemp("stream"))
    yield srv
    assert srv.stop() == 0


def greedy(**fields: object) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(temperature=0.0)
    return pb.GenerateRequest(max_tokens=NEW, ignore_eos=True, sampling=sampling, **fields)  # type: ignore[arg-type]


def tokens(replies: Iterator[pb.GenerateResponse]) -> tuple[list[int], str]:
    ids, text = [], ""
    for reply in replies:
        ids += reply.token_ids
        text += reply.text
    return ids, text


def messages(
    start: pb.GenerateRequest, chunks: list[pb.PromptChunk], pause_s: float = 0.02
) -> Iterator[pb.StreamGenerateRequest]:
    yield pb.StreamGenerateRequest(start=start)
    for chunk in chunks:
        time.sleep(pause_s)
        yield pb.StreamGenerateRequest(chunk=chunk)


def text_chunks(text: str, cuts: list[int]) -> list[pb.PromptChunk]:
    bounds = [0, *cuts, len(text)]
    parts = [text[a:b] for a, b in itertools.pairwise(bounds)]
    return [pb.PromptChunk(text=p, last=i == len(parts) - 1) for i, p in enumerate(parts)]


def wait_kv_free(server: DefaultServer) -> None:
    deadline = time.monotonic() + 10
    while server.info().kv_blocks_used:
        assert time.monotonic() < deadline, "the KV was not freed"
        time.sleep(0.05)


@pytest.mark.parametrize("cuts", [[7, 19, 20, 64, 65, 120, 171, 200], list(range(3, 230, 11))])
def test_text_chunks_give_generates_tokens(server: DefaultServer, cuts: list[int]) -> None:
    expected = tokens(server.stub.Generate(greedy(prompt=TEXT), timeout=120))
    chunks = text_chunks(TEXT[cuts[0] :], [c - cuts[0] for c in cuts[1:]])
    start = greedy(prompt=TEXT[: cuts[0]])
    assert tokens(server.stub.StreamGenerate(messages(start, chunks), timeout=120)) == expected


def test_an_empty_start_then_text(server: DefaultServer) -> None:
    expected = tokens(server.stub.Generate(greedy(prompt=TEXT), timeout=120))
    chunks = text_chunks(TEXT, [40, 41, 90])
    got = tokens(server.stub.StreamGenerate(messages(greedy(), chunks), timeout=120))
    assert got == expected


def test_token_id_chunks_give_generates_tokens(server: DefaultServer) -> None:
    ids = server.tokenize(TEXT)
    expected = tokens(server.stub.Generate(greedy(prompt_token_ids=ids), timeout=120))
    chunks = [
        pb.PromptChunk(token_ids=ids[i : i + 9], last=i + 9 >= len(ids))
        for i in range(5, len(ids), 9)
    ]
    start = greedy(prompt_token_ids=ids[:5])
    assert tokens(server.stub.StreamGenerate(messages(start, chunks), timeout=120)) == expected


def test_the_kv_grows_while_the_chunks_come(server: DefaultServer) -> None:
    """Before the last chunk the prompt's KV is already held: it was computed as it came."""
    more, sent = threading.Event(), threading.Event()

    def slow() -> Iterator[pb.StreamGenerateRequest]:
        yield pb.StreamGenerateRequest(start=greedy(prompt=TEXT[:150]))
        sent.set()
        more.wait(60)
        yield pb.StreamGenerateRequest(chunk=pb.PromptChunk(text=TEXT[150:], last=True))

    call = server.stub.StreamGenerate(slow(), timeout=120)
    try:
        assert sent.wait(30)
        deadline = time.monotonic() + 30
        while server.info().kv_blocks_used == 0:
            assert time.monotonic() < deadline, "no KV computed before the last chunk"
            time.sleep(0.05)
        assert server.info().running_requests == 1
    finally:
        more.set()
    assert len(tokens(call)[0]) == NEW
    wait_kv_free(server)


def call_error(
    server: DefaultServer, requests: Iterator[pb.StreamGenerateRequest]
) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        tokens(server.stub.StreamGenerate(requests, timeout=60))
    return err.value


def test_a_chunk_after_the_last_is_invalid_and_frees_the_kv(server: DefaultServer) -> None:
    chunks = [pb.PromptChunk(text=" there", last=True), pb.PromptChunk(text=" again")]
    err = call_error(server, messages(greedy(prompt=TEXT), chunks, pause_s=0.0))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (err.details() or "").startswith("chunk: arrived after the chunk with last: true")
    wait_kv_free(server)


@pytest.mark.parametrize(
    ("first", "chunks", "field"),
    [
        (pb.StreamGenerateRequest(chunk=pb.PromptChunk(text="hi")), [], "start"),
        (
            pb.StreamGenerateRequest(start=greedy(prompt="hi")),
            [pb.PromptChunk(token_ids=[1], last=True)],
            "chunk.token_ids",
        ),
        (
            pb.StreamGenerateRequest(start=greedy(prompt="hi")),
            [pb.PromptChunk(text="a", token_ids=[1], last=True)],
            "chunk",
        ),
        (
            pb.StreamGenerateRequest(start=greedy(prompt_token_ids=[1])),
            [pb.PromptChunk(token_ids=[10**8], last=True)],
            "chunk.token_ids",
        ),
        (
            pb.StreamGenerateRequest(start=greedy(prompt="hi")),
            [pb.PromptChunk(text=" ".join(map(str, range(600))), last=True)],  # > 512 tokens
            "chunk",
        ),
        (pb.StreamGenerateRequest(start=greedy()), [pb.PromptChunk(last=True)], "prompt"),
    ],
)
def test_bad_messages_name_the_field(
    server: DefaultServer,
    first: pb.StreamGenerateRequest,
    chunks: list[pb.PromptChunk],
    field: str,
) -> None:
    def requests() -> Iterator[pb.StreamGenerateRequest]:
        yield first
        for chunk in chunks:
            yield pb.StreamGenerateRequest(chunk=chunk)

    err = call_error(server, requests())
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (err.details() or "").split(":")[0] == field, err.details()
    wait_kv_free(server)


def test_a_cancel_mid_prompt_frees_the_kv(server: DefaultServer) -> None:
    hold = threading.Event()

    def unfinished() -> Iterator[pb.StreamGenerateRequest]:
        yield pb.StreamGenerateRequest(start=greedy(prompt=TEXT))
        hold.wait(60)

    call = server.stub.StreamGenerate(unfinished(), timeout=120)
    deadline = time.monotonic() + 30
    while server.info().kv_blocks_used == 0:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    call.cancel()
    hold.set()
    wait_kv_free(server)
    assert server.info().running_requests == 0
    expected = tokens(server.stub.Generate(greedy(prompt=TEXT), timeout=120))
    assert len(expected[0]) == NEW  # and it still serves


def test_the_speech_benchmark_runs_both_ways(server: DefaultServer) -> None:
    """speech_bench on tiny shapes: both prompts have the asked shape, and both TTFTs and
    their ratio are reported."""
    from hybridgen.benchmarks import speech_bench

    args = speech_bench.build_parser().parse_args(
        [
            "--system-tokens",
            "40",
            "--transcript-tokens",
            "120",
            "--speech-s",
            "0.6",
            "--chunk-ms",
            "100",
            "--sessions",
            "2",
            "--max-tokens",
            "4",
        ]
    )
    result = asyncio.run(speech_bench.bench(f"127.0.0.1:{server.port}", args))
    assert result["chunks"] == 6 and len(result["runs"]) == 2
    for run in result["runs"]:
        streamed, whole = run["streamed"], run["whole"]
        assert abs(streamed["prompt_tokens"] - whole["prompt_tokens"]) <= 4
        # 40 + 120, each up to a word more, with BOS and a newline
        assert 160 <= streamed["prompt_tokens"] <= 185
    assert result["ttft_after_last_chunk_ms"]["p50"] > 0
    assert result["ratio_p50_whole_over_streamed"] > 0
