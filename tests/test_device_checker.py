"""`python -m hybridgen.tools.device_checker` on the CPU: core lists, the NUMA comparison
against a fake sysfs tree, and the real module run as a subprocess on this machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog
import torch

from hybridgen.config.engine import ConfigError
from hybridgen.tools import device_checker as dc

GPU_PCI = "0000:17:00.0"


def fake_sysfs(root: Path, gpu_node: str | None, nodes: dict[int, str]) -> Path:
    """A sysfs tree with node<N>/cpulist for `nodes` and, unless None, the GPU's numa_node."""
    for node, cpulist in nodes.items():
        path = root / f"devices/system/node/node{node}"
        path.mkdir(parents=True)
        (path / "cpulist").write_text(cpulist + "\n")
    if gpu_node is not None:
        dev = root / "bus/pci/devices" / GPU_PCI
        dev.mkdir(parents=True)
        (dev / "numa_node").write_text(gpu_node + "\n")
    return root


@pytest.mark.parametrize(
    ("text", "cores"),
    [("0-3", [0, 1, 2, 3]), ("0,2,4-6", [0, 2, 4, 5, 6]), ("5", [5]), ("3,1,1-2", [1, 2, 3])],
)
def test_parse_cores_accepts_cpulists(text: str, cores: list[int]) -> None:
    assert dc.parse_cores(text, range(8)) == cores


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("", "is not N or N-M"),
        ("a-b", "is not N or N-M"),
        ("3-1", "runs backwards"),
        ("0,,1", "is not N or N-M"),
        ("6-9", "cores 8-9 are not available"),
    ],
)
def test_parse_cores_rejects_bad_lists(text: str, why: str) -> None:
    with pytest.raises(ConfigError) as exc:
        dc.parse_cores(text, range(8))
    assert "--cpu-cores" in str(exc.value) and why in str(exc.value)
    assert "cores 0-7" in str(exc.value)  # the allowed range


def test_format_cores_inverts_parse() -> None:
    assert dc.format_cores([7, 0, 1, 2, 4, 5]) == "0-2,4-5,7"
    assert dc.parse_cores(dc.format_cores([7, 0, 1, 2, 4, 5]), range(8)) == [0, 1, 2, 4, 5, 7]


def test_gpu_id_out_of_range_names_the_range() -> None:
    dc.check_gpu_id(1, 2)
    with pytest.raises(ConfigError, match=r"--gpu-id=2 is out of range: allowed 0\.\.1"):
        dc.check_gpu_id(2, 2)


@pytest.mark.parametrize(
    ("gpu_node", "cores", "verdict"),
    [
        ("0", [0, 1], "match"),
        ("1", [16, 17], "match"),
        ("1", [0, 1], "mismatch"),
        ("0", [15, 16], "mismatch"),  # straddles both nodes: half the cores are remote
        ("-1", [0, 1], "unknown"),
        (None, [0, 1], "unknown"),
        ("0", [40], "unknown"),  # a core no node lists
    ],
)
def test_numa_comparison_on_fake_sysfs(
    tmp_path: Path, gpu_node: str | None, cores: list[int], verdict: str
) -> None:
    root = fake_sysfs(tmp_path, gpu_node, {0: "0-15", 1: "16-31", 2: ""})
    lists = dc.read_node_cpulists(root)
    core_nodes = dc.numa_nodes_of_cores(cores, lists)
    assert dc.compare(dc.read_gpu_numa(GPU_PCI, root), core_nodes) == verdict


def test_gpu_numa_read_from_nvidia_smi_spelling(tmp_path: Path) -> None:
    root = fake_sysfs(tmp_path, "1", {})
    assert dc.read_gpu_numa("00000000:17:00.0", root) == 1
    assert dc.read_gpu_numa("0000:18:00.0", root) is None


@pytest.fixture
def fake_gpu(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """main() with a fake GPU on node 1, a fake sysfs with core 0 on node 0, and no
    measuring; the real affinity and torch thread count are restored afterwards."""
    gpu = dc.GpuInfo(0, "Fake GPU", 80.0, "9.0", GPU_PCI, h2d_gbs=50.0, d2h_gbs=50.0)
    monkeypatch.setattr(dc.hlog, "configure", lambda: None)
    monkeypatch.setattr(dc, "SYSFS_ROOT", fake_sysfs(tmp_path, "1", {0: "0", 1: "1"}))
    monkeypatch.setattr(dc, "no_gpu_reason", lambda: None)
    monkeypatch.setattr(dc.torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(dc, "probe_gpu", lambda gpu_id: gpu)
    monkeypatch.setattr(dc, "host_copy_gbs", lambda: 10.0)
    affinity, threads = os.sched_getaffinity(0), torch.get_num_threads()
    yield
    os.sched_setaffinity(0, affinity)
    torch.set_num_threads(threads)


@pytest.mark.usefixtures("fake_gpu")
def test_mismatch_warns_loudly(capsys: pytest.CaptureFixture[str]) -> None:
    with structlog.testing.capture_logs() as logs:
        report = dc.main(["--cpu-cores", "0"])
    assert report.numa == "mismatch" and report.gpu_numa_node == 1
    assert [e["event"] for e in logs if e["log_level"] == "warning"] == ["numa_mismatch"]
    warning = [line for line in capsys.readouterr().out.splitlines() if "WARNING" in line]
    assert len(warning) == 1 and warning[0].startswith("WARNING: NUMA mismatch")
    assert "--cpu-cores 1" in warning[0]  # the GPU's node's cores


@pytest.mark.usefixtures("fake_gpu")
def test_mismatch_under_strict_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        dc.main(["--cpu-cores", "0", "--strict"])
    assert exc.value.code == 1
    assert "WARNING: NUMA mismatch" in capsys.readouterr().out


@pytest.mark.usefixtures("fake_gpu")
def test_match_under_strict_passes(capsys: pytest.CaptureFixture[str]) -> None:
    assert dc.main(["--cpu-cores", "1", "--strict"]).numa == "match"
    assert "WARNING" not in capsys.readouterr().out


@pytest.mark.usefixtures("fake_gpu")
def test_gpu_id_out_of_range_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        dc.main(["--gpu-id", "3", "--cpu-cores", "0"])
    assert exc.value.code == 2
    assert "--gpu-id=3 is out of range: allowed 0..0" in capsys.readouterr().err


def run_module(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "hybridgen.tools.device_checker", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_module_without_gpu_reports_cores_and_host_bandwidth(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    proc = run_module("--cpu-cores", "0", "--strict", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "no CUDA GPU: " in proc.stdout and "Traceback" not in proc.stderr
    assert "measuring_host_copy" in proc.stderr  # progress for the one slow step
    report = json.loads(out.read_text())
    assert report["cores"] == [0] and report["gpu"] is None
    assert report["numa"] == "unknown" and report["host_copy_gbs"] > 0


@pytest.mark.slow
def test_module_rejects_unavailable_cores() -> None:
    proc = run_module("--cpu-cores", "9999")
    assert proc.returncode == 2
    assert "--cpu-cores" in proc.stderr and "Traceback" not in proc.stderr
