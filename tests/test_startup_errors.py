"""A daemon that meets a start-up error a restart cannot fix (a model that is not there, a
port in use) exits 2 at once with one line naming it, on stderr and as its status; and
`hybridgen serve` then stops without restarting it and prints that line. Mistakes serve
finds itself before starting anything are tests/test_preflight.py."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from hybridgen.ipc.shm import list_instance
from hybridgen.runtime.startup_error import STATUS_PREFIX

CLI = [sys.executable, "-m", "hybridgen.cli.main"]


@pytest.fixture
def notify(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    """A NOTIFY_SOCKET to hand a daemon, as the supervisor and systemd do."""
    path = str(tmp_path / "notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(path)
        sock.setblocking(False)
        yield sock, path


def _statuses(sock: socket.socket) -> list[str]:
    found = []
    while True:
        try:
            data = sock.recv(4096).decode()
        except BlockingIOError:
            return found
        found += [line.removeprefix("STATUS=") for line in data.splitlines() if "STATUS=" in line]


def _run(argv: list[str], notify_path: str) -> tuple[subprocess.CompletedProcess[str], float]:
    env = {**os.environ, "NOTIFY_SOCKET": notify_path}
    start = time.monotonic()
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=180)
    return done, time.monotonic() - start


def _weightless(checkpoint, folder: Path) -> Path:  # type: ignore[no-untyped-def]
    """A checkpoint folder with its config and tokenizer but no weights: the model and the
    tokenizer read, so only loading the weights finds the mistake."""
    folder.mkdir()
    for f in checkpoint("llama3").iterdir():
        if not f.name.endswith(".safetensors"):
            (folder / f.name).symlink_to(f)
    return folder


@pytest.mark.slow
def test_gpu_daemon_reports_a_missing_model(  # type: ignore[no-untyped-def]
    checkpoint, tmp_path: Path, notify, instance: str
) -> None:
    model = _weightless(checkpoint, tmp_path / "model")
    argv = [sys.executable, "-m", "hybridgen.gpu_daemon.main", "--model", str(model)]
    done, _ = _run([*argv, "--instance", instance, "--device", "cpu"], notify[1])
    assert done.returncode == 2, done.stderr
    (line,) = [x for x in done.stderr.splitlines() if x.startswith("hybridgen-gpu: ")]
    assert "no weights found" in line
    statuses = _statuses(notify[0])
    assert statuses[-1] == STATUS_PREFIX + line.removeprefix("hybridgen-gpu: ")
    assert list_instance(instance) == []  # its rings are removed on the way out


@pytest.mark.slow
def test_cpu_daemon_reports_a_missing_model(tmp_path: Path, notify) -> None:  # type: ignore[no-untyped-def]
    argv = [sys.executable, "-m", "hybridgen.cpu_daemon.main", "--model", "tiny-lama"]
    done, _ = _run([*argv, "--listen", f"unix:{tmp_path / 'cpu.sock'}"], notify[1])
    assert done.returncode == 2
    assert "did you mean 'tiny-llama'?" in done.stderr.strip().splitlines()[-1]
    assert _statuses(notify[0])[-1].startswith(STATUS_PREFIX + "model 'tiny-lama'")


@pytest.mark.parametrize("which", ["--port", "--metrics-port"])
def test_gateway_reports_a_port_in_use(which: str, notify) -> None:  # type: ignore[no-untyped-def]
    with socket.socket() as busy, socket.socket() as free:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        free.bind(("127.0.0.1", 0))
        ports = {"--port": free.getsockname()[1], "--metrics-port": 0}
        ports[which] = busy.getsockname()[1]
        free.close()
        argv = [sys.executable, "-m", "hybridgen.gateway.main", "--upstream", "unix:/nowhere"]
        argv += [f"{k}={v}" for k, v in ports.items()] + ["--http-port=0"]
        done, _ = _run(argv, notify[1])
    assert done.returncode == 2, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    key = {"--port": "server.port", "--metrics-port": "server.metrics_port"}[which]
    assert last.startswith("hybridgen-gateway: ") and key in last and which in last
    assert _statuses(notify[0])[-1].startswith(STATUS_PREFIX)


@pytest.mark.slow
def test_serve_stops_at_once_when_a_daemon_cannot_start(  # type: ignore[no-untyped-def]
    checkpoint, tmp_path: Path, instance: str
) -> None:
    """Past serve's own checks (the config and the tokenizer read): the GPU daemon's error
    ends serve, once, with its reason; before, it was restarted five times over a minute."""
    model = _weightless(checkpoint, tmp_path / "model")
    config = tmp_path / "hybridgen_config.yaml"
    config.write_text(yaml.safe_dump({"server": {"metrics_port": 0}}))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [*CLI, "serve", "--config", str(config), "--model", str(model), "--device", "cpu"]
    argv += ["--port", str(port), "--instance", instance, "--runtime-dir", str(tmp_path / "run")]
    start = time.monotonic()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=180)
    took = time.monotonic() - start
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert lines[-1].startswith("hybridgen: gpu cannot start: ") and "no weights" in lines[-1]
    assert sum("started gpu" in line for line in lines) == 1
    assert not any("started cpu" in line or "restarting" in line for line in lines)
    assert took < 60, f"{took:.0f} s"  # a crash loop took more than a minute
    assert list_instance(instance) == []
