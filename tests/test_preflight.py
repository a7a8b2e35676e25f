"""Mistakes that `hybridgen serve` finds before it starts a daemon: each is one line naming
the problem and the fix. The checks one by one, then `hybridgen serve` itself: it ends in
seconds with that line, having started nothing and left nothing in /dev/shm."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hybridgen.cli.preflight import (
    PreflightError,
    check_budget,
    check_model,
    check_ports,
    preflight,
    server_ports,
)
from hybridgen.config.file import HybridGenConfig
from hybridgen.config.layers import layered_config
from hybridgen.ipc.shm import list_instance
from hybridgen.models.default_model import DEFAULT_MODEL, resolve_model
from hybridgen.models.errors import bad_model_path

CLI = [sys.executable, "-m", "hybridgen.cli.main"]


def _config(**flags: str) -> HybridGenConfig:
    return layered_config(None, {}, {k.replace("__", "."): v for k, v in flags.items()}).config


@pytest.fixture
def listener() -> Iterator[int]:
    """A port this process listens on, as a gRPC server binds it (SO_REUSEPORT)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- one check at a time ---------------------------------------------------------------------


def test_busy_ports_name_the_key_the_holder_and_a_free_one(listener: int) -> None:
    with pytest.raises(PreflightError) as grpc_port:
        check_ports(_config(server__port=str(listener), server__metrics_port="0"))
    message = str(grpc_port.value)
    assert message.startswith(f"server.port {listener} is in use on 127.0.0.1 by pid {os.getpid()}")
    suggested = int(message.rsplit("--port ", 1)[1])
    assert suggested > listener
    with socket.socket() as s:
        s.bind(("127.0.0.1", suggested))  # the suggestion is free
    metrics_busy = rf"server\.metrics_port {listener} is in use.*--metrics-port"
    with pytest.raises(PreflightError, match=metrics_busy):
        check_ports(_config(server__port=str(_free_port()), server__metrics_port=str(listener)))


def test_every_busy_port_is_named_at_once_with_distinct_free_ones() -> None:
    """A second instance on the first's ports learns all its clashes in one go (not one per
    try), and the ports offered instead are free and differ."""
    with contextlib.ExitStack() as stack:
        busy = []
        for _ in range(3):
            sock = stack.enter_context(socket.socket())
            sock.bind(("127.0.0.1", 0))
            sock.listen()
            busy.append(sock.getsockname()[1])
        port, metrics, http = busy
        config = _config(
            server__port=str(port), server__metrics_port=str(metrics), server__http_port=str(http)
        )
        with pytest.raises(PreflightError) as clash:
            check_ports(config)
    message = str(clash.value)
    assert message.startswith("3 ports cannot be used: ")
    offered = []
    for key, flag, value in (("port", "--port", port), ("metrics_port", "--metrics-port", metrics)):
        assert f"server.{key} {value} is in use" in message
        offered.append(int(message.split(f"{flag} ", 1)[1].split(";")[0]))
    offered.append(int(message.rsplit("--http-port ", 1)[1]))
    assert len(set(offered)) == 3 and not set(offered) & set(busy)


def test_free_ports_pass_and_every_server_port_is_checked() -> None:
    port, metrics, http = _free_port(), _free_port(), _free_port()
    config = _config(
        server__port=str(port),
        server__metrics_port=str(metrics),
        server__metrics_host="0.0.0.0",
        server__http_port=str(http),
    )
    check_ports(config)
    assert server_ports(config) == [
        ("server.port", "127.0.0.1", port),
        ("server.metrics_port", "0.0.0.0", metrics),  # on server.metrics_host
        ("server.http_port", "127.0.0.1", http),
    ]
    none = _config(server__metrics_port="0", server__http_port="0")
    assert server_ports(none)[1:] == []  # 0: no endpoint


def test_bad_host_is_named() -> None:
    with pytest.raises(PreflightError, match=r"server\.host \(--host\)='192\.0\.2\.1' is not an"):
        check_ports(_config(server__host="192.0.2.1", server__metrics_port="0"))


def test_a_host_beyond_loopback_without_tls_or_keys_is_warned(tmp_path: Path) -> None:
    """serve says what a non-loopback server.host leaves open; loopback, or TLS and keys
    both, say nothing."""
    from hybridgen.cli.serve import open_exposure

    assert open_exposure(_config().server) is None  # 127.0.0.1
    wide = open_exposure(_config(server__host="0.0.0.0").server)
    assert wide is not None and "plaintext" in wide and "server.api_key_file" in wide
    cert, key, keys = (tmp_path / n for n in ("cert.pem", "key.pem", "api_keys"))
    for f in (cert, key, keys):
        f.write_text("x")
    secured = _config(
        server__host="0.0.0.0",
        server__tls__cert_file=str(cert),
        server__tls__key_file=str(key),
        server__api_key_file=str(keys),
    )
    assert open_exposure(secured.server) is None
    half = open_exposure(_config(server__host="0.0.0.0", server__api_key_file=str(keys)).server)
    assert half is not None and "plaintext" in half and "api_key_file" not in half


def test_model_path_and_preset_mistakes(tmp_path: Path) -> None:
    with pytest.raises(PreflightError, match=r"did you mean 'tiny-llama'\?.*hybridgen models"):
        check_model(_config(model__name_or_path="tiny-lama"))
    with pytest.raises(PreflightError, match=r"did you mean 'smollm2-135m-instruct'\?"):
        check_model(_config(model__name_or_path="smolm2-135m-instruct"))  # the default's name
    with pytest.raises(PreflightError, match="no such file or folder; give a checkpoint folder"):
        check_model(_config(model__name_or_path=str(tmp_path / "missing")))
    (tmp_path / "notes.txt").write_text("not weights")
    with pytest.raises(PreflightError, match=r"neither a folder nor a GGUF file; .* a GGUF file"):
        check_model(_config(model__name_or_path=str(tmp_path / "notes.txt")))
    with pytest.raises(PreflightError, match=r"config\.json"):
        check_model(_config(model__name_or_path=str(tmp_path)))  # a folder, but no model
    assert check_model(_config(model__name_or_path="tiny-llama")).name == "tiny-llama"
    assert check_model(_config()).num_layers > 0  # the default model, with its tokenizer
    # A GGUF file is a model path too (the default model is one): found by its magic bytes.
    gguf = resolve_model(DEFAULT_MODEL)
    assert bad_model_path(gguf) is None and gguf.endswith(".gguf")
    assert check_model(_config(model__name_or_path=gguf)).num_layers > 0


def test_checkpoint_without_tokenizer_is_found(checkpoint, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    folder = tmp_path / "model"
    folder.mkdir()
    for f in checkpoint("llama3").iterdir():
        if f.name != "tokenizer.json":
            (folder / f.name).symlink_to(f)
    with pytest.raises(PreflightError, match=r"tokenizer\.json not found"):
        check_model(_config(model__name_or_path=str(folder)))
    assert check_model(_config(model__name_or_path=str(checkpoint("llama3")))).num_layers > 0


def test_budgets(instance: str) -> None:
    llama = _config(model__name_or_path="llama3-8b", device_topology__gpu__memory_mb="8192")
    with pytest.raises(PreflightError) as small:
        check_budget(llama, "cuda", instance, check_model(llama))
    assert "device_topology.gpu.memory_mb (--gpu-memory-mb)=8192" in str(small.value)
    assert "15,317 MiB in bfloat16" in str(small.value)  # llama3-8b's weights
    fits = dataclasses.replace(
        llama, device_topology=_config(device_topology__gpu__memory_mb="16384").device_topology
    )
    check_budget(fits, "cuda", instance, check_model(fits))
    # On the CPU a preset is fp32, and the budget is host memory.
    with pytest.raises(PreflightError, match="in float32"):
        check_budget(fits, "cpu", instance, check_model(fits))
    warm = _config(kv_cache__warm_region_mb="4096", device_topology__cpu__memory_mb="1024")
    with pytest.raises(PreflightError, match=r"device_topology\.cpu\.memory_mb=1024 is too small"):
        check_budget(warm, "cpu", instance, check_model(warm))


def test_budget_counts_weights_format_and_gpu_layers(instance: str) -> None:
    """B7's config (llama3-70b, int4, gpu_layers auto, 24 GB) passes the preflight: int4
    projections count half a byte a weight, and layers past gpu_layers stay off the device."""

    def config(**keys: str) -> HybridGenConfig:
        return _config(
            model__name_or_path="llama3-70b", device_topology__gpu__memory_mb="24576", **keys
        )

    with pytest.raises(PreflightError, match="134,571 MiB in bfloat16"):
        check_budget(config(), "cuda", instance, check_model(config()))
    int4 = config(weights__format="int4")  # ~33 GiB of int4 weights: still too many
    with pytest.raises(PreflightError, match="cannot hold the weights of llama3-70b"):
        check_budget(int4, "cuda", instance, check_model(int4))
    for layers in ("auto", "40"):
        split = config(weights__format="int4", weights__gpu_layers=layers)
        check_budget(split, "cuda", instance, check_model(split))
    native = config(weights__gpu_layers="12")  # 12 bf16 layers and the head: ~22 GiB
    check_budget(native, "cuda", instance, check_model(native))
    with pytest.raises(PreflightError, match="cannot hold the weights"):
        deep = config(weights__gpu_layers="14")
        check_budget(deep, "cuda", instance, check_model(deep))


# -- hybridgen serve -------------------------------------------------------------------------


Done = subprocess.CompletedProcess[str]


def _serve(tmp_path: Path, instance: str, *flags: str) -> tuple[Done, float]:
    argv = [*CLI, "serve", "--device", "cpu", "--instance", instance]
    argv += ["--runtime-dir", str(tmp_path / "run"), *flags]
    start = time.monotonic()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    return done, time.monotonic() - start


def _children(instance: str) -> list[str]:
    """Processes whose command line names the instance's runtime folder or instance."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if instance in argv and "pytest" not in argv:
            found.append(argv.replace("\0", " "))
    return found


MISTAKES = ["model path", "preset", "grpc port", "metrics port", "http port"]


@pytest.mark.parametrize("mistake", MISTAKES)
def test_serve_ends_at_once_with_one_line(
    mistake: str, tmp_path: Path, instance: str, listener: int
) -> None:
    free, busy = str(_free_port()), str(listener)
    ports = {"--port": free, "--metrics-port": "0", "--http-port": "0"}
    flags, expected = {
        "model path": (["--model", str(tmp_path / "Llama-3-8B")], "no such file or folder"),
        "preset": (["--model", "llama3-8"], "did you mean 'llama3-8b'?"),
        "grpc port": (
            ["--port", busy],
            f"server.port {listener} is in use on 127.0.0.1 by pid {os.getpid()}",
        ),
        "metrics port": (["--metrics-port", busy], f"server.metrics_port {listener} is in use"),
        "http port": (["--http-port", busy], f"server.http_port {listener} is in use"),
    }[mistake]
    ports.update(zip(flags[::2], flags[1::2], strict=True))
    done, took = _serve(tmp_path, instance, *(x for pair in ports.items() for x in pair))
    print(f"{mistake}: hybridgen serve ended in {took:.1f} s")
    if mistake != "preset":  # a misspelled preset is found by the model code (torch): ~5 s
        assert took < 5.0, f"hybridgen serve took {took:.1f} s to end (issue 21: under 5 s)"
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hybridgen: "), done.stderr
    assert expected in lines[0]
    assert done.stdout == ""
    assert not (tmp_path / "run").exists()  # nothing was started, not even the folder
    assert list_instance(instance) == [] and _children(instance) == []


def test_checks_run_in_order_ports_first(tmp_path: Path, listener: int) -> None:
    """Both mistakes at once: the first check's line (cheap, and what blocks any restart)."""
    config = _config(model__name_or_path="tiny-lama", server__port=str(listener))
    with pytest.raises(PreflightError, match=r"server\.port"):
        preflight(config, "cpu", "x")


def test_cpu_budget_is_capped_at_the_free_host_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CPU the budget is host memory, which the Hot pool fills: one above what is
    available could not be allocated (--gpu-memory-mb 24576 on a 24 GB machine)."""
    from hybridgen.config.engine import EngineConfig
    from hybridgen.engine import host_memory
    from hybridgen.engine.memory import MIB, budget_bytes

    monkeypatch.setattr(host_memory, "available_bytes", lambda: 10_000 * MIB)
    cpu = torch.device("cpu")
    assert budget_bytes(EngineConfig(gpu_memory_mb=2048), cpu) == 2048 * MIB
    assert budget_bytes(EngineConfig(), cpu) == 4096 * MIB
    capped = budget_bytes(EngineConfig(gpu_memory_mb=24576), cpu)
    assert capped == int(10_000 * MIB * host_memory.AVAILABLE_SHARE)


def test_every_server_port_key_is_checked_the_http_port_too(listener: int) -> None:
    """server_ports reads the section, not a list: a port key another change adds (the
    OpenAI-compatible server.http_port, on server.http_host if there is one) is checked with
    no change here."""

    @dataclasses.dataclass(frozen=True)
    class Server:
        host: str = "127.0.0.1"
        port: int = 1
        metrics_port: int = 0
        http_port: int = 0
        http_host: str = "127.0.0.1"

    free = int(_free_port())
    config = SimpleNamespace(server=Server(port=free, http_port=listener))
    assert server_ports(config) == [  # type: ignore[arg-type]
        ("server.port", "127.0.0.1", free),
        ("server.http_port", "127.0.0.1", listener),
    ]
    with pytest.raises(
        PreflightError, match=rf"server\.http_port {listener} is in use.*--http-port"
    ):
        check_ports(config)  # type: ignore[arg-type]
    with pytest.raises(PreflightError, match=r"server\.http_port \d+ is server\.port's port too"):
        check_ports(SimpleNamespace(server=Server(port=free, http_port=free)))  # type: ignore[arg-type]


def test_a_missing_model_path_is_found_before_the_model_code_loads() -> None:
    """The check for a path that is not there needs no torch and no model code: serve says it
    in the time it takes to read its flags."""
    code = (
        "import sys; from hybridgen.models.errors import bad_model_path\n"
        "print(bad_model_path('/models/nowhere'), bad_model_path('tiny-llama'))\n"
        "print(sorted(m for m in sys.modules if m.startswith(('torch', 'hybridgen.models.'))))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    first, modules = done.stdout.splitlines()
    assert first.startswith("model '/models/nowhere': no such file or folder") and first.endswith(
        "None"
    )
    assert modules == "['hybridgen.models.errors']"
