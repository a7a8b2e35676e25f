"""bench/ab_commits.sh: each commit's source folders in .ab/SHA, and a run of SHA imports the
library, the daemons and the benchmarks from there, ahead of the installed package."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_a_commits_run_imports_that_commits_code(tmp_path: Path) -> None:
    clone = tmp_path / "repo"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=clone, capture_output=True, text=True
    ).stdout.strip()
    script = ["bash", "bench/ab_commits.sh"]
    subprocess.run([*script, "prepare", head], cwd=clone, check=True, capture_output=True)
    path = subprocess.run(
        [*script, "path", head], cwd=clone, check=True, capture_output=True, text=True
    ).stdout.strip()
    modules = [
        "hybridgen.kernels.ops",
        "hybridgen.gpu_daemon.main",
        "hybridgen.cpu_daemon.main",
        "hybridgen.gateway.main",
        "hybridgen.benchmarks.engine_bench",
    ]
    code = "import importlib.util as u, sys\nfor m in sys.argv[1:]: print(u.find_spec(m).origin)"
    env = {**os.environ, "PYTHONPATH": f"{path}:{os.environ.get('PYTHONPATH', '')}"}
    found = subprocess.run(
        [sys.executable, "-c", code, *modules], env=env, check=True, capture_output=True, text=True
    ).stdout.split()
    assert len(found) == len(modules)
    assert all(f.startswith(str(clone / ".ab" / head)) for f in found), found
