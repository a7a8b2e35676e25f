"""The systemd units: `systemd-analyze verify` accepts them, and they keep the design's promises."""

from __future__ import annotations

import configparser
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from hybridgen.runtime.startup_error import EXIT_STARTUP

UNIT_DIR = Path(__file__).resolve().parents[1] / "systemd"
SERVICES = {
    "hybridgen-gpu.service": "hybridgen.gpu_daemon.main",
    "hybridgen-cpu.service": "hybridgen.cpu_daemon.main",
    "hybridgen-gateway.service": "hybridgen.gateway.main",
}
UNITS = [*SERVICES, "hybridgen.target"]
PYTHON = "/opt/hybridgen/.venv/bin/python"
CONFIG = "/etc/hybridgen/hybridgen_config.yaml"


def _unit(name: str) -> dict[str, dict[str, list[str]]]:
    """section -> key -> every value (units repeat keys such as Environment=)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] = {}
    for raw in (UNIT_DIR / name).read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
            continue
        key, _, value = line.partition("=")
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def _one(name: str, section: str, key: str) -> str:
    values = _unit(name)[section].get(key)
    assert values is not None, f"{name}: [{section}] {key}= is missing"
    assert len(values) == 1, f"{name}: [{section}] {key}= is set {len(values)} times"
    return values[0]


def test_units_parse_as_ini() -> None:
    # Catches a stray line without `=` that systemd would only warn about.
    for name in UNITS:
        parser = configparser.ConfigParser(strict=False, interpolation=None)
        parser.read_string((UNIT_DIR / name).read_text())
        assert parser.sections(), name


@pytest.mark.parametrize("name", list(SERVICES))
def test_service_promises(name: str) -> None:
    assert _one(name, "Service", "Type") == "notify"
    assert _one(name, "Service", "Restart") == "on-failure"
    assert _one(name, "Service", "RestartPreventExitStatus") == str(EXIT_STARTUP)
    assert _one(name, "Service", "User") == "hybridgen"
    assert _one(name, "Service", "Group") == "hybridgen"
    assert _one(name, "Service", "RuntimeDirectory") == "hybridgen"
    # Shared by three units: one stopping must not delete the others' sockets.
    assert _one(name, "Service", "RuntimeDirectoryPreserve") == "yes"
    assert _one(name, "Service", "WatchdogSec").endswith("s")
    assert _one(name, "Service", "NoNewPrivileges") == "yes"
    assert _one(name, "Service", "ProtectSystem") == "strict"
    assert _one(name, "Service", "PrivateTmp") == "yes"
    assert _one(name, "Service", "ExecStart").startswith(
        f"{PYTHON} -m {SERVICES[name]} --config {CONFIG}"
    )
    assert _one(name, "Unit", "PartOf") == "hybridgen.target"
    assert _one(name, "Install", "WantedBy") == "hybridgen.target"


def test_gpu_unit_keeps_devices_and_pins_memory() -> None:
    unit = _unit("hybridgen-gpu.service")["Service"]
    assert "PrivateDevices" not in unit and "DevicePolicy" not in unit
    assert unit["LimitMEMLOCK"] == ["infinity"]
    assert "/dev/shm" in unit["ReadWritePaths"]
    assert unit["TimeoutStartSec"] == ["20min"]


def test_cpu_unit_shares_dev_shm() -> None:
    unit = _unit("hybridgen-cpu.service")["Service"]
    assert "/dev/shm" in unit["ReadWritePaths"]
    assert "PrivateIPC" not in unit


def test_ordering_and_binding() -> None:
    cpu, gateway = (
        _unit("hybridgen-cpu.service")["Unit"],
        _unit("hybridgen-gateway.service")["Unit"],
    )
    # The CPU daemon attaches to the GPU daemon's shared memory: it starts after it is READY
    # and is stopped (and restarted) with it.
    assert cpu["BindsTo"] == ["hybridgen-gpu.service"]
    assert "hybridgen-gpu.service" in cpu["After"][0].split()
    assert "hybridgen-cpu.service" in gateway["After"][0].split()
    target = _unit("hybridgen.target")
    assert set(target["Unit"]["Wants"][0].split()) == set(SERVICES)
    assert target["Install"]["WantedBy"] == ["multi-user.target"]


@pytest.fixture
def verify_copies(tmp_path: Path) -> Path:
    """The units with ExecStart pointing at a stub, since verify checks the binary exists."""
    stub = tmp_path / "bin" / "python"
    stub.parent.mkdir()
    stub.write_text("#!/bin/sh\nexit 0\n")
    stub.chmod(stub.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    for name in UNITS:
        text = (UNIT_DIR / name).read_text()
        (tmp_path / name).write_text(text.replace(PYTHON, str(stub)))
    return tmp_path


def test_systemd_analyze_verify(verify_copies: Path) -> None:
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze is not installed")
    result = subprocess.run(
        [tool, "verify", "--man=no", *(str(verify_copies / name) for name in UNITS)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    ours = [line for line in result.stderr.splitlines() if "hybridgen" in line]
    assert result.returncode == 0, result.stderr
    assert ours == [], "\n".join(ours)
