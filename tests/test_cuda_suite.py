"""scripts/cuda_suite.py, the whole CUDA suite in one process on a GPU machine: it lists every
test file that runs on CUDA, warms the kernel cache in shards first, and reports the
one-process run's exit code."""

from __future__ import annotations

import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "cuda_suite.py"
SUITE = runpy.run_path(str(SCRIPT))

RUNS_ON_CUDA = re.compile(
    r"kernel_helpers import"
    r"|skipif\(not torch\.cuda\.is_available\(\)"
    r"|torch\.device\(\"cuda\" if torch\.cuda\.is_available\(\)"
)
"""What makes a test file run something on CUDA when the machine has it."""

NOT_ON_CUDA = {
    "tests/test_kernel_compiles.py",  # skipped unless the kernels run in Triton's interpreter
    "tests/test_cuda_suite.py",  # names the pattern above
}


def test_every_test_file_that_runs_on_cuda_is_in_the_suite() -> None:
    on_cuda = {
        f"tests/{p.name}"
        for p in sorted((ROOT / "tests").glob("test_*.py"))
        if RUNS_ON_CUDA.search(p.read_text())
    } - NOT_ON_CUDA
    assert on_cuda, "the pattern finds the kernel tests"
    files = SUITE["FILES"]
    assert sorted(on_cuda - set(files)) == [], "add them to FILES in scripts/cuda_suite.py"
    assert len(files) == len(set(files))
    assert all((ROOT / f).is_file() for f in files)
    assert set(SUITE["WARM_FILES"]) <= set(files)


def test_shards_deal_every_test_once() -> None:
    ids = [f"t::{i}" for i in range(7)]
    dealt = SUITE["shards"](ids, 3)
    assert dealt == [["t::0", "t::3", "t::6"], ["t::1", "t::4"], ["t::2", "t::5"]]
    assert SUITE["shards"](ids[:2], 12) == [["t::0"], ["t::1"]]


def test_collect_gives_each_test_id_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "test_ids.py").write_text(
        "import warnings\n\nimport pytest\n\nwarnings.warn('at import')\n\n"
        "@pytest.mark.parametrize('v', ['a b', 'c'])\ndef test_p(v):\n    pass\n"
    )
    monkeypatch.chdir(tmp_path)
    assert SUITE["collect"](("test_ids.py",)) == [
        "test_ids.py::test_p[a b]",
        "test_ids.py::test_p[c]",
    ]


def _run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--log", "suite.log", *args],
        capture_output=True,
        text=True,
        cwd=tmp_path,  # as the script runs from the repository's root: paths relative to it
        timeout=300,
    )


def test_warms_in_shards_then_runs_the_suite_in_one_process(tmp_path: Path) -> None:
    (tmp_path / "test_warm.py").write_text("def test_a():\n    pass\n\ndef test_b():\n    pass\n")
    (tmp_path / "test_ok.py").write_text("def test_ok():\n    pass\n")
    (tmp_path / "test_bad.py").write_text("def test_bad():\n    assert False\n")
    ok = _run(tmp_path, "--shards", "2", "--warm-files", "test_warm.py", "--files", "test_ok.py")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "warm-up: 2 processes" in ok.stdout and "exit code 0" in ok.stdout
    shard_logs = sorted((tmp_path / f"warm_{i}.log").read_text() for i in range(2))
    assert all("1 passed" in s for s in shard_logs), shard_logs  # one test each
    assert "1 passed" in (tmp_path / "suite.log").read_text()

    bad = _run(tmp_path, "--shards", "0", "--files", "test_bad.py")
    assert bad.returncode == 1 and "exit code 1" in bad.stdout
    assert "warm-up" not in bad.stdout
    assert "FAILED" in (tmp_path / "suite.log").read_text()
