"""bench/draft_agreement.py (run on the H200 for llama3-8b) at toy scale on the CPU: native KV
against itself is the reference, and each codec's teacher-forced predictions are counted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.bench_script import load_bench


@pytest.mark.slow
def test_agreement_on_a_tiny_model(tmp_path: Path) -> None:
    bench = load_bench("draft_agreement")
    out = tmp_path / "agreement.json"
    args = ["--model=tiny-llama", "--device=cpu", "--context-len=200", "--tokens=6"]
    result = bench.main([*args, "--codecs=native,int8", f"--out={out}"])
    assert result["codecs"]["native"]["teacher_forced_agreement"] == 1.0  # the reference
    assert result["codecs"]["native"]["free_running_first_divergence"] == 6
    assert len(result["codecs"]["int8"]["forced"]) == 6
    assert json.loads(out.read_text())["codecs"].keys() == {"native", "int8"}
