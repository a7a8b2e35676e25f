"""The op-region table: every region with its label and placement, and where each placement
came from (pinned by the config, measured, or the default), as the engine really runs it."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridgen.config.file import parse_config
from hybridgen.engine.engine import Engine
from hybridgen.engine.info import engine_regions
from hybridgen.placement.op_regions import GPU_BOUND_LAYER, format_table


def _engine(path: Path, yaml: dict[str, object]) -> Engine:
    config = parse_config({"model": {"name_or_path": str(path), "max_model_len": 256}, **yaml})
    return Engine(config.engine_config("cpu"))


def test_table_follows_the_engine(checkpoint) -> None:  # type: ignore[no-untyped-def]
    path = checkpoint("llama3")
    plain = _engine(path, {})
    rows = {r.name: r for r in engine_regions(plain)}
    assert set(GPU_BOUND_LAYER) | {"lm_head", "attn_warm", "kv_codec", "sample"} == set(rows)
    assert all(rows[n].label == "gpu-bound" and rows[n].placement == "gpu" for n in GPU_BOUND_LAYER)
    assert rows["attn_warm"].placement == "off"  # no Warm tier configured
    assert (rows["sample"].placement, rows["sample"].source) == ("gpu", "default")
    plain.release()

    pinned = _engine(
        path,
        {
            "kv_cache": {"warm_region_mb": 2},
            "placements": {"attn_warm": "cpu", "kv_codec": "cpu", "sample": "cpu"},
        },
    )
    rows = {r.name: r for r in engine_regions(pinned)}
    assert pinned.warm is not None and pinned.warm.codec_on == "cpu"
    for name in ("attn_warm", "kv_codec", "sample"):
        assert (rows[name].label, rows[name].placement, rows[name].source) == (
            "hybrid-aware",
            "cpu",
            "pinned",
        )
    text = format_table(list(rows.values()))
    assert text.splitlines()[0].split()[:5] == ["region", "scope", "label", "placement", "source"]
    assert "attn_warm   layer  hybrid-aware  cpu" in text
    pinned.release()


def test_start_up_measurement_places_sample_and_kv_codec(checkpoint, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Unplaced sample and kv_codec are timed both ways at start and placed by the figures
    (region_timing); a pinned region is left alone. On CUDA this runs by default; here it is
    asked for (measure_regions), and kv_codec's timing is replaced to force the CPU side."""
    import dataclasses

    from hybridgen.engine import startup
    from hybridgen.placement.region_timing import SAMPLE_ROUND_TRIP_MS
    from hybridgen.placement.tuning_profile import RegionProfile

    path = checkpoint("llama3")
    forced = RegionProfile("cpu", None, {"cpu_ms": 0.1, "gpu_ms": 0.5})
    monkeypatch.setattr(startup, "profile_kv_codec", lambda warm, runs: forced)
    yaml = {"model": {"name_or_path": str(path), "max_model_len": 256}}
    config = parse_config({**yaml, "kv_cache": {"warm_region_mb": 2}}).engine_config("cpu")
    engine = Engine(dataclasses.replace(config, measure_regions=True))
    rows = {r.name: r for r in engine_regions(engine)}
    sample = rows["sample"]
    assert sample.source == "measured" and sample.measured["round_trip_ms"] == SAMPLE_ROUND_TRIP_MS
    cpu_ms, gpu_ms = sample.measured["cpu_ms"], sample.measured["gpu_ms"]
    assert cpu_ms > 0 and gpu_ms > 0
    assert sample.placement == ("cpu" if cpu_ms + SAMPLE_ROUND_TRIP_MS < gpu_ms else "gpu")
    assert engine.degrade.sample_placement == sample.placement
    assert (rows["kv_codec"].placement, rows["kv_codec"].source) == ("cpu", "measured")
    assert engine.warm is not None and engine.warm.codec_on == "cpu"
    engine.release()

    pinned = parse_config(
        {**yaml, "kv_cache": {"warm_region_mb": 2}, "placements": {"sample": "cpu"}}
    ).engine_config("cpu")
    engine = Engine(dataclasses.replace(pinned, measure_regions=True))
    rows = {r.name: r for r in engine_regions(engine)}
    assert (rows["sample"].placement, rows["sample"].source) == ("cpu", "pinned")
    assert set(engine.measured) == {"kv_codec"}
    engine.release()
    # Off by default on a CPU-only engine: both sides would be the CPU.
    engine = Engine(config)
    assert engine.measured == {} and engine.warm is not None and engine.warm.codec_on == "gpu"
    engine.release()


@pytest.mark.slow
def test_moe_gate_placements_give_hf_tokens_and_are_measured(checkpoint) -> None:  # type: ignore[no-untyped-def]
    """placements.moe_gate: the router's pick on the CPU gives HF's greedy tokens as on the
    device; unpinned, it is timed both ways at start (asked for here: on by default on CUDA)."""
    import dataclasses

    from hybridgen.models.moe import moe_blocks
    from hybridgen.sampling.params import SamplingParams
    from tests.hf_reference import hf_greedy, sample_prompts

    path = checkpoint("mixtral")
    prompts = sample_prompts(path, 2, [11, 37])
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    expected = hf_greedy(path, prompts, 12)
    pinned = _engine(path, {"placements": {"moe_gate": "cpu"}})
    assert [c.token_ids for c in pinned.generate(prompts, greedy)] == expected
    rows = {r.name: r for r in engine_regions(pinned)}
    assert (rows["moe_gate"].placement, rows["moe_gate"].source) == ("cpu", "pinned")
    pinned.release()

    config = parse_config({"model": {"name_or_path": str(path), "max_model_len": 256}})
    measured = Engine(dataclasses.replace(config.engine_config("cpu"), measure_regions=True))
    gate = {r.name: r for r in engine_regions(measured)}["moe_gate"]
    assert gate.source == "measured" and gate.measured["cpu_ms"] > 0 and gate.measured["gpu_ms"] > 0
    assert gate.placement == ("cpu" if gate.measured["cpu_ms"] < gate.measured["gpu_ms"] else "gpu")
    assert {b.gate_on for b in moe_blocks(measured.loaded.model)} == {gate.placement}
    assert [c.token_ids for c in measured.generate(prompts, greedy)] == expected
    measured.release()
