"""The project's load client (python -m hybridgen.benchmarks.load): its figures from known
message times, and a whole run against `hybridgen serve` on the CPU, with the in-process
engine beside it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hybridgen.benchmarks.load import Stream, Workload, prompts, summarize


def _stream(sent: float, arrivals: list[float], counts: list[int]) -> Stream:
    return Stream(prompt_tokens=8, sent=sent, arrivals=arrivals, counts=counts)


def test_figures_from_known_times() -> None:
    a = _stream(0.0, [0.100, 0.110, 0.120, 0.140], [1, 1, 2, 1])
    b = _stream(0.0, [0.105, 0.115, 0.125], [1, 1, 1])
    bad = Stream(prompt_tokens=8, error="RESOURCE_EXHAUSTED: full")
    got = summarize([a, b, bad], "all")
    assert got["failed"] == 1 and got["tokens"] == 8
    assert got["ttft_ms_p50"] == pytest.approx(102.5)
    assert got["gap_ms_p50"] == pytest.approx(10.0)
    assert got["tokens_per_message"] == pytest.approx(6 / 5)
    # Both decode from 0.105 (the last first token) to 0.125 (the first finish): in (0.105,
    # 0.125] arrive a's 0.110 and 0.120 (3 tokens) and b's 0.115 and 0.125 (2).
    assert got["steady_tok_s"] == pytest.approx(5 / 0.020)
    assert got["total_tok_s"] == pytest.approx(8 / 0.140)
    assert summarize([a, b], "poisson")["steady_tok_s"] is None


def test_prompts_share_no_block() -> None:
    work = Workload(8, 8, (16, 32), 4, "all", 0.0)
    batch = prompts(work, 1000, seed=3)
    assert len(batch) == 8 and all(16 <= len(p) <= 32 for p in batch)
    assert len({tuple(p[:16]) for p in batch}) == 8
    assert all(125 <= t < 1000 for p in batch for t in p)
    assert prompts(work, 1000, seed=3) == batch != prompts(work, 1000, seed=4)


@pytest.mark.slow
def test_served_run_reports_what_a_client_sees(checkpoint, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    config = tmp_path / "hybridgen_config.yaml"
    config.write_text("model:\n  max_model_len: 128\n  max_num_seqs: 4\n")
    out = tmp_path / "load.json"
    flags = (
        "--device cpu --requests 3 --prompt-len 12 --prompt-len-max 20 --max-new-tokens 16 "
        "--runs 1 --warmup 0 --inprocess --name cpu"
    )
    cmd = [sys.executable, "-m", "hybridgen.benchmarks.load", *flags.split()]
    cmd += ["--config", str(config), "--model", str(checkpoint("llama3")), "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert any(line.startswith("| cpu |") for line in done.stdout.splitlines())
    result = json.loads(out.read_text())
    med, run = result["median"], result["runs"][0]
    assert run["requests"] == 3 and run["failed"] == 0 and run["tokens"] == 48
    # Every decode step's tokens leave on their own: one token a message.
    assert med["tokens_per_message"] == 1.0
    assert med["ttft_ms_p50"] > 0 and med["gap_ms_p50"] > 0 and med["steady_tok_s"] > 0
    assert result["inprocess"]["decode_tok_s"] > 0 and med["gap_over_step"] > 0
    # The server's own decode step at 3 streams (bucket 4), through the rings' stats.
    steps = result["server_info"]["decode_step_ms"]
    assert med["served_step_ms"] == steps["4"] > 0
    assert med["gap_over_served_step"] == pytest.approx(med["gap_ms_p50"] / steps["4"])
    assert result["server_info"]["max_model_len"] == 128
    # The server's account of the run's time, from its GetModelInfo before and after.
    spent = med["server_time"]
    assert spent["decode"] > 0 and spent["prefill"] > 0 and spent["outputs"] > 0
    phases = sum(v for k, v in spent.items() if k not in ("idle", "wall"))
    assert phases + spent["idle"] == pytest.approx(spent["wall"]) and phases <= spent["wall"]
    assert any(line.startswith("server time over the run") for line in done.stdout.splitlines())
    # Its passes: 3 streams of 16 tokens, each stream's first from its prompt's pass.
    passes = run["server_passes"]
    decode_rows = sum(p["passes"] * p["rows_per_pass"] for p in passes.values())
    assert decode_rows == pytest.approx(48 - 3) and passes["decode"]["ms_per_pass"] > 0
    assert passes["prefill"]["prompt_tokens_per_pass"] > 0
    assert any(
        line.startswith("server passes over the run: decode ") for line in done.stdout.splitlines()
    )
    assert result["server"]["serve_exit_code"] == 0 and not result["server"]["shm_left_after_stop"]
    assert result["machine"]["commit"] and result["command"].startswith("python -m hybridgen")
