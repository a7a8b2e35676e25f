"""What each process imports before it serves. On a small host an import is seconds of every
start: torch alone ~2.5 s on 2 cores, torch._dynamo another 1.2-1.8 s (bench/NOTES.md,
session of 2026-12-07). The gateway, with the served model's tokenizer, needs neither; the
CPU daemon needs torch, not torch._dynamo; the engine imports the prefill's CausalBias (and
with it torch._dynamo) at start, not in its first request."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hybridgen.models.default_model import DEFAULT_MODEL


def _modules_after(code: str) -> set[str]:
    """The modules a fresh interpreter holds after running `code`."""
    probe = f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return set(json.loads(done.stdout.splitlines()[-1]))


def test_the_gateway_and_its_tokenizer_import_no_torch() -> None:
    modules = _modules_after(
        "import hybridgen.gateway.main\n"
        "from hybridgen.models.tokenizer_source import load_tokenizer\n"
        f"assert load_tokenizer({DEFAULT_MODEL!r}).encode('Hello')"
    )
    assert "hybridgen.serving.openai_http" in modules and "torch" not in modules


@pytest.mark.slow
def test_the_cpu_daemon_imports_no_dynamo_and_the_engine_does() -> None:
    cpu = _modules_after("import hybridgen.cpu_daemon.main")
    assert "torch" in cpu and "torch._dynamo" not in cpu
    engine = _modules_after("import hybridgen.engine.engine")
    assert "torch.nn.attention.bias" in engine
