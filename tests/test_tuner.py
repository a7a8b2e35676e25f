"""Dynamic tuning: attn_warm's split re-balanced from live timings while serving, with the
tokens unchanged and the tuner's own cost under 3 % of the wall time."""

from __future__ import annotations

import pytest

from hybridgen.config.file import parse_config
from hybridgen.engine.info import engine_regions
from hybridgen.placement.tuner import MAX_OVERHEAD, Tuner
from hybridgen.sampling.params import SamplingParams
from tests.engine_helpers import small_engine
from tests.hf_reference import hf_greedy, sample_prompts


class _Owner:
    mode, split = "split", 0.5


def test_share_balances_the_measured_costs() -> None:
    owner = _Owner()
    tuner = Tuner(owner, warmup_steps=0, interval_ms=0)
    tuner.timing.cpu_s, tuner.timing.cpu_blocks = 0.030, 10  # 3 ms a block on the CPU
    tuner.timing.gpu_s, tuner.timing.gpu_blocks = 0.010, 10  # 1 ms a block on the device
    tuner.on_step(1)
    assert owner.split == pytest.approx(0.25)  # 0.25 * 3 == 0.75 * 1: both finish together
    assert tuner.updates == 1
    tuner.on_step(2)  # nothing timed since: no change
    assert (owner.split, tuner.updates) == (pytest.approx(0.25), 1)


@pytest.mark.slow
def test_engine_tunes_while_serving(checkpoint) -> None:  # type: ignore[no-untyped-def]
    path = checkpoint("llama3")
    prompts = sample_prompts(path, 2, [150, 97])
    engine = small_engine(
        path,
        max_num_seqs=2,
        num_kv_blocks=6,
        warm_pool_mb=2,
        attn_warm="split",
        dynamic_tuning=True,
        tuning_warmup_steps=2,
        tuning_interval_ms=1,
    )
    warm = engine.warm
    assert warm is not None and warm.tuner is not None and warm.split == 0.5
    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    assert [c.token_ids for c in engine.generate(prompts, greedy)] == hf_greedy(path, prompts, 32)
    assert warm.tuner.updates >= 1 and warm.split != 0.5 and 0.0 < warm.split < 1.0
    assert warm.tuner.overhead() < MAX_OVERHEAD
    row = {r.name: r for r in engine_regions(engine)}["attn_warm"]
    assert row.source == "tuned" and row.measured["tuned_updates"] == warm.tuner.updates
    engine.release()


def test_config_turns_tuning_on_unless_a_profile_or_pure_gpu() -> None:
    assert parse_config({}).engine_config("cpu").dynamic_tuning
    off = parse_config({"dynamic_tuning": {"enable": False}}).engine_config("cpu")
    assert not off.dynamic_tuning
    assert not parse_config({"mode": "pure_gpu"}).engine_config("cpu").dynamic_tuning
