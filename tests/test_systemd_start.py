"""The systemd units start: each unit's ExecStart, run as the unit has it with what systemd
would give it (a $NOTIFY_SOCKET this test listens on, $WATCHDOG_USEC, the gateway's
LoadCredential= copy in $CREDENTIALS_DIRECTORY), in the units' order, says READY=1 and then
WATCHDOG=1, and a Generate through the gateway answers."""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from hybridgen.v1 import generation_pb2 as pb
from hybridgen.v1 import generation_pb2_grpc as pb_grpc
from tests.test_serving import free_port
from tests.test_systemd import CONFIG, PYTHON, SERVICES, _one

KEY = "test-key-0123456789abcdef"
# What WatchdogSec=2s would set (the units say 30s; a test does not wait 15 s for a ping).
WATCHDOG_USEC = 2_000_000


def exec_start(unit: str, config: Path, credentials: Path) -> list[str]:
    """The unit's ExecStart with the venv's python and the test's config, and
    ${CREDENTIALS_DIRECTORY} expanded as systemd does."""
    line = _one(unit, "Service", "ExecStart")
    argv = shlex.split(line.replace("${CREDENTIALS_DIRECTORY}", str(credentials)))
    assert argv[0] == PYTHON and argv[argv.index("--config") + 1] == CONFIG
    argv[0], argv[argv.index("--config") + 1] = sys.executable, str(config)
    return argv


class Notifications:
    """A datagram socket standing in for systemd's notify socket of one unit."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.lines: list[str] = []

    def wait_for(self, line: str, proc: subprocess.Popen[bytes], timeout: float) -> float:
        start = time.monotonic()
        while line not in self.lines:
            assert proc.poll() is None, f"{proc.args} exited {proc.returncode} before {line}"
            left = timeout - (time.monotonic() - start)
            assert left > 0, f"no {line} within {timeout} s; got {self.lines}"
            self.sock.settimeout(min(left, 1.0))
            with contextlib.suppress(TimeoutError):
                self.lines += self.sock.recv(4096).decode().splitlines()
        return time.monotonic() - start


@pytest.fixture
def units(checkpoint, tmp_path: Path) -> Iterator[tuple[int, list[subprocess.Popen[bytes]]]]:  # type: ignore[no-untyped-def]
    port, instance = free_port(), f"u{uuid.uuid4().hex[:10]}"
    run, credentials = tmp_path / "run", tmp_path / "credentials"
    run.mkdir()
    credentials.mkdir()
    (credentials / "api_keys").write_text(f"# the gateway's key\n{KEY}\n")
    config = tmp_path / "hybridgen_config.yaml"
    config.write_text(
        f"model:\n  name_or_path: {checkpoint('llama3')}\n  max_model_len: 128\n"
        "  max_num_seqs: 4\n  dtype: float32\n"
        f"server:\n  port: {port}\n  metrics_port: 0\n  instance: {instance}\n"
        f"  runtime_dir: {run}\n"
    )
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for unit in SERVICES:  # the units' After= order: gpu, cpu, gateway
            name = unit.removeprefix("hybridgen-").removesuffix(".service")
            notify = Notifications(tmp_path / f"notify-{name}.sock")
            env = {
                **os.environ,
                "NOTIFY_SOCKET": str(notify.path),
                "WATCHDOG_USEC": str(WATCHDOG_USEC),
                "CREDENTIALS_DIRECTORY": str(credentials),
            }
            log = (tmp_path / f"{name}.log").open("wb")
            argv = exec_start(unit, config, credentials)
            proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
            procs.append(proc)
            notify.wait_for("READY=1", proc, timeout=180)  # Type=notify: then the next unit
            took = notify.wait_for("WATCHDOG=1", proc, timeout=5)
            assert took <= WATCHDOG_USEC / 1e6, f"{unit} pinged after {took:.1f} s"
        yield port, procs
    finally:
        for proc in reversed(procs):  # systemctl stop: SIGTERM, in reverse order
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        codes = [proc.wait(timeout=60) for proc in reversed(procs)]
    assert codes == [0] * len(SERVICES), "each unit stops cleanly on SIGTERM"
    assert not list(Path("/dev/shm").glob(f"*hybridgen-{instance}-*"))


def test_each_unit_starts_and_serves_a_generate(
    units: tuple[int, list[subprocess.Popen[bytes]]],
) -> None:
    port, _ = units
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        request = pb.GenerateRequest(prompt="Hello", max_tokens=4, ignore_eos=True)
        key = (("authorization", f"Bearer {KEY}"),)
        replies = list(stub.Generate(request, metadata=key, timeout=60))
        assert replies[-1].usage.completion_tokens == 4
        # The unit passes its LoadCredential= key file: no key, no answer.
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(request, timeout=60))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
