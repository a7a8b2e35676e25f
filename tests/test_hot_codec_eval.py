"""bench/hot_codec_eval.py (run on the H200 with SmolLM2 and llama3-8b) at toy scale on the
CPU: native Hot-KV against itself agrees fully, every codec's agreement and speed are in the
JSON, and the verdict applies the bars to int8."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.bench_script import load_bench


def _bench():  # type: ignore[no-untyped-def]
    return load_bench("hot_codec_eval")


def test_agreement_speed_and_verdict_on_tiny_models(checkpoint, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    bench = _bench()
    out = tmp_path / "hot_codec.json"
    args = [f"--agreement-model={checkpoint('llama3')}", "--speed-model=tiny-llama"]
    args += ["--device=cpu", "--budget-mb=2048", "--context-len=64", "--batches=1,2"]
    args += ["--new-tokens=8", "--runs=1", "--tokens=8", "--prompts=1", "--codecs=native,int8"]
    assert bench.main([*args, f"--out={out}"]) == 0
    result = json.loads(out.read_text())
    assert result["agreement"]["native"]["teacher_forced_min"] == 1.0  # the reference itself
    assert result["agreement"]["native"]["first_divergence_median"] == 8
    assert 0 <= result["agreement"]["int8"]["teacher_forced_min"] <= 1
    speed = result["speed"]
    assert speed["int8"]["hot_tokens"] > speed["native"]["hot_tokens"]  # int8 holds more
    assert speed["int8"]["batches"]["2"]["decode_tok_s"] > 0
    # The engine's passes over the timed run: 2 rows of 8 tokens, each row's first from its
    # prompt's pass, every prompt token computed once.
    passes = speed["int8"]["batches"]["2"]["passes"]
    assert sum(p["passes"] * p["rows_per_pass"] for p in passes.values()) == pytest.approx(2 * 7)
    prompt = sum(p["passes"] * p["prompt_tokens_per_pass"] for p in passes.values())
    assert prompt == pytest.approx(2 * 64) and passes["decode"]["ms_per_pass"] > 0
    assert result["verdict"].startswith("int8 ") and "bar 95%" in result["verdict"]


def test_verdict_applies_both_bars() -> None:
    bench = _bench()
    native = {"hot_tokens": 100, "batches": {"1": {"decode_tok_s": 100.0}}}

    def verdict(agree: float, tok_s: float) -> str:
        int8 = {"hot_tokens": 200, "batches": {"1": {"decode_tok_s": tok_s}}}
        agreement = {"int8": {"teacher_forced_min": agree}}
        result = {"agreement": agreement, "speed": {"native": native, "int8": int8}}
        return str(bench.verdict(result))

    assert verdict(0.96, 98.0).startswith("int8 qualifies")
    assert verdict(0.94, 120.0).startswith("int8 does not qualify")
    assert verdict(0.99, 96.0).startswith("int8 does not qualify")

    assert bench.parse_args(["--out=x.json"]).agreement_model == "smollm2-135m-instruct"
