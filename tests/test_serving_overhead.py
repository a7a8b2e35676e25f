"""The B5 serving-overhead benchmark in a quick mode: a few tokens through `hybridgen serve`
on the CPU, a few thousand ring tickets and 1 s of heartbeat. Asserts the shape and sanity
of the figures, not the targets: this 2-core machine is too noisy for absolute times."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import pytest

from hybridgen.benchmarks import serving_overhead as so
from hybridgen.ipc import shm

QUICK = ["--device", "cpu", "--tokens", "12", "--runs", "1", "--tickets", "4000"]
QUICK += ["--jitter-seconds", "1"]


def _positive(x: Any) -> bool:
    return isinstance(x, float | int) and math.isfinite(x) and x > 0


@pytest.fixture(scope="module")
def result() -> dict[str, Any]:
    args = argparse.Namespace(
        model="tiny-llama",
        device="cpu",
        tokens=12,
        runs=1,
        tickets=4000,
        jitter_seconds=1.0,
        weights_format="int4",  # both sides load int4 weights from the one config
    )
    return so.run(args)


@pytest.mark.slow
def test_decode_both_ways(result: dict[str, Any]) -> None:
    d = result["decode"]
    for side in ("inprocess", "served"):
        assert _positive(d[side]["ttft_ms"]) and _positive(d[side]["decode_ms_per_token"])
        (run,) = d[side]["runs"]
        assert run["tokens"] == 12  # ignore_eos: exactly the tokens asked for
        assert run["messages"] >= 2
    assert math.isfinite(d["added_ms_per_token"]) and _positive(d["ratio_served_over_inprocess"])
    # One run each: the paired median is that pair's difference.
    assert d["added_ms_per_token"] == pytest.approx(
        d["served"]["decode_ms_per_token"] - d["inprocess"]["decode_ms_per_token"]
    )
    best = d["best_of_runs"]
    assert best["added_ms_per_token"] == pytest.approx(d["added_ms_per_token"])
    assert _positive(best["ratio_served_over_inprocess"])
    assert d["engine_config"]["model"] == "tiny-llama"
    assert d["engine_config"]["weights_format"] == "int4"
    # The server stopped on SIGTERM and left nothing in /dev/shm.
    assert d["serve_exit_code"] == 0 and d["shm_left_after_stop"] == []
    assert not list(shm.SHM_DIR.glob(f"*{shm.PREFIX}-{d['instance']}-*"))


@pytest.mark.slow
def test_ring_figures(result: dict[str, Any]) -> None:
    r = result["ring"]
    assert _positive(r["tickets_per_s"]) and r["tickets"] == 4000
    lat = r["latency_us"]
    assert _positive(lat["p50"]) and lat["p50"] <= lat["p99"] <= lat["max"]
    assert r["corrupt"] == 0 and r["producer_exit_code"] == 0 and r["shm_left"] == []


@pytest.mark.slow
def test_heartbeat_figures(result: dict[str, Any]) -> None:
    h = result["heartbeat"]
    # 1 s of 2 ms ticks: several hundred even on a loaded machine.
    assert h["ticks"] > 100 and h["period_ms"] == pytest.approx(2.0)
    late = h["lateness_ms"]
    assert all(math.isfinite(v) and v >= 0 for v in late.values())
    assert late["p50"] <= late["p99"] <= late["max"]
    assert h["peer_dead"] == [] and h["shm_left"] == []


@pytest.mark.slow
def test_main_writes_json_and_prints_the_table_last(
    result: dict[str, Any],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Reuse the measured result: main's own part is the CLI, the file and the table.
    monkeypatch.setattr(so, "run", lambda args: result)
    monkeypatch.setattr(so.hlog, "configure", lambda: None)  # keep the test's logging
    out = tmp_path / "b5.json"
    so.main([*QUICK, "--out", str(out)])
    saved = json.loads(out.read_text())
    assert set(saved) >= {"machine", "command", "decode", "ring", "heartbeat", "targets"}
    assert saved["machine"]["cpu_count"] >= 1
    assert set(saved["targets"]) == set(so.TARGETS)
    for v in saved["targets"].values():
        assert isinstance(v["pass"], bool) and math.isfinite(v["measured"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-4].startswith("target")
    assert [line.split()[0] for line in lines[-3:]] == list(so.TARGETS)
    assert all(line.split()[-1] in ("PASS", "FAIL") for line in lines[-3:])


def test_verdicts_compare_each_way() -> None:
    fake = {
        "decode": {"added_ms_per_token": 0.2},
        "ring": {"tickets_per_s": 250_000.0},
        "heartbeat": {"lateness_ms": {"p99": 0.5}},
    }
    v = so.verdicts(fake)
    assert [v[k]["pass"] for k in so.TARGETS] == [False, True, True]
