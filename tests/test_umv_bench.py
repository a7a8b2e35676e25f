"""The B3 harness (`python -m hybridgen.benchmarks.umv_bench`) at toy scale on the CPU: every
case runs or records why not, the four-sequence case really uses Warm, and the JSON and the
table come out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hybridgen.benchmarks import umv_bench


@pytest.mark.slow
def test_umv_bench_runs_every_case(
    checkpoint,  # type: ignore[no-untyped-def]
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A 16-layer toy, where the room a prefill needs to read Warm in place (one layer's
    prefix, three times) is small against the KV it frees (sixteen layers'), as for
    llama3-8b; in a 4-layer model the two are nearly equal and Warm cannot pay."""
    monkeypatch.setattr(umv_bench.hlog, "configure", lambda: None)  # keep the test's logging
    out = tmp_path / "umv.json"
    model = checkpoint("llama3", num_hidden_layers=16, max_position_embeddings=4096)
    result = umv_bench.main(
        [
            f"--model={model}",
            "--device=cpu",
            "--context-len=1000",  # longer than Hot (20 blocks of 16): it spills, as at 128K
            "--new-tokens=16",
            "--turn-tokens=4",
            "--budget-mb=70",
            "--chunk=128",
            "--hf-new-tokens=16",
            "--draft-tokens=3",
            f"--out={out}",
            "--in-process",
        ]
    )
    cases = result["cases"]
    assert set(cases) == {
        "b3a",
        "b3a_warm",
        "b3b_cpu",
        "b3b_gpu",
        "b3b_split",
        "b3b_auto",
        "b3b_drafts3",
        "b3c",
        "b3c_kivi",
        "b3c_pure_gpu",
        "pure_gpu",
        "unbudgeted",
        "hf",
    }
    # Pure GPU in the same budget fails cleanly, naming the key: the context does not fit.
    assert cases.pop("pure_gpu")["error"].startswith(
        "BudgetTooSmall: device_topology.gpu.memory_mb=70 is too small"
    )
    # int4 Hot alone holds two of the four here: it serves them two at a time, never all four.
    serial = cases.pop("b3c_pure_gpu")
    assert serial["e2e_tok_s"] > 0 and not serial["all_at_once"] and serial["decode_tok_s"] == 0
    for name, r in cases.items():
        assert "error" not in r, (name, r)
        assert r["decode_tok_s"] > 0 and r["ttft_ms"] > 0 and r.get("all_at_once", name == "hf")
    assert cases["b3b_gpu"]["tiers"]["hot_hit_rate"] < 1.0  # one sequence overflows Hot
    assert cases["b3c_kivi"]["tiers"]["hot_hit_rate"] < 0.5  # four at once, read from Warm
    assert cases["b3b_split"]["attn_warm"]["mode"] == "split"
    drafts = cases["b3b_drafts3"]["drafts"]  # up to 3 drafts a check (fewer near the end)
    assert 0 < drafts["rounds"] <= drafts["drafted"] <= 3 * drafts["rounds"]
    b3c = cases["b3c"]  # int4 Hot holds two of the four: they take turns there
    assert b3c["config"]["hot_codec"] == "int4" and b3c["turns_in_hot"] > 0
    assert b3c["tiers"]["warm_blocks_total"] > 0 and b3c["max_token_gap_ms"] > 0
    assert json.loads(out.read_text())["cases"].keys() == {*cases, "pure_gpu", "b3c_pure_gpu"}
    assert "B3 umv" in capsys.readouterr().out


@pytest.mark.slow
def test_cases_run_in_child_processes(tmp_path: Path) -> None:
    """The default: each case in its own process, merged into one file."""
    out = tmp_path / "umv.json"
    result = umv_bench.main(
        [
            *("--model=tiny-llama", "--device=cpu", "--context-len=200", "--new-tokens=3"),
            *("--budget-mb=72", "--chunk=128", "--cases=b3a,pure_gpu", f"--out={out}"),
        ]
    )
    assert list(result["cases"]) == ["b3a", "pure_gpu"]
    assert all(r["decode_tok_s"] > 0 for r in result["cases"].values())
    assert json.loads(out.read_text())["cases"] == result["cases"]


def test_hf_timing_comes_from_one_run() -> None:
    """TTFT and decode rate of the HF baselines come from when each token of one run arrived,
    not from two runs subtracted (on a busy host that came out at -16.9 tok/s)."""
    import time

    from hybridgen.benchmarks.hf_baseline import timed_generate

    runs: list[int] = []

    class Slow:
        def generate(self, ids, attention_mask, generation_config, streamer):  # type: ignore[no-untyped-def]
            n = generation_config.max_new_tokens
            runs.append(n)
            if streamer is not None:
                streamer.put(ids)
            time.sleep(0.3 if n == 1 else 0.02)  # prefill; the warm-up is much slower
            for _ in range(n):
                if streamer is not None:
                    streamer.put(ids[:, :1])
                time.sleep(0.01)

    ttft, rate = timed_generate(Slow(), torch.zeros(1, 4, dtype=torch.long), 6)
    assert runs == [1, 6]  # a one-token warm-up, then the timed run
    assert 0.015 < ttft < 0.2  # the timed run's first token, not the warm-up's
    assert 10 < rate < 105  # five tokens 10 ms apart
