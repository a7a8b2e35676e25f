"""The e2e benchmark (BENCHMARKS.md B6): the real module, run as a subprocess against
`hybridgen serve` with tiny-llama on the CPU, its statistics against numpy, its argument
errors, and the sample prompt file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from hybridgen.benchmarks.e2e_benchmark import BenchmarkError, check_fit, main, write_config
from hybridgen.benchmarks.e2e_plot import PERCENTILES, RequestResult, percentile, summarize
from hybridgen.benchmarks.prompt_file import load_prompts
from hybridgen.config.file import load_config

ROOT = Path(__file__).resolve().parents[1]
NEW_TOKENS = 8
PROMPTS = [
    "Hi!",
    "What is the capital of France?",
    "Summarize: the cache holds keys and values of every earlier token, so decode steps "
    "attend to it instead of recomputing the whole prefix.",
    "Write a haiku about a server room at night.",
    "Explain, in two sentences, why decode is limited by memory bandwidth.",
]
SUMMARY_KEYS = {
    "model",
    "mode",
    "device",
    "requests",
    "batch_size",
    "max_new_tokens",
    "tok_per_s",
    "gpu_mem_peak_mb",
    "avg_first_token_latency_ms",
    "per_request",
    *(f"p{q}_{m}_latency_ms" for q in PERCENTILES for m in ("first_token", "e2e")),
}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_prompts(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def run_benchmark(tmp: Path, *extra: str) -> tuple[dict[str, Any], str]:
    prompts = write_prompts(tmp / "prompts.jsonl", [json.dumps({"prompt": p}) for p in PROMPTS])
    cmd = [sys.executable, "-m", "hybridgen.benchmarks.e2e_benchmark", "--model", "tiny-llama"]
    cmd += ["--prompt-file", str(prompts), "--batch-size", "2"]
    cmd += ["--max-new-tokens", str(NEW_TOKENS), "--out", str(tmp / "out"), *extra]
    env = {**os.environ, "HYBRIDGEN_COMMIT": "test"}  # no git lookup from the benchmark
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp)
    assert done.returncode == 0, done.stderr[-3000:]
    rounds = int(extra[extra.index("--rounds") + 1]) if "--rounds" in extra else 1
    assert "e2e_requests_done" in done.stderr and f"total={len(PROMPTS) * rounds}" in done.stderr
    png = (tmp / "out" / "e2e_latency.png").read_bytes()
    assert png.startswith(PNG_MAGIC) and len(png) > 10_000
    return json.loads((tmp / "out" / "e2e.json").read_text()), done.stdout


def check_run(run: dict[str, Any], mode: str, rounds: int = 1) -> None:
    """One mode's figures: every request of every timed round streamed exactly NEW_TOKENS,
    TTFT <= e2e, and the summary agrees with the per-request rows and the rounds' own."""
    assert run.keys() >= SUMMARY_KEYS
    assert run["mode"] == mode and run["model"] == "tiny-llama" and run["synthetic"]
    n = len(PROMPTS)
    assert (run["requests"], run["failed"], run["batch_size"]) == (n * rounds, 0, 2)
    rows = run["per_request"]
    assert [r["line"] for r in rows] == list(range(1, n + 1)) * rounds
    assert [r["round"] for r in rows] == [i // n for i in range(n * rounds)]
    for r in rows:
        assert r["error"] is None and r["finish_reason"] == "FINISH_REASON_LENGTH"
        assert r["tokens"] == r["max_new_tokens"] == NEW_TOKENS
        assert 0 < r["ttft_ms"] <= r["e2e_ms"]
    assert rows[0]["prompt_tokens"] < rows[2]["prompt_tokens"]  # from the server's usage
    for later in rows[n:]:  # a later round's prompts carry its head: none is cached
        assert later["prompt_tokens"] > rows[later["line"] - 1]["prompt_tokens"]
    e2e = [r["e2e_ms"] for r in rows]
    assert run["p95_e2e_latency_ms"] == pytest.approx(np.percentile(e2e, 95))
    assert run["tok_per_s"] == pytest.approx(n * rounds * NEW_TOKENS / run["wall_s"])
    each = run["per_round"]
    assert run["rounds"] == len(each) == rounds
    assert run["wall_s"] == pytest.approx(sum(r["wall_s"] for r in each))
    for i, r in enumerate(each):
        ttft = [x["ttft_ms"] for x in rows[i * n : (i + 1) * n]]
        assert r["p50_first_token_latency_ms"] == pytest.approx(np.percentile(ttft, 50))
        assert r["tok_per_s"] == pytest.approx(n * NEW_TOKENS / r["wall_s"])
        assert r["wall_s"] * 1e3 >= max(e2e[i * n : (i + 1) * n])
    # tiny-llama runs on the CPU here: no GPU memory to report, and the JSON says why.
    assert run["device"] == "cpu" and run["gpu_mem_peak_mb"] is None
    assert run["gpu_mem_peak_source"]
    server = run["server"]
    assert server["serve_exit_code"] == 0 and server["shm_left_after_stop"] == []


@pytest.mark.slow
def test_one_mode_through_the_gateway(tmp_path: Path) -> None:
    result, stdout = run_benchmark(tmp_path)
    check_run(result, "hybrid")
    assert stdout.rstrip().splitlines()[-1].startswith("gpu_mem_peak_mb")  # the table is last
    assert (tmp_path / "out" / "serve-hybrid" / "gpu.log").is_file()


@pytest.mark.slow
def test_compare_runs_both_modes_and_reports_ratios(tmp_path: Path) -> None:
    result, stdout = run_benchmark(tmp_path, "--compare", "--warmup", "0", "--rounds", "2")
    assert result["mode"] == "compare"
    for mode in ("hybrid", "pure_gpu"):
        check_run(result[mode], mode, rounds=2)
    config = (tmp_path / "out" / "serve-pure_gpu" / "hybridgen_config.yaml").read_text()
    assert "mode: pure_gpu" in config
    ratios, hybrid, pure = result["ratios"], result["hybrid"], result["pure_gpu"]
    for key in ("avg_first_token_latency_ms", "p50_first_token_latency_ms", "tok_per_s"):
        assert ratios[key] == pytest.approx(hybrid[key] / pure[key])
    assert ratios["gpu_mem_peak_mb"] is None
    table = stdout.splitlines()
    assert {"hybrid", "pure_gpu"} <= {line.split(" ")[0] for line in table}
    for mode in ("hybrid", "pure_gpu"):  # each server's account of its time
        spent = result[mode]["server_time"]
        assert spent["decode"] > 0 and spent["wall"] == pytest.approx(result[mode]["wall_s"])
        assert any(line.startswith(f"{mode}: server time over the run") for line in table)
        assert any(line.startswith(f"{mode}: 2 rounds: tok/s ") for line in table)
        passes = result[mode]["server_passes"]  # each request's first token from its prompt
        rows = sum(p["passes"] * p["rows_per_pass"] for p in passes.values())
        assert rows == pytest.approx(2 * len(PROMPTS) * (NEW_TOKENS - 1))
        assert any(line.startswith(f"{mode}: server passes over the run: ") for line in table)
    assert table[-1].lstrip().startswith("gpu_mem_peak_mb")  # the ratios close the table


# -- the numbers ----------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 7, 100])
def test_percentile_matches_numpy(n: int) -> None:
    values = np.random.default_rng(n).lognormal(3.0, 1.0, n).tolist()
    for q in (0, 1, 25, 50, 90, 95, 99, 99.9, 100):
        assert percentile(values, q) == pytest.approx(np.percentile(values, q), rel=1e-12)


def test_summary_matches_numpy_and_skips_failed_requests() -> None:
    rng = np.random.default_rng(0)
    ttft, extra = rng.uniform(5, 50, 9), rng.uniform(10, 500, 9)
    results = [
        RequestResult(i, i + 1, 16, tokens=16, ttft_ms=float(t), e2e_ms=float(t + x))
        for i, (t, x) in enumerate(zip(ttft, extra, strict=True))
    ]
    results.append(RequestResult(9, 10, 16, tokens=3, e2e_ms=1e6, error="UNAVAILABLE: gone"))
    summary = summarize(results, wall_s=2.0)
    assert (summary["requests"], summary["failed"]) == (10, 1)
    assert summary["tok_per_s"] == pytest.approx((9 * 16 + 3) / 2.0)
    assert summary["avg_first_token_latency_ms"] == pytest.approx(ttft.mean())
    for q in PERCENTILES:
        assert summary[f"p{q}_first_token_latency_ms"] == pytest.approx(np.percentile(ttft, q))
        assert summary[f"p{q}_e2e_latency_ms"] == pytest.approx(np.percentile(ttft + extra, q))


def test_summary_of_nothing_has_no_latencies() -> None:
    summary = summarize([RequestResult(0, 1, 4, error="INVALID_ARGUMENT: x")], wall_s=1.0)
    assert summary["failed"] == 1 and summary["p95_e2e_latency_ms"] is None


# -- arguments and the prompt file ----------------------------------------------------------


@pytest.mark.parametrize(
    ("flag", "value", "expected"),
    [
        ("--batch-size", "0", "argument --batch-size: 0 is out of range: allowed >= 1"),
        ("--batch-size", "two", "argument --batch-size: 'two' is not an integer (allowed >= 1)"),
        ("--max-new-tokens", "-3", "argument --max-new-tokens: -3 is out of range: allowed >= 1"),
        ("--port", "70000", "argument --port: 70000 is out of range: allowed 1 <= N <= 65535"),
        ("--rounds", "0", "argument --rounds: 0 is out of range: allowed 1 <= N <= 20"),
        ("--target", "localhost", "argument --target: 'localhost': expected HOST:PORT"),
    ],
)
def test_bad_numbers_name_the_flag_and_range(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str, value: str, expected: str
) -> None:
    prompts = write_prompts(tmp_path / "p.jsonl", ['{"prompt": "hi"}'])
    with pytest.raises(SystemExit) as exit_info:
        main(["--prompt-file", str(prompts), flag, value])
    assert exit_info.value.code == 2
    assert expected in capsys.readouterr().err


@pytest.mark.parametrize(
    ("lines", "expected"),
    [
        (None, "cannot read"),
        ([], "holds no prompts"),
        (['{"prompt": "ok"}', "", '{"prompt": "a", }'], "line 3: not valid JSON"),
        (['{"prompt": "ok"}', '["a list"]'], "line 2: expected an object"),
        (['{"prompt": ""}'], "line 1: 'prompt' must be a non-empty string"),
        (['{"text": "hi"}'], "line 1: unknown key 'text'; allowed prompt, max_new_tokens"),
        (['{"prompt": "a", "max_new_tokens": 0}'], "line 1: max_new_tokens=0 is out of range"),
        (['{"prompt": "a", "max_new_tokens": true}'], "line 1: max_new_tokens=True is out"),
        (['{"prompt": "a", "max_new_tokens": 2.5}'], "line 1: max_new_tokens=2.5 is out"),
    ],
)
def test_bad_prompt_file_names_the_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], lines: list[str] | None, expected: str
) -> None:
    path = tmp_path / "p.jsonl"
    if lines is not None:
        write_prompts(path, lines)
    with pytest.raises(SystemExit):
        main(["--prompt-file", str(path)])
    err = capsys.readouterr().err
    assert "argument --prompt-file" in err and expected in err


def test_compare_with_target_and_bad_config_are_rejected(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prompts = str(write_prompts(tmp_path / "p.jsonl", ['{"prompt": "hi"}']))
    with pytest.raises(SystemExit):
        main(["--prompt-file", prompts, "--compare", "--target", "127.0.0.1:1"])
    assert "argument --compare" in capsys.readouterr().err
    config = tmp_path / "c.yaml"
    config.write_text("mode: gpu_only\n")
    with pytest.raises(SystemExit):
        main(["--prompt-file", prompts, "--config", str(config)])
    err = capsys.readouterr().err
    assert "argument --config" in err and "mode" in err


def test_pure_gpu_config_drops_the_warm_tier_and_cpu_pins(tmp_path: Path) -> None:
    """A hybrid config with a Warm tier and CPU pins still runs --compare: the pure_gpu copy
    clears what that mode forbids, and the hybrid copy keeps it."""
    source = tmp_path / "hybrid.yaml"
    source.write_text(
        "kv_cache:\n  warm_region_mb: 64\n  warm_codec: lossless\n"
        "placements:\n  attn_warm: cpu\n  sample: cpu\n"
    )
    expected = {"hybrid": (64, "cpu", "cpu"), "pure_gpu": (0, "gpu", "gpu")}
    for mode, placed in expected.items():
        folder = tmp_path / mode
        folder.mkdir()
        config = load_config(write_config(source, mode, folder, tmp_path / "run"))
        assert config.mode == mode and config.kv_cache.warm_codec == "lossless"
        engine = config.engine_config("cpu")
        assert (engine.warm_pool_mb, engine.attn_warm, engine.sample_placement) == placed


def test_sample_prompt_file_has_mixed_lengths() -> None:
    prompts = load_prompts(ROOT / "bench" / "prompts.jsonl")
    words = sorted(len(p.text.split()) for p in prompts)
    assert 35 <= len(prompts) <= 45
    short = sum(w < 30 for w in words)
    medium = sum(30 <= w < 300 for w in words)
    long = [w for w in words if w >= 300]
    assert short >= 10 and medium >= 10 and len(long) >= 4, words
    assert words[-1] >= 1500  # at least one document of about 2,000 words
    assert len({p.text for p in prompts}) == len(prompts)  # no repeats: no prefix-cache hits


def test_prompts_that_do_not_fit_say_whose_limit_it_is() -> None:
    """bench/prompts.jsonl against tiny-llama's 4,096 tokens under --max-new-tokens 64: the
    long lines set their own 256, and the message says so instead of seeming to ignore 64."""
    prompts = load_prompts(ROOT / "bench" / "prompts.jsonl")

    class Stub:
        def Tokenize(self, request: Any, timeout: float) -> Any:
            return SimpleNamespace(token_ids=list(request.text.encode()))  # bytes, as tiny-llama

    info = SimpleNamespace(max_model_len=4096, model="tiny-llama")
    with pytest.raises(BenchmarkError) as error:
        check_fit(Stub(), prompts, 64, info)
    message = str(error.value)
    assert "do not fit the served context of 4,096 tokens (tiny-llama)" in message
    assert "256 new tokens, the line's max_new_tokens" in message
    assert "bench/prompts_short.jsonl" in message
    check_fit(Stub(), load_prompts(ROOT / "bench" / "prompts_short.jsonl"), 64, info)
