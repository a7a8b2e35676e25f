"""The gateway's drain on SIGTERM (serving/server.py): calls still running when the grace is
about to end get a status their clients read (gRPC UNAVAILABLE, an SSE error event and
[DONE]) saying the server is stopping, instead of a cut connection and a CancelledError in the
log; and the service's time limits, which carry it, against a request timeout."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import pytest

from hybridgen.serving.metrics import Metrics
from hybridgen.serving.service import GenerationService, RequestTimedOut, ServerStopping
from hybridgen.v1 import generation_pb2 as pb
from hybridgen.v1 import generation_pb2_grpc as pb_grpc
from tests.gateway_harness import ScriptedBackend
from tests.test_gateway import _free_port, _wait_serving

ROOT = Path(__file__).resolve().parents[1]
GRACE_S = 2.0
SERVER = """
import asyncio, sys
sys.path.insert(0, sys.argv[4])  # the repository, for tests.gateway_harness
from hybridgen.config.sections import ServerConfig
from hybridgen.runtime import log
from hybridgen.serving.metrics import Metrics
from hybridgen.serving.server import serve
from tests.gateway_harness import VOCAB, MAX_LEN, ScriptedBackend

class Backend(ScriptedBackend):
    async def model_info(self):
        return {"model": "tiny-llama", "vocab_size": VOCAB, "max_model_len": MAX_LEN}

log.configure()
port, http = int(sys.argv[1]), int(sys.argv[2])
config = ServerConfig(port=port, metrics_port=0, http_port=http)
asyncio.run(serve(Backend(period_s=0.05), config, Metrics(), grace_s=float(sys.argv[3]),
                  watchdog=False))
"""


def test_time_limits_end_with_the_stop_or_the_timeout_whichever_is_first() -> None:
    async def scenario() -> list[str]:
        service = GenerationService(ScriptedBackend(), Metrics(), 4, request_timeout_s=0.3)
        loop = asyncio.get_running_loop()

        async def call(seconds: float) -> str:
            try:
                async with service.time_limit():
                    await asyncio.sleep(seconds)
            except (ServerStopping, RequestTimedOut) as exc:
                return type(exc).__name__
            return "finished"

        early = asyncio.create_task(call(10))  # its own limit (0.3 s) comes first
        await asyncio.sleep(0.01)
        service.stop_calls_at(loop.time() + 0.6)
        late = asyncio.create_task(call(0.1))  # ends before either
        service.request_timeout_s = 0.0  # no limit of its own: the stop ends it
        endless = asyncio.create_task(call(10))
        t0 = loop.time()
        results = await asyncio.gather(early, late, endless)
        assert 0.5 <= loop.time() - t0 <= 2.0
        return results

    assert asyncio.run(scenario()) == ["RequestTimedOut", "finished", "ServerStopping"]


@pytest.mark.slow
def test_sigterm_ends_running_calls_with_a_status(tmp_path: Path) -> None:
    port, http = _free_port(), _free_port()
    script = tmp_path / "server.py"
    script.write_text(SERVER)
    log = tmp_path / "server.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, str(script), str(port), str(http), str(GRACE_S), str(ROOT)],
            stdout=out,
            stderr=out,
            cwd=ROOT,
        )
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        _wait_serving(channel, proc, log)
        stub = pb_grpc.GenerationServiceStub(channel)
        seen: dict[str, Any] = {"grpc_tokens": 0, "sse": []}

        def grpc_call() -> None:
            request = pb.GenerateRequest(prompt_token_ids=[1, 2, 3], max_tokens=120)
            try:
                for message in stub.Generate(request, timeout=30):
                    seen["grpc_tokens"] += len(message.token_ids)
            except grpc.RpcError as exc:
                seen["grpc_error"] = (exc.code(), exc.details())

        def sse_call() -> None:
            body = json.dumps({"prompt": "hi", "max_tokens": 120, "stream": True}).encode()
            request = urllib.request.Request(
                f"http://127.0.0.1:{http}/v1/completions",
                data=body,
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(request, timeout=30) as reply:
                for line in reply:
                    if line.strip():
                        seen["sse"].append(line.decode().strip())

        argv = ["generate", "hi", "--port", str(port), "--max-tokens", "120"]
        cli = subprocess.Popen(
            [sys.executable, "-m", "hybridgen.cli.main", *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

        def cli_call() -> None:
            assert cli.stdout is not None
            while char := cli.stdout.read(1):
                seen["cli"] = seen.get("cli", "") + char

        threads = [threading.Thread(target=f) for f in (grpc_call, sse_call, cli_call)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and (
            seen["grpc_tokens"] < 3 or len(seen["sse"]) < 3 or "2 " not in seen.get("cli", "")
        ):
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)  # 120 tokens at 20 a second outlast the 2 s grace
        stopped = time.monotonic()
        for t in threads:
            t.join(timeout=20)
        assert proc.wait(timeout=20) == 0, log.read_text()[-3000:]
        assert cli.wait(timeout=20) == 3  # unavailable
        assert time.monotonic() - stopped < GRACE_S + 3
    finally:
        channel.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    code, details = seen["grpc_error"]
    assert code == grpc.StatusCode.UNAVAILABLE and "the server is stopping" in details
    assert 3 <= seen["grpc_tokens"] < 120
    events = seen["sse"]
    assert events[-1] == "data: [DONE]", events[-3:]
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert error["type"] == "service_unavailable" and "the server is stopping" in error["message"]
    assert cli.stderr is not None
    said = cli.stderr.read()  # not "no server answering": it answered, then stopped
    assert f"the server at 127.0.0.1:{port} ended the request before its end: " in said, said
    assert "the server is stopping" in said
    text = log.read_text()
    assert "CancelledError" not in text and "Traceback" not in text, text[-3000:]
