"""The start-up memory plan reserves the worst step at the configured limits (a full prefill
chunk attending max_model_len keys, the sampler, the graphs), and a budget that cannot hold
it is refused before anything serves, with a message naming the keys to change."""

from __future__ import annotations

import pytest
import torch

from hybridgen.config.engine import EngineConfig
from hybridgen.engine.engine import Engine
from hybridgen.engine.memory import BudgetTooSmall, workspace_bytes
from hybridgen.models.presets import preset_spec


def test_long_context_prefill_that_cannot_fit_is_refused() -> None:
    """131,072 keys and a 1,024-token chunk: on the CPU the torch prefill gathers the whole
    context at the query head count, which a 160 MiB budget cannot hold."""
    config = EngineConfig(
        model="tiny-llama",
        device="cpu",
        gpu_memory_mb=160,
        max_model_len=131072,
        max_num_batched_tokens=1024,
        max_num_seqs=1,
        hot_codec="int4",
    )
    with pytest.raises(BudgetTooSmall) as err:
        Engine(config)
    message = str(err.value)
    keys = ("device_topology.gpu.memory_mb=160", "model.max_model_len", "model.max_num_batched")
    assert all(key in message for key in keys) and "worst step" in message


def test_in_place_prefill_does_not_grow_with_the_context() -> None:
    """With the Triton prefill (the cache read in place) the workspace of a chunk is the same
    at 4K and 128K keys but for the rope tables; the torch prefill's grows with the keys."""
    spec = preset_spec("llama3-8b")
    dtype = torch.bfloat16

    def work(keys: int, in_place: bool) -> int:
        return workspace_bytes(spec, dtype, 1024, 1, keys, 0, None, True, False, in_place)

    rope = 2 * (131072 - 4096) * spec.head_dim * 4 * 1.25
    assert work(131072, True) - work(4096, True) == pytest.approx(rope, abs=1)
    assert work(131072, False) - work(4096, False) > 2 * 127 * 1024 * spec.q_size * 2


def test_plan_counts_what_loading_left_held(monkeypatch: pytest.MonkeyPatch) -> None:
    """Device memory the allocator still holds after loading (on CUDA: segments pinned by the
    int4 weights quantized on the device; the B1 int4 engine_bench asked for a 34.6 GiB KV
    pool in a 40 GiB budget that 6.2 GiB already held) counts as weights, so the KV pool
    leaves the workspace its room. The CPU holds nothing: the held figure is injected."""
    from hybridgen.engine import engine as engine_module

    config = EngineConfig(
        model="tiny-llama",
        device="cpu",
        gpu_memory_mb=512,
        max_model_len=2048,
        weights_format="int4",
        max_num_seqs=1,
    )
    plain = Engine(config).plan
    extra = 8 << 20
    held = iter([0, plain.weights + extra])  # before loading, then after
    monkeypatch.setattr(engine_module, "_reserved_elsewhere", lambda device: next(held))
    plan = Engine(config).plan
    assert plan.weights == plain.weights + extra and plan.workspace == plain.workspace
    assert plan.kv_pool <= plain.kv_pool - extra
    assert plan.weights + plan.workspace + plan.kv_pool <= plan.budget


def test_auto_expert_cache_leaves_room_for_what_loading_left_held(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """expert_cache_slots: auto sizes the cache with the allocator's held bytes counted as
    the final plan counts them: with F bytes held beyond the weights (segments int4 dense
    weights pin on CUDA) the cache takes F fewer bytes and the engine starts; sized from the
    weights alone it took them, and the final plan found too few KV blocks for one sequence
    (B4a with weights.format int4 on the H200). The CPU holds nothing: F is injected."""
    from hybridgen.engine import engine as engine_module
    from hybridgen.engine.memory import weights_bytes

    config = EngineConfig(
        model="tiny-mixtral",
        device="cpu",
        gpu_memory_mb=128,
        max_model_len=256,
        max_num_seqs=1,
        expert_cache_slots="auto",
        expert_format="int4",
    )
    plain = Engine(config)
    cache = plain.experts[0] if plain.experts is not None else None
    assert cache is not None
    plan, slots, slot = plain.plan, cache.capacity, cache.expert_bytes
    leftover = plan.budget - plan.weights - plan.workspace - plan.min_blocks * plan.block_bytes
    plain.release()
    fragments = leftover + (slots - 4) * slot  # held beyond the weights: room for 3 more
    loaded: list[object] = []
    real_load = engine_module.load_configured

    def load(config: EngineConfig) -> object:
        loaded.append(real_load(config))
        return loaded[-1]

    def held(device: torch.device) -> int:  # nothing before loading, then weights + F
        return fragments + weights_bytes(loaded[-1].model) if loaded else 0  # type: ignore[attr-defined]

    monkeypatch.setattr(engine_module, "load_configured", load)
    monkeypatch.setattr(engine_module, "_reserved_elsewhere", held)
    engine = Engine(config)
    assert engine.experts is not None and engine.experts[0].capacity == 4
    assert engine.plan.weights + engine.plan.workspace + engine.plan.kv_pool <= engine.plan.budget
    engine.release()
