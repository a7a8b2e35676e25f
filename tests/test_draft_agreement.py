"""bench/draft_agreement.py (run on the H200 for llama3-8b) at toy scale on the CPU: native KV
against itself is the reference, and each codec's teacher-forced predictions are counted."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench" / "draft_agreement.py"


@pytest.mark.slow
def test_agreement_on_a_tiny_model(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("draft_agreement", BENCH)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "agreement.json"
    args = ["--model=tiny-llama", "--device=cpu", "--context-len=200", "--tokens=6"]
    result = bench.main([*args, "--codecs=native,int8", f"--out={out}"])
    assert result["codecs"]["native"]["teacher_forced_agreement"] == 1.0  # the reference
    assert result["codecs"]["native"]["free_running_first_divergence"] == 6
    assert len(result["codecs"]["int8"]["forced"]) == 6
    assert json.loads(out.read_text())["codecs"].keys() == {"native", "int8"}
