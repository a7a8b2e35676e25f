"""device_topology.cpu.cores: CPU lists such as "0-3,8", as the config and device_checker read
them (config_schema.parse_cpu_list); device_topology.cpu.gpu_daemon_cores: the cores of them
the CPU daemon leaves to the GPU daemon (affinity.cpu_daemon_cores)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

from hybridgen.config.file import ConfigError, parse_config, parse_cpu_list
from hybridgen.runtime.affinity import cpu_daemon_cores
from tests.test_config import _with


@pytest.mark.parametrize(
    ("text", "cpus"),
    [
        ("0-15", tuple(range(16))),
        ("0,2,4-7", (0, 2, 4, 5, 6, 7)),
        ("3", (3,)),
        ("8-11, 0-1", (0, 1, 8, 9, 10, 11)),
        ("2,2,1-2", (1, 2)),
    ],
)
def test_cpu_list(text: str, cpus: tuple[int, ...]) -> None:
    assert parse_cpu_list(text) == cpus
    assert parse_config(_with("device_topology.cpu.cores", text)).device_topology.cpu.cores == cpus


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("", "'' is not N or N-M"),
        ("a-b", "'a-b' is not N or N-M"),
        ("0,,2", "'' is not N or N-M"),
        ("-1", "'-1' is not N or N-M"),
        ("1-2-3", "'1-2-3' is not N or N-M"),
        ("7-3", "'7-3' runs backwards"),
        ("0-99999", "CPU ids stop below 8192"),
    ],
)
def test_bad_cpu_list_names_the_key(value: str, why: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(_with("device_topology.cpu.cores", value))
    assert str(err.value) == (
        f"device_topology.cpu.cores={value!r} is out of range: allowed a CPU list such as "
        f"'0-15' or '0,2,4-7' ({why})"
    )


@pytest.mark.parametrize("value", [32, [0, 1], 1.5])
def test_cpu_list_must_be_quoted(value: object) -> None:
    with pytest.raises(ConfigError, match=r"^device_topology\.cpu\.cores=.* has the wrong type"):
        parse_config(_with("device_topology.cpu.cores", value))


@pytest.mark.parametrize(
    ("cores", "spare", "expected"),
    [
        (None, 1, list(range(15))),  # every core this process may use, less the last
        (None, 0, list(range(16))),
        (None, 4, list(range(12))),
        ((2, 3, 4, 5), 1, [2, 3, 4]),  # the configured cores, less their last
        ((7,), 1, [7]),  # never fewer than one
        (None, 99, [0]),
    ],
)
def test_the_cpu_daemon_leaves_the_gpu_daemon_its_cores(
    cores: tuple[int, ...] | None, spare: int, expected: list[int]
) -> None:
    for device in ("cuda", "cuda:1"):
        assert cpu_daemon_cores(cores, spare, device, available=range(16)) == expected


def test_with_the_engine_on_the_cpu_the_cpu_daemon_takes_every_core(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No thread spins on a device: the GPU daemon sleeps while the CPU daemon answers."""
    assert cpu_daemon_cores(None, 1, "cpu", available=range(16)) == list(range(16))
    for gpu in (False, True):
        monkeypatch.setattr(torch.cuda, "is_available", lambda gpu=gpu: gpu)
        assert len(cpu_daemon_cores((2, 3, 4, 5), 1, "auto", available=range(16))) == 4 - gpu


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one core: nothing to leave")
def test_the_cpu_daemon_binds_before_it_waits_for_the_gpu_daemon(tmp_path: Path) -> None:
    """`hybridgen.cpu_daemon.main --device cuda` binds to every core but the last at once, while
    it still waits for the GPU daemon's rings (this machine needs no GPU for that)."""
    available = sorted(os.sched_getaffinity(0))
    config = tmp_path / "c.yaml"
    config.write_text("device_topology:\n  cpu:\n    gpu_daemon_cores: 1\n")
    cmd = [sys.executable, "-m", "hybridgen.cpu_daemon.main", "--config", str(config)]
    cmd += ["--instance", f"t{uuid.uuid4().hex[:12]}", "--device", "cuda"]
    proc = subprocess.Popen([*cmd, "--attach-timeout", "60"], stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while sorted(os.sched_getaffinity(proc.pid)) != available[:-1]:
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
    finally:
        proc.kill()
        proc.wait()


def test_gpu_daemon_cores_is_checked() -> None:
    assert (
        parse_config(
            _with("device_topology.cpu.gpu_daemon_cores", 3)
        ).device_topology.cpu.gpu_daemon_cores
        == 3
    )
    assert parse_config({}).device_topology.cpu.gpu_daemon_cores == 1
    with pytest.raises(
        ConfigError, match=r"^device_topology\.cpu\.gpu_daemon_cores=-1 is out of range"
    ):
        parse_config(_with("device_topology.cpu.gpu_daemon_cores", -1))
    with pytest.raises(ConfigError, match="not available to this process"):
        cpu_daemon_cores((4000,), 1, "cuda", available=range(16))
