"""The `hybridgen` command line: the Supervisor with stand-in children, `generate` against a
real gateway (in-process engine, tiny-llama on the CPU), `config-check` and the entry point."""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hybridgen.cli.main import main
from hybridgen.cli.serve import runtime_dir
from hybridgen.cli.supervisor import ChildSpec, Policy, Supervisor
from hybridgen.ipc.shm import list_instance

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "hybridgen.cli.main"]
FAST = Policy(backoff_initial_s=0.05, backoff_max_s=0.2, stop_timeout_s=2.0, poll_s=0.02)

# A stand-in daemon: notes its start and its SIGTERM in a shared file, says READY=1 on
# $NOTIFY_SOCKET as the real daemons do through sd_notify, then idles.
STAND_IN = r"""
import os, signal, socket, sys, time
name, events, ignore_term = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
def note(what):
    with open(events, "a") as f:
        f.write(f"{what} {name} {os.getpid()}\n")
def term(*_):
    note("stop")
    sys.exit(0)
signal.signal(signal.SIGTERM, signal.SIG_IGN if ignore_term else term)
note("start")
with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
    s.sendto(b"STATUS=loading\nREADY=1", os.environ["NOTIFY_SOCKET"])
while True:
    time.sleep(0.05)
"""


def stand_in(name: str, events: Path, *deps: str, ignore_term: bool = False) -> ChildSpec:
    argv = (sys.executable, "-c", STAND_IN, name, str(events), "1" if ignore_term else "0")
    return ChildSpec(name, argv, depends_on=deps)


def read_events(events: Path) -> list[tuple[str, str, int]]:
    if not events.exists():
        return []
    rows = [line.split() for line in events.read_text().splitlines()]
    return [(what, name, int(pid)) for what, name, pid in rows]


def run_supervisor(
    specs: list[ChildSpec], rt: Path, on_ready: Callable[[Supervisor, int], None], policy: Policy
) -> tuple[int, list[str]]:
    """Run to the end; on_ready(sup, n) is called the n-th time every child is ready."""
    lines: list[str] = []
    count = [0]

    def ready() -> None:
        count[0] += 1
        on_ready(sup, count[0])

    sup = Supervisor(specs, rt, policy, report=lines.append, on_all_ready=ready)
    # A safety net so that a broken supervisor fails the test instead of hanging it.
    timer = threading.Timer(20.0, sup.request_stop)
    timer.start()
    try:
        status = sup.run()
    finally:
        timer.cancel()
    return status, lines


def test_starts_in_order_and_stops_in_reverse_on_sigterm(tmp_path: Path) -> None:
    events = tmp_path / "events"
    specs = [stand_in("gpu", events), stand_in("cpu", events, "gpu"), stand_in("gw", events)]

    def on_ready(sup: Supervisor, n: int) -> None:
        os.kill(os.getpid(), signal.SIGTERM)  # the real signal, through run()'s handler

    status, lines = run_supervisor(specs, tmp_path, on_ready, FAST)
    assert status == 0
    order = [(what, name) for what, name, _ in read_events(events)]
    assert order == [
        *(("start", "gpu"), ("start", "cpu"), ("start", "gw")),
        *(("stop", "gw"), ("stop", "cpu"), ("stop", "gpu")),
    ]
    assert "gpu: loading" in lines
    assert not list(tmp_path.glob("*.sock"))  # notify sockets are removed


def test_restarts_killed_child_and_its_dependents(tmp_path: Path) -> None:
    events = tmp_path / "events"
    specs = [stand_in("gpu", events), stand_in("cpu", events, "gpu"), stand_in("gw", events)]

    def on_ready(sup: Supervisor, n: int) -> None:
        if n == 1:
            gpu_pid = next(pid for what, name, pid in read_events(events) if name == "gpu")
            os.kill(gpu_pid, signal.SIGKILL)
        else:
            sup.request_stop()

    status, lines = run_supervisor(specs, tmp_path, on_ready, FAST)
    assert status == 0
    order = [(what, name) for what, name, _ in read_events(events)]
    assert order == [
        *(("start", "gpu"), ("start", "cpu"), ("start", "gw")),
        ("stop", "cpu"),  # its rings are gone: stopped and started again after the GPU daemon
        *(("start", "gpu"), ("start", "cpu")),
        *(("stop", "gw"), ("stop", "cpu"), ("stop", "gpu")),
    ]
    assert any("gpu exited unexpectedly (killed by SIGKILL)" in line for line in lines)
    assert any("restarting gpu, cpu" in line for line in lines)


def test_gives_up_after_crash_loop(tmp_path: Path) -> None:
    events = tmp_path / "events"
    crasher = ChildSpec("crasher", (sys.executable, "-c", "raise SystemExit(1)"), notify=False)
    policy = Policy(backoff_initial_s=0.01, backoff_max_s=0.05, crash_limit=3, poll_s=0.02)
    t0 = time.monotonic()
    status, lines = run_supervisor([stand_in("gpu", events), crasher], tmp_path, _ignore, policy)
    assert status == 1
    assert time.monotonic() - t0 < 10
    assert sum(line.startswith("started crasher") for line in lines) == 4  # 1 + 3 restarts
    assert any("crash loop" in line for line in lines)
    assert [(w, n) for w, n, _ in read_events(events)] == [("start", "gpu"), ("stop", "gpu")]


def test_bad_config_exit_is_not_retried_and_sigkill_after_timeout(tmp_path: Path) -> None:
    events = tmp_path / "events"
    stubborn = stand_in("gpu", events, ignore_term=True)
    usage = ChildSpec("cpu", (sys.executable, "-c", "raise SystemExit(2)"), notify=False)
    policy = Policy(stop_timeout_s=0.3, poll_s=0.02)
    status, lines = run_supervisor([stubborn, usage], tmp_path, _ignore, policy)
    assert status == 2
    assert sum(line.startswith("started cpu") for line in lines) == 1
    assert any("gpu ignored SIGTERM" in line for line in lines)
    assert any("stopped gpu (killed by SIGKILL)" in line for line in lines)


# A daemon that finds a start-up error, as runtime/startup_error.py has the real ones report it.
FAILS_TO_START = r"""
import os, socket, sys
with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
    s.sendto(b"STATUS=loading weights 1/2 layers", os.environ["NOTIFY_SOCKET"])
    s.sendto(b"STATUS=cannot start: port 1 is in use; pick another", os.environ["NOTIFY_SOCKET"])
sys.exit(2)
"""


def test_start_up_error_ends_at_once_with_the_reason(tmp_path: Path) -> None:
    events = tmp_path / "events"
    failing = ChildSpec("gateway", (sys.executable, "-c", FAILS_TO_START))
    statuses: list[tuple[str, str]] = []
    lines: list[str] = []
    sup = Supervisor(
        [stand_in("gpu", events), failing],
        tmp_path,
        FAST,
        report=lines.append,
        on_status=lambda name, text: statuses.append((name, text)),
    )
    t0 = time.monotonic()
    assert sup.run() == 2
    assert time.monotonic() - t0 < 10
    assert "gateway cannot start: port 1 is in use; pick another" in lines
    assert sum(line.startswith("started gateway") for line in lines) == 1  # not restarted
    assert not any("exited unexpectedly" in line for line in lines)
    # Statuses go to on_status, the reason only once, with the exit.
    assert ("gateway", "loading weights 1/2 layers") in statuses
    assert not any("cannot start" in text for _, text in statuses)
    assert [(w, n) for w, n, _ in read_events(events)] == [("start", "gpu"), ("stop", "gpu")]


def _ignore(sup: Supervisor, n: int) -> None:
    pass  # a child without notify or probe is ready once spawned, even one about to crash


def test_dependencies_must_be_listed_first(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="depends on"):
        Supervisor([ChildSpec("cpu", ("true",), depends_on=("gpu",))], tmp_path)


def test_runtime_dir_falls_back_when_configured_is_not_writable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert runtime_dir("/proc/hybridgen", "inst") == tmp_path / "hybridgen" / "inst"
    assert runtime_dir(str(tmp_path / "run"), "inst") == tmp_path / "run" / "inst"


# -- generate against a real gateway ----------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def gateway_port(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    port = _free_port()
    log = tmp_path_factory.mktemp("gateway") / "server.log"
    argv = [sys.executable, "-m", "hybridgen.gateway.standalone", "--model", "tiny-llama"]
    argv += ["--port", str(port), "--metrics-port", "0", "--device", "cpu"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait_serving(port, proc, log)
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait_serving(port: int, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 60
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                pytest.fail(f"gateway exited with {proc.returncode}:\n{log.read_text()}")
            try:
                reply = health.Check(health_pb2.HealthCheckRequest(), timeout=1)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass  # not listening yet
            time.sleep(0.2)
    pytest.fail(f"gateway not SERVING after 60 s:\n{log.read_text()}")


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=60, check=False)


@pytest.mark.slow
def test_generate_streams_text(gateway_port: int) -> None:
    result = cli("generate", "Hello there", "--port", str(gateway_port), "--max-tokens", "8")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()
    assert "finish_reason=length" in result.stderr
    assert "completion_tokens=8" in result.stderr


@pytest.mark.slow
def test_generate_sampling_options(gateway_port: int) -> None:
    args = ["--port", str(gateway_port), "--max-tokens", "4", "--temperature", "0.8"]
    args += ["--top-p", "0.9", "--seed", "7", "--stop", "zz", "--stop", "yy"]
    first, second = cli("generate", "Hi", *args), cli("generate", "Hi", *args)
    assert first.returncode == 0, first.stderr
    assert first.stdout == second.stdout  # seeded


@pytest.mark.slow
def test_generate_invalid_argument_names_the_field(gateway_port: int) -> None:
    result = cli("generate", "Hello", "--port", str(gateway_port), "--top-p", "2")
    assert result.returncode == 2
    assert "INVALID_ARGUMENT" in result.stderr
    assert "top_p" in result.stderr


@pytest.mark.slow
def test_generate_takes_the_port_serve_takes_from_the_environment(gateway_port: int) -> None:
    env = {**os.environ, "HYBRIDGEN_PORT": str(gateway_port)}
    argv = [*CLI, "generate", "Hi", "--max-tokens", "2"]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 0, result.stderr
    assert "completion_tokens=2" in result.stderr


def test_generate_without_server() -> None:
    result = cli("generate", "Hello", "--port", str(_free_port()))
    assert result.returncode == 3
    assert "no HybridGen server answering" in result.stderr


def test_generate_refuses_a_seed_out_of_range(capsys: pytest.CaptureFixture[str]) -> None:
    """Before any call: the seed's range, named (not the proto's bare "Value out of range")."""
    with pytest.raises(SystemExit) as done:
        main(["generate", "Hello", "--seed", "-3"])
    assert done.value.code == 2
    assert "--seed: -3 is out of range: 0 <= seed <=" in capsys.readouterr().err


# -- config-check and the entry point ---------------------------------------------------------


def test_config_check(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = tmp_path / "good.yaml"
    good.write_text("kv_cache:\n  hot_region_mb: 512\nserver:\n  port: 50052\n")
    assert main(["config-check", str(good)]) == 0
    assert capsys.readouterr().out.startswith("OK")
    bad = tmp_path / "bad.yaml"
    bad.write_text("kv_cache:\n  hot_region_mbb: 512\n")
    assert main(["config-check", str(bad)]) == 2
    assert "kv_cache.hot_region_mbb" in capsys.readouterr().err


def test_serve_rejects_a_bad_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("server:\n  port: 0\n")
    assert main(["serve", "--config", str(bad)]) == 2
    assert "server.port" in capsys.readouterr().err


def test_models_lists_the_presets(capsys: pytest.CaptureFixture[str]) -> None:
    from hybridgen.models.presets import PRESETS

    assert main(["models"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith("The default model: smollm2-135m-instruct")
    header = lines.index(next(line for line in lines if line.split()[:2] == ["name", "parameters"]))
    rows = {line.split()[0]: line.split() for line in lines[header + 1 : header + 1 + len(PRESETS)]}
    assert list(rows) == list(PRESETS)
    assert rows["llama3-8b"][1:4] == ["8.0B", "LlamaForCausalLM", "32"]
    assert rows["tiny-llama"][1] == "0.9M"
    assert "8 experts" in " ".join(rows["mixtral-8x7b"])
    assert rows["qwen3-30b-a3b"][1:3] == ["30.5B", "Qwen3MoeForCausalLM"]
    assert "seeded random weights" in out and "GGUF file" in out
    # The right-aligned columns line up under their heads, however long a name.
    for column, field in (("parameters", 1), ("layers", 3)):
        end = lines[header].index(column) + len(column)
        for line in lines[header + 1 : header + 1 + len(PRESETS)]:
            value = line.split()[field]
            assert line.index(f" {value} ") + 1 + len(value) == end, line


def test_console_script_entry() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["scripts"]["hybridgen"] == "hybridgen.cli.main:main"
    assert "hybridgen.cli" in project["tool"]["setuptools"]["packages"]
    result = cli("--help")
    assert result.returncode == 0
    for command in ("serve", "generate", "models", "config-check"):
        assert command in result.stdout
    version = cli("--version")
    assert version.returncode == 0
    assert version.stdout.strip() == f"hybridgen {project['project']['version']}"


# -- serve: the three real processes --------------------------------------------------------


@pytest.mark.skipif(
    importlib.util.find_spec("hybridgen.cpu_daemon.main") is None, reason="no CPU daemon yet"
)
@pytest.mark.slow
def test_serve_generate_and_clean_stop(tmp_path: Path) -> None:
    """The issue's flags (on the CPU the budget is host memory, capped at what is free) over a
    config file's keys, and a variable: they reach the daemons."""
    port, instance = _free_port(), f"clitest{os.getpid()}"
    config = tmp_path / "hybridgen_config.yaml"
    config.write_text(
        f"server:\n  port: {port}\n  metrics_port: 9400\n  http_port: 0\n  instance: {instance}\n"
        f"  runtime_dir: {tmp_path / 'run'}\nmodel:\n  name_or_path: tiny-llama\n"
        "  max_model_len: 1024\n"
    )
    out, err = tmp_path / "serve.out", tmp_path / "serve.err"
    argv = [*CLI, "serve", "--config", str(config), "--device", "cpu"]
    argv += ["--gpu-memory-mb", "24576", "--max-model-len", "8192", "--metrics-port", "0"]
    env = {**os.environ, "HYBRIDGEN_MAX_NUM_SEQS": "8"}
    with open(out, "wb") as o, open(err, "wb") as e:
        proc = subprocess.Popen(argv, stdout=o, stderr=e, env=env)
    try:
        deadline = time.monotonic() + 90
        while "  try      " not in out.read_text():
            assert proc.poll() is None, err.read_text()
            assert time.monotonic() < deadline, err.read_text()
            time.sleep(0.2)
        banner = out.read_text()
        assert f"HybridGen is serving tiny-llama on 127.0.0.1:{port} (gRPC)" in banner
        assert "synthetic preset" in banner and "metrics" not in banner
        assert "context 8,192 tokens, up to 8 sequences" in banner  # flag and variable
        result = cli("generate", "Hello", "--port", str(port), "--max-tokens", "4")
        assert result.returncode == 0, result.stderr
        assert "tiny-llama is a synthetic preset" in result.stderr
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, err.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = err.read_text()
    stops = [log.index(f"stopped {name}") for name in ("gateway", "cpu", "gpu")]
    assert stops == sorted(stops), log
    assert list_instance(instance) == []  # nothing left in /dev/shm


def test_the_banner_names_the_hybridgen_the_shell_can_run(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """serve's banner suggests `hybridgen generate ...` only where PATH finds this very
    script; started as .venv/bin/hybridgen with the venv not activated, it names that path;
    started with python -m, plain `hybridgen`."""
    from hybridgen.cli.serve import invoked_as

    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    script = bin_dir / "hybridgen"
    script.write_text("#!/bin/sh\n")
    script.chmod(0o755)
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    assert invoked_as(str(script)) == str(script)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    assert invoked_as(str(script)) == "hybridgen"
    assert invoked_as("/some/where/hybridgen/cli/main.py") == "hybridgen"


def test_the_banner_speaks_the_servers_protocol(tmp_path: Path) -> None:
    """Plaintext: http and `hybridgen generate`; with TLS and API keys: https on the name the
    certificate carries and a curl that sends the certificate and a key (generate speaks
    plaintext without one); with no HTTP port, grpcurl's health check. Every banner says how
    to stop, and the default model goes by its name, not its file's path."""
    from hybridgen.cli.serve import banner
    from hybridgen.config.file import parse_config
    from hybridgen.models.default_model import FILE

    plain = banner(parse_config({"model": {"name_or_path": f"/x/{FILE}"}}), tmp_path, None)
    assert "serving smollm2-135m-instruct on" in plain
    assert "OpenAI   http://127.0.0.1:8000/v1" in plain and 'generate --port 50051 "Hello"' in plain
    assert "Ctrl-C again: at once" in plain
    secure = {"tls": {"cert_file": "cert.pem", "key_file": "key.pem"}, "api_key_file": "keys"}
    text = banner(parse_config({"server": secure}), tmp_path, None)
    assert "OpenAI   https://localhost:8000/v1" in text and "generate" not in text
    assert 'curl --cacert cert.pem -H "Authorization: Bearer $(head -1 keys)" ' in text
    assert "https://localhost:8000/v1/models" in text
    no_http = banner(parse_config({"server": {**secure, "http_port": 0}}), tmp_path, None)
    assert "grpcurl -cacert cert.pem localhost:50051 grpc.health.v1.Health/Check" in no_http
