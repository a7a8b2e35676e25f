"""`python -m hybridgen.tools.kv_stress_test` on the CPU: a context three times the Hot region
is served from both tiers, and the report names both figures and what they mean."""

from __future__ import annotations

import pytest

from hybridgen.tools import kv_stress_test


@pytest.fixture(autouse=True)
def keep_test_logging(monkeypatch: pytest.MonkeyPatch) -> None:
    """main() configures logging onto this test's captured stderr; keep pytest's instead."""
    monkeypatch.setattr(kv_stress_test.hlog, "configure", lambda: None)


@pytest.mark.slow
def test_stress_test_reports_both_tiers(capsys: pytest.CaptureFixture[str]) -> None:
    results = kv_stress_test.main(
        [
            "--model=tiny-llama",
            "--context-len=1024",
            "--warmup-tokens=8",
            "--runs=2",
            "--device=cpu",
            "--hot-region-mb=1.5",  # 768 of 1032 tokens fit in Hot (fp32 tiny-llama)
        ]
    )
    assert len(results) == 2
    for r in results:
        assert 0.5 < r["hot_hit_rate"] < 0.95
        assert r["warm_decompress_p95_ms"] >= r["warm_decompress_p50_ms"] > 0
        assert r["spilled_blocks"] > 0 and r["decode_tok_s"] > 0
    out = capsys.readouterr().out
    assert "Hot Hit Rate" in out and "Warm Decompress Latency" in out
    assert "kv_cache.hot_region_mb" in out


def test_too_small_hot_region_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        kv_stress_test.main(
            ["--model=tiny-llama", "--context-len=600", "--device=cpu", "--hot-region-mb=0.1"]
        )
    assert exc.value.code == 2
    assert "too small" in capsys.readouterr().err
