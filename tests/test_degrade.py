"""The degrade path in the engine: while engaged, tokens are picked on the CPU and the CPU
attends a larger share of the Warm blocks; the tokens stay HF's, and lifting it restores every
placement. tests/test_serving.py drives it through real backpressure between the daemons."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from hybridgen.config.file import ConfigError, parse_config
from hybridgen.engine.engine import Engine
from hybridgen.engine.info import engine_regions
from hybridgen.placement.degrade import DEGRADE_WARM_SHARE
from hybridgen.sampling.params import SamplingParams
from tests.engine_helpers import small_engine
from tests.hf_reference import hf_greedy, sample_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def _engine(path: Path, **options: object) -> Engine:
    return small_engine(path, **{"max_num_seqs": 2, **options})


@pytest.mark.slow
def test_degraded_engine_gives_the_same_tokens_and_restores(checkpoint) -> None:  # type: ignore[no-untyped-def]
    path = checkpoint("llama3")
    prompts = sample_prompts(path, 2, [150, 97])
    engine = _engine(
        path,
        num_kv_blocks=6,
        warm_pool_mb=2,
        warm_codec="lossless",
        attn_warm="gpu",
    )
    warm = engine.warm
    assert warm is not None and (warm.mode, warm.split) == ("gpu", 0.0)
    assert engine.degrade.set(True) and not engine.degrade.set(True)
    assert (warm.mode, warm.split) == ("split", DEGRADE_WARM_SHARE)
    rows = {r.name: r for r in engine_regions(engine)}
    assert (rows["sample"].placement, rows["sample"].source) == ("cpu", "degrade")
    assert (rows["attn_warm"].placement, rows["attn_warm"].source) == ("split:0.250", "degrade")
    tokens = [c.token_ids for c in engine.generate(prompts, GREEDY)]
    assert tokens == hf_greedy(path, prompts, 24)
    assert warm.stats.cpu.calls > 0  # the CPU attended its share
    info = engine.degrade.info()
    assert info["degraded"] and info["degrade_entries"] == 1
    assert info["degraded_steps"] == engine.stats.steps
    assert engine.degrade.set(False)
    assert (warm.mode, warm.split, engine.degrade.sample_placement) == ("gpu", 0.0, "gpu")
    engine.release()


def test_pure_gpu_never_degrades(checkpoint) -> None:  # type: ignore[no-untyped-def]
    engine = _engine(checkpoint("llama3"), mode="pure_gpu")
    assert not engine.degrade.set(True)
    assert engine.degrade.sample_placement == "gpu" and not engine.degrade.active
    engine.release()


def test_softmax_pinned_to_gpu_keeps_sampling_there(checkpoint) -> None:  # type: ignore[no-untyped-def]
    """placements.softmax: gpu: backpressure may still shift Warm attention, not sampling."""
    engine = _engine(checkpoint("llama3"), degrade_softmax="gpu")
    assert engine.degrade.set(True) and engine.degrade.sample_placement == "gpu"
    engine.release()


def test_placements_that_would_do_nothing_are_refused() -> None:
    for key, value, why in (
        ("rope", "cpu", "fused"),
        ("norm", "cpu", "fused"),
        ("moe_experts", "split", "no MoE model"),
    ):
        with pytest.raises(ConfigError, match=f"placements.{key}=.*out of range.*{why}"):
            parse_config({"placements": {key: value}})


def test_softmax_threshold_decides_where_the_degrade_softmax_goes(checkpoint) -> None:  # type: ignore[no-untyped-def]
    """offload_threshold.softmax: below it the degrade path moves sampling to the CPU, at or
    above it sampling stays on the device; a pinned placements.softmax beats the rule."""
    path = checkpoint("llama3")
    low = _engine(path)  # 2 rows x a small vocab: far below 12,000 MFLOPs
    work = low.degrade.softmax_mflops
    assert 0 < work < 12000 and low.degrade.set(True)
    assert low.degrade.sample_placement == "cpu"
    low.release()
    high = _engine(path, softmax_threshold_mflops=work)  # the work reaches the threshold
    assert high.degrade.set(True) and high.degrade.sample_placement == "gpu"
    row = {r.name: r for r in engine_regions(high)}["sample"]
    assert row.measured["degrade_softmax_mflops"] == work
    high.release()
    pinned = _engine(path, softmax_threshold_mflops=work, degrade_softmax="cpu")
    assert pinned.degrade.set(True) and pinned.degrade.sample_placement == "cpu"
    pinned.release()


def test_regions_measured_slower_on_the_cpu_stay_put(checkpoint) -> None:  # type: ignore[no-untyped-def]
    """A shift must pay: where the start-up timing found the CPU slower (sample placed on
    the device, attn_warm's probe placing the Warm blocks there), the degrade path leaves the
    region alone; a pinned placements.softmax: cpu still moves the pick."""
    from hybridgen.placement.degrade import Degrade

    engine = _engine(checkpoint("llama3"), num_kv_blocks=6, warm_pool_mb=2, attn_warm="gpu")
    warm, vocab = engine.warm, engine.spec.vocab_size
    assert warm is not None
    measured = Degrade(engine.config, warm, vocab, measured_warm=True)
    measured.place_sample("gpu")  # what the start-up timing does when the device is faster
    assert measured.set(True) and measured.active
    assert (measured.sample_placement, warm.mode, warm.split) == ("gpu", "gpu", 0.0)
    unmeasured = Degrade(engine.config, warm, vocab)
    assert unmeasured.set(True) and unmeasured.sample_placement == "cpu"
    assert (warm.mode, warm.split) == ("split", DEGRADE_WARM_SHARE)
    unmeasured.set(False)
    forced = Degrade(dataclasses.replace(engine.config, degrade_softmax="cpu"), None, vocab)
    forced.place_sample("gpu")
    assert forced.set(True) and forced.sample_placement == "cpu"
    engine.release()
