"""Work is bounded before it is done: a prompt too long for the context is refused before it
is tokenized, a huge stop_token_ids or prompt_token_ids list before it is copied, and
tokenizing lets the other threads of the process (the daemons' heartbeats) run."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from hybridgen.config.engine import EngineConfig
from hybridgen.models.tokenizer import Tokenizer
from hybridgen.serving.engine_backend import EngineBackend
from hybridgen.v1 import generation_pb2 as pb
from hybridgen.v1 import generation_pb2_grpc as pb_grpc
from tests.checkpoints import CORPUS
from tests.conftest import KINDS
from tests.gateway_harness import InProcessGateway, serving

MB = 2**20


@pytest.mark.parametrize("kind", KINDS)
def test_max_text_bytes_never_refuses_text_that_fits(checkpoint: Any, kind: str) -> None:
    """The bound is safe: no text encodes to fewer tokens than its bytes / (longest token x
    normalizer shrink), including texts made of the longest tokens themselves."""
    tokenizer = Tokenizer.from_dir(checkpoint(kind))
    per_token = tokenizer.max_text_bytes(1)
    assert per_token is not None
    ids = range(tokenizer.vocab_size)
    longest = sorted(ids, key=lambda i: -len(tokenizer.decode([i]).encode()))[:32]
    rng = random.Random(0)
    texts = [CORPUS, "".join(tokenizer.decode([i]) for i in longest * 8)]
    texts += ["".join(rng.choice(CORPUS) for _ in range(2000)) for _ in range(4)]
    texts += [tokenizer.decode(rng.sample(ids, 200)) for _ in range(4)]
    for text in texts:
        tokens = len(tokenizer.encode(text, add_special_tokens=False))
        assert len(text.encode()) <= tokenizer.max_text_bytes(tokens) == tokens * per_token


def test_encoding_a_long_text_lets_other_threads_run(checkpoint: Any) -> None:
    tokenizer = Tokenizer.from_dir(checkpoint("llama3"))
    text = CORPUS * (2 * MB // len(CORPUS))
    gaps, done = [0.0], threading.Event()

    def heartbeat() -> None:
        last = time.monotonic()
        while not done.is_set():
            time.sleep(0.002)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    beat = threading.Thread(target=heartbeat)
    beat.start()
    start = time.monotonic()
    ids = tokenizer.encode(text)
    took = time.monotonic() - start
    done.set()
    beat.join()
    assert len(ids) > 100_000 and took > 0.5
    # Only turning the ids into a Python list holds the GIL (was: the whole encode).
    assert max(gaps) < max(0.25, took / 4), (max(gaps), took)


@pytest.fixture(scope="module")
def gateway(checkpoint: Any) -> Iterator[InProcessGateway]:
    config = EngineConfig(
        model=str(checkpoint("llama3")), device="cpu", gpu_memory_mb=256, max_model_len=256
    )
    with serving(EngineBackend(config), max_message_mb=64) as gw:
        yield gw


def refused_in(gateway: InProcessGateway, rpc: str, request: Any) -> tuple[str, float]:
    """The INVALID_ARGUMENT details of a call, and how long the refusal took."""
    with grpc.insecure_channel(gateway.target, options=_big()) as channel:
        api = pb_grpc.GenerationServiceStub(channel)
        start = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            reply = getattr(api, rpc)(request, timeout=60)
            if rpc == "Generate":
                list(reply)  # a stream fails when it is read
        took = time.monotonic() - start
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
    return err.value.details(), took


def _big() -> list[tuple[str, int]]:
    return [("grpc.max_send_message_length", 64 * MB)]


def test_a_prompt_too_long_for_the_context_is_refused_before_tokenizing(
    gateway: InProcessGateway,
) -> None:
    text = "The quick brown fox. " * (10 * MB // 21)
    details, took = refused_in(gateway, "Generate", pb.GenerateRequest(prompt=text))
    assert details.startswith(f"prompt: is {len(text)} bytes of UTF-8, more than any text of")
    assert "at most 256 tokens (max_model_len)" in details and took < 1.0
    details, took = refused_in(gateway, "Tokenize", pb.TokenizeRequest(text=text))
    assert details.startswith("text: is ") and took < 1.0


def test_huge_id_lists_are_refused_before_they_are_copied(gateway: InProcessGateway) -> None:
    stops = pb.GenerateRequest(prompt="Hi", stop_token_ids=[2] * 3_000_000)
    details, took = refused_in(gateway, "Generate", stops)
    assert details == "stop_token_ids: has 3000000 ids; at most 1024 are allowed" and took < 1.0
    prompt = pb.GenerateRequest(prompt_token_ids=[5] * 3_000_000)
    details, took = refused_in(gateway, "Generate", prompt)
    assert details.startswith("prompt: has 3000000 tokens; the context allows at most 255")
    assert took < 1.0
    many = pb.GenerateRequest(prompt="Hi", stop=["x"] * 1_000_000)
    details, took = refused_in(gateway, "Generate", many)
    assert details.startswith("stop: at most 16 stop strings") and took < 1.0


def test_a_prompt_that_fits_still_generates(gateway: InProcessGateway) -> None:
    with grpc.insecure_channel(gateway.target) as channel:
        api = pb_grpc.GenerationServiceStub(channel)
        request = pb.GenerateRequest(prompt="The quick brown fox", max_tokens=4, ignore_eos=True)
        assert list(api.Generate(request, timeout=60))[-1].usage.completion_tokens == 4
