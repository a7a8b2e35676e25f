"""The B4 harness (`python -m hybridgen.benchmarks.moe_bench`) at toy scale on the CPU: ours
with Cold-Weights under uniform and skewed routing, and the accelerate baseline, into the
JSON file and the table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridgen.benchmarks import moe_bench


@pytest.mark.slow
def test_moe_bench_runs_every_case(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(moe_bench.hlog, "configure", lambda: None)  # keep the test's logging
    out = tmp_path / "moe.json"
    result = moe_bench.main(
        [
            *("--model=tiny-mixtral", "--device=cpu", "--budget-mb=82", "--prompt-len=32"),
            *("--new-tokens=8", "--baseline-new-tokens=3", "--cpu-max-tokens=1"),
            *("--in-process", f"--out={out}"),
        ]
    )
    cases = result["cases"]
    assert list(cases) == ["uniform", "skewed", "accelerate"]
    for name, r in cases.items():
        assert "error" not in r, (name, r)
        assert r["decode_tok_s"] > 0 and r["ttft_ms"] > 0
    uniform, skewed = cases["uniform"], cases["skewed"]
    assert skewed["top2_share"] > uniform["top2_share"] + 0.2  # the bias concentrates routing
    assert 1 <= uniform["cache_slots"] <= uniform["experts_total"] == 32
    assert uniform["expert_format"] == "int4" and 0 <= uniform["cache_hit_rate"] <= 1
    for r in (uniform, skewed):  # the CPU's experts went to the worker, as under serve
        assert r["cpu_worker_experts"] > 0 and r["cpu_experts_by"].startswith("an expert worker")
        assert r["cpu_worker_experts"] == round(r["cpu_experts_per_token"] * 8)
    assert cases["accelerate"]["devices"] == ["cpu"] and cases["accelerate"]["shape"] == "same"
    assert json.loads(out.read_text())["cases"].keys() == cases.keys()
    assert not list(Path("/dev/shm").glob("*hybridgen-moe*"))  # the arena and links are gone
    assert "B4 moe" in capsys.readouterr().out


def test_unknown_case_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        moe_bench.main(["--cases=uniform,fast"])
    assert "unknown ['fast']" in capsys.readouterr().err


def test_each_case_process_gets_its_own_cases_and_out(tmp_path: Path) -> None:
    """Both spellings of --out and --cases are replaced, the other arguments kept."""
    out = tmp_path / "case.json"
    argv = [
        "--model",
        "tiny-mixtral",
        "--out",
        "/x/moe.json",
        "--cases=uniform,skewed",
        "--budget-mb",
        "64",
        "--out=/y.json",
        "--cases",
        "skewed",
    ]
    assert moe_bench.child_argv(argv, "skewed", out) == [
        "--in-process",
        "--model",
        "tiny-mixtral",
        "--budget-mb",
        "64",
        "--cases=skewed",
        f"--out={out}",
    ]


@pytest.mark.slow
def test_a_case_whose_engine_fails_leaves_no_arena(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A budget too small for one expert: the case reports the error and the expert arena,
    made before the engine gave up, is unlinked."""
    monkeypatch.setattr(moe_bench.hlog, "configure", lambda: None)
    argv = ["--model=tiny-mixtral", "--device=cpu", "--budget-mb=64", "--cases=uniform"]
    result = moe_bench.main([*argv, "--in-process", f"--out={tmp_path / 'moe.json'}"])
    assert result["cases"]["uniform"]["error"].startswith("BudgetTooSmall: ")
    assert not list(Path("/dev/shm").glob("*hybridgen-moe*"))
