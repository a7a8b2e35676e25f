"""The synthetic MoE presets (issue 6): Mixtral shapes with seeded random weights, whose
experts can be drawn straight into host memory in their stored format (Cold-Weights)."""

from __future__ import annotations

import pytest

from hybridgen.config.engine import EngineConfig
from hybridgen.engine.engine import Engine, load_configured
from hybridgen.engine.memory import BudgetTooSmall
from hybridgen.models.moe import SparseMoeBlock
from hybridgen.models.presets import preset_spec
from hybridgen.sampling.params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
PROMPTS = [[256, *range(40, 70)], [256, *range(300, 311)], [256, 65, 66]]


def _blocks(engine: Engine) -> list[SparseMoeBlock]:
    return [m for m in engine.loaded.model.modules() if isinstance(m, SparseMoeBlock)]


@pytest.mark.slow
def test_host_experts_are_the_same_model() -> None:
    """Native experts drawn into host memory are the very weights the resident build draws:
    the same greedy tokens, through both the CPU path and the device cache."""
    resident = Engine(EngineConfig(model="tiny-mixtral", device="cpu"))
    expected = [c.token_ids for c in resident.generate(PROMPTS, GREEDY)]
    cold = Engine(
        EngineConfig(
            model="tiny-mixtral", device="cpu", expert_cache_slots=6, expert_cpu_max_tokens=1
        )
    )
    assert [c.token_ids for c in cold.generate(PROMPTS, GREEDY)] == expected
    stats = cold.moe_stats()
    assert stats["cpu_experts"] > 0 and stats["gpu_experts"] > 0
    assert all(len(b.experts) == 0 and b.store is not None for b in _blocks(cold))


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quantized_experts_are_drawn_in_their_format(fmt: str) -> None:
    engine = Engine(
        EngineConfig(model="tiny-mixtral", device="cpu", expert_cache_slots=6, expert_format=fmt)  # type: ignore[arg-type]
    )
    spec = engine.spec
    native_bytes = 3 * spec.hidden_size * spec.intermediate_size * spec.dtype.itemsize
    for block in _blocks(engine):
        assert len(block.experts) == 0 and block.store is not None
        assert block.store.fmt == fmt
        ratio = native_bytes / block.store.expert_bytes
        assert ratio > {"int8": 3.8, "int4": 7.0}[fmt]  # against fp32 on the CPU
    got = engine.generate(PROMPTS, GREEDY)
    assert all(len(c.token_ids) == GREEDY.max_tokens for c in got)


def test_mixtral_presets_have_the_published_sizes() -> None:
    billions = {"mixtral-8x7b": 46.7, "mixtral-8x22b": 140.6}
    for name, size in billions.items():
        spec = preset_spec(name)
        assert spec.synthetic and spec.num_local_experts == 8 and spec.num_experts_per_tok == 2
        assert spec.num_parameters() / 1e9 == pytest.approx(size, rel=0.01)


@pytest.mark.slow
def test_auto_cache_takes_what_the_budget_leaves() -> None:
    """expert_cache_slots: auto sizes the cache from the budget: all 32 experts when they
    fit, fewer in a tight budget (the KV pool keeps its minimum), an error naming the key
    when not even one fits; the tokens stay the resident model's."""
    options = {"model": "tiny-mixtral", "device": "cpu", "max_model_len": 512}
    roomy = Engine(EngineConfig(**options, expert_cache_slots="auto"))  # type: ignore[arg-type]
    assert roomy.experts is not None and roomy.experts[0].capacity == 32
    tight = Engine(
        EngineConfig(**options, expert_cache_slots="auto", gpu_memory_mb=90)  # type: ignore[arg-type]
    )
    assert tight.experts is not None
    cache, plan = tight.experts[0], tight.plan
    assert 1 < cache.capacity < 32
    assert plan.num_blocks >= plan.min_blocks and plan.planned_peak <= plan.budget
    assert plan.kv_pool < cache.expert_bytes + plan.min_blocks * plan.block_bytes  # the rest
    resident = Engine(EngineConfig(**options))  # type: ignore[arg-type]
    expected = [c.token_ids for c in resident.generate(PROMPTS, GREEDY)]
    assert [c.token_ids for c in tight.generate(PROMPTS, GREEDY)] == expected
    with pytest.raises(BudgetTooSmall, match=r"expert_cache_slots=auto"):
        Engine(EngineConfig(**options, expert_cache_slots="auto", gpu_memory_mb=84))  # type: ignore[arg-type]


def test_host_tiers_must_fit_the_host_budget() -> None:
    """device_topology.cpu.memory_mb bounds the Warm and Cold tiers and the experts; a budget
    too small is an error naming the keys, before anything is allocated."""
    from hybridgen.config.file import parse_config

    too_small = parse_config(
        {
            "model": {"name_or_path": "tiny-mixtral", "max_model_len": 256},
            "device_topology": {"cpu": {"memory_mb": 64}},
            "kv_cache": {"warm_region_mb": 40},
            "cold_weights": {"expert_cache_slots": 4},
        }
    ).engine_config("cpu")
    with pytest.raises(BudgetTooSmall, match=r"device_topology\.cpu\.memory_mb=64 is too small"):
        Engine(too_small)
    fits = Engine(EngineConfig(**{**vars(too_small), "warm_pool_mb": 16}))  # type: ignore[arg-type]
    assert fits.warm is not None and fits.experts is not None
    fits.release()


def test_shared_memory_must_hold_the_pool_and_the_arena(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Warm pool and (under the daemons) the expert arena live in /dev/shm: when it is too
    small the engine says so at once, instead of dying of SIGBUS on the first write past it."""
    from hybridgen.engine import host_memory

    monkeypatch.setattr(host_memory, "shm_free_bytes", lambda: 8 * 2**20)
    config = EngineConfig(model="tiny-mixtral", device="cpu", warm_pool_mb=16)
    with pytest.raises(BudgetTooSmall, match=r"/dev/shm has 8 MiB free.*Warm pool \(16 MiB"):
        Engine(config)


@pytest.mark.slow
def test_a_loaded_models_arena_is_not_counted_twice(
    instance: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine given a loaded model (moe_bench skews its routers first) finds the arena
    already in /dev/shm: what is free there no longer includes it, so only the rest is
    checked (mixtral-8x22b's 72.5 GB arena was refused against the 55 GB left beside it)."""
    from hybridgen.engine import host_memory

    config = EngineConfig(
        model="tiny-mixtral",
        device="cpu",
        expert_cache_slots=4,
        expert_format="int4",
        shm_instance=instance,
    )
    loaded = load_configured(config)
    assert loaded.expert_arena is not None
    monkeypatch.setattr(host_memory, "shm_free_bytes", lambda: 2**20)  # less than the arena
    with pytest.raises(BudgetTooSmall, match="expert arena"):
        host_memory.check_host_budget(config, loaded.spec)
    engine = Engine(config, loaded)
    assert engine.experts is not None
    engine.release()
    loaded.expert_arena.close()


@pytest.mark.slow
def test_an_engine_that_fails_to_start_unlinks_its_expert_arena(instance: str) -> None:
    """The expert arena is made while loading; a budget too small for one expert then stops
    the engine, which must not leave the arena in /dev/shm."""
    from pathlib import Path

    config = EngineConfig(
        model="tiny-mixtral",
        device="cpu",
        gpu_memory_mb=64,
        expert_cache_slots="auto",
        expert_format="int4",
        shm_instance=instance,
    )
    with pytest.raises(BudgetTooSmall, match="not even one expert fits"):
        Engine(config)
    assert not list(Path("/dev/shm").glob(f"hybridgen-{instance}-*"))
