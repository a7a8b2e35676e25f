"""bench/moe_batch_profile.py (run on the device with B4c's config) at toy scale on the CPU:
the tiny Qwen3-MoE with its experts in host memory and a 6-slot cache, batches 1 and 2."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridgen.config.file import load_config
from hybridgen.engine.engine import Engine
from hybridgen.experts.store import ExpertCache
from hybridgen.models.moe import SparseMoeBlock
from tests.bench_script import load_bench

pytestmark = pytest.mark.slow


def test_batch_profile_times_the_expert_step_and_restores_it(tmp_path: Path) -> None:
    bench = load_bench("moe_batch_profile")
    config = tmp_path / "moe.yaml"
    config.write_text(
        "cold_weights: {expert_cache_slots: 6, expert_format: int4}\n"
        "model: {name_or_path: tiny-qwen3-moe, max_model_len: 512, max_num_seqs: 2}\n"
    )
    engine = Engine(load_config(str(config)).engine_config("cpu"))
    real = SparseMoeBlock.combine, ExpertCache.fetch_beside
    try:
        rows = [bench.batch_profile(engine, b, tokens=4) for b in (1, 2)]
    finally:
        engine.release()
    assert (SparseMoeBlock.combine, ExpertCache.fetch_beside) == real  # the wrappers are gone
    for batch, row in zip((1, 2), rows, strict=True):
        assert row["batch"] == batch and row["tok_s"] > 0 and row["decode_step_ms"] > 0
        assert row["misses_a_step"] + row["hits_a_step"] > 0
        host = row["host_ms_a_step"]
        assert host["combine"] >= host["_place"] > 0  # combine includes its placement
        assert row["calls_a_step"]["combine"] == pytest.approx(4, abs=1)  # 4 MoE layers
