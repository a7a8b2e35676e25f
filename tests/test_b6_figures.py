"""The article's three figures per B6 workload from the runs' JSON files: hybrid / pure_gpu
TTFT and throughput at one budget, and the share of that budget hybrid needs to reach
pure_gpu's TTFT."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridgen.benchmarks.b6_figures import main


def e2e(ttft: float, tok_s: float) -> dict[str, float]:
    return {"p50_first_token_latency_ms": ttft, "tok_per_s": tok_s, "gpu_mem_peak_mb": 24000.0}


def chat(ttft: float, tok_s: float) -> dict[str, object]:
    median = {"ttft_ms_p50": ttft, "total_tok_s": tok_s}
    return {"median": median, "server_info": {"gpu_mem_peak_reserved_mb": 24100.0}}


def test_figures_side_by_side(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    files = {
        "b6i.json": {"hybrid": e2e(1000, 180), "pure_gpu": e2e(1000, 180)},
        "b6ii.json": {"hybrid": e2e(550, 900), "pure_gpu": e2e(500, 1000)},
        "chat_pure_gpu.json": chat(3000, 400),
        "chat_hybrid.json": chat(1000, 700),
        "mem_chat_16384.json": chat(2800, 500),  # still under pure_gpu's 3 s at 24 GB
        "mem_chat_12288.json": chat(3500, 300),  # not any more
        "mem_b6i_20480.json": e2e(1200, 150),  # slower than pure_gpu: not reached below 24 GB
        "int8_chat.json": chat(900, 800),  # hybrid with int8 Hot
    }
    for name, data in files.items():
        (tmp_path / name).write_text(json.dumps(data))
    assert main([str(tmp_path)]) == 0
    result = json.loads((tmp_path / "b6_figures.json").read_text())
    assert result["chat"]["ttft"] == pytest.approx(1 / 3)
    assert result["chat"]["throughput"] == pytest.approx(1.75)
    assert result["chat"]["memory"] == pytest.approx(16384 / 24576)
    assert result["b6i"]["memory"] == 1.0  # reached at the budget itself, at no smaller one
    assert result["b6ii"]["memory"] is None  # hybrid's TTFT is higher even at the budget
    assert result["chat"]["int8_hot"]["throughput"] == pytest.approx(2.0)
    assert "int8_hot" not in result["b6i"]
    printed = capsys.readouterr().out
    assert "| B6 (iii) multi-turn, 48 x 6, 32 in flight | memory | 64 % | 67 % | - |" in printed
    short = "| B6 (ii) many short prompts, batch 16 |"
    assert f"{short} ttft | 0.77 (-23 %) | 1.10 (+10 %) | <= 1.03: MISSED |" in printed
    assert "| throughput, int8 Hot | 1.70x | 2.00x | >= 1.5: met |" in printed
    assert ">= 1.5: met" in printed and f"{short} memory | 64 % | not reached | - |" in printed
