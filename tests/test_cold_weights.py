"""Cold-Weights (issue 6, exact mode): MoE experts in host memory, each routed expert computed
on the CPU or fetched into a device cache, with the same greedy tokens as HF transformers.

CPU, fp32, the tiny Mixtral checkpoint (2 layers of 4 experts, top-2): a cache of 4 slots
holds half of the model's 8 (layer, expert) pairs.
"""

from __future__ import annotations

import itertools
import time
from pathlib import Path

import pytest
import torch

from hybridgen.config.engine import ConfigError, EngineConfig
from hybridgen.engine.engine import Engine
from hybridgen.engine.info import engine_regions
from hybridgen.experts.format import host_alloc
from hybridgen.experts.latency import LatencyModel
from hybridgen.experts.store import ExpertCache, ExpertStore, MoeStats
from hybridgen.models.loader import load_model
from hybridgen.models.moe import SparseMoeBlock, enable_cold_weights
from hybridgen.sampling.params import SamplingParams
from tests.hf_reference import hf_greedy, sample_prompts

NEW_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
SLOTS = 4


def _prompts(path: Path) -> list[list[int]]:
    return sample_prompts(path, 3, [7, 29, 83])


def _blocks(engine: Engine) -> list[SparseMoeBlock]:
    return [m for m in engine.loaded.model.modules() if isinstance(m, SparseMoeBlock)]


@pytest.mark.slow
def test_cold_weights_greedy_matches_hf_on_both_paths(checkpoint) -> None:  # type: ignore[no-untyped-def]
    """Batched prefill (several tokens per expert: fetched into the cache) and batched decode
    (often one token per expert: computed on the CPU) give HF's greedy tokens exactly."""
    path = checkpoint("mixtral")
    prompts = _prompts(path)
    config = EngineConfig(
        model=str(path), device="cpu", expert_cache_slots=SLOTS, expert_cpu_max_tokens=1
    )
    engine = Engine(config)
    got = engine.generate(prompts, GREEDY)
    assert [c.token_ids for c in got] == hf_greedy(path, prompts, NEW_TOKENS)

    stats = engine.moe_stats()
    assert stats["cpu_experts"] > 0 and stats["gpu_experts"] > 0
    assert stats["cache_misses"] > 0 and stats["cache_hits"] > 0
    assert stats["gpu_experts"] == stats["cache_hits"] + stats["cache_misses"]
    assert engine.experts is not None
    cache, _ = engine.experts
    spec = engine.spec
    expert_bytes = 3 * spec.hidden_size * spec.intermediate_size * 4  # gate, up, down in fp32
    assert cache.expert_bytes == expert_bytes
    assert stats["bytes_h2d"] == stats["cache_misses"] * expert_bytes
    assert 0 < stats["cache_hit_rate"] < 1

    # The experts are no device parameters any more: only the cache is planned for them.
    assert all(b.store is not None and len(b.experts) == 0 for b in _blocks(engine))
    dense = Engine(EngineConfig(model=str(path), device="cpu"))
    all_experts = spec.num_layers * spec.num_local_experts * expert_bytes
    assert dense.plan.weights - engine.plan.weights == all_experts - SLOTS * expert_bytes

    row = next(r for r in engine_regions(engine) if r.name == "moe_experts")
    assert (row.label, row.placement, row.measured["cpu_max_tokens"]) == (
        "hybrid-aware",
        "cpu+cache",
        1,
    )
    assert row.measured["overlapped"] == 0.0  # in-process: no CPU daemon beside the device


@pytest.mark.slow
def test_without_cold_weights_nothing_changes(checkpoint) -> None:  # type: ignore[no-untyped-def]
    path = checkpoint("mixtral")
    prompts = _prompts(path)[:2]
    engine = Engine(EngineConfig(model=str(path), device="cpu"))
    got = engine.generate(prompts, GREEDY)
    assert [c.token_ids for c in got] == hf_greedy(path, prompts, NEW_TOKENS)
    assert engine.experts is None
    assert all(v == 0 for v in engine.moe_stats().values())
    assert all(b.store is None and len(b.experts) == 4 for b in _blocks(engine))
    row = next(r for r in engine_regions(engine) if r.name == "moe_experts")
    assert row.placement == "gpu"


@pytest.mark.slow
@pytest.mark.parametrize("crossover", ["cache", "mixed", "cpu", "timed"])
def test_cold_block_equals_resident_block(checkpoint, crossover: str) -> None:  # type: ignore[no-untyped-def]
    """The MoE block gives the same output, bit for bit on the CPU, with its experts resident
    and with them in host memory: all through the cache, mixed (the least-routed expert of
    each layer on the CPU), all on the CPU, or as the timed latency model says."""
    path = checkpoint("mixtral")
    resident = load_model(str(path), torch.device("cpu"), torch.float32).model
    cold = load_model(str(path), torch.device("cpu"), torch.float32, host_experts="native").model
    blocks = [layer.mlp for layer in cold.layers]
    assert all(isinstance(b, SparseMoeBlock) for b in blocks)
    x = torch.randn(24, cold.spec.hidden_size, generator=torch.Generator().manual_seed(0))
    fewest = min(int(torch.bincount(b.route(x)[0].flatten()).min()) for b in blocks)
    with torch.no_grad():  # host experts without a cache yet: all on the CPU
        assert torch.equal(blocks[0](x), resident.layers[0].mlp(x))
    limit = {"cache": 0, "mixed": fewest, "cpu": 1000, "timed": None}[crossover]
    cache, latency = enable_cold_weights(blocks, 2, limit, torch.device("cpu"))  # type: ignore[arg-type]
    if crossover == "timed":  # CPU time per token, and the 25 GB/s fallback without CUDA
        assert latency.cpu_s(1) > 0 and latency.pcie_bytes_per_s == 25e9
    with torch.no_grad():
        for mine, theirs in zip(blocks, resident.layers, strict=True):
            assert torch.equal(mine(x), theirs.mlp(x))
    s = cache.stats
    assert s.cpu_experts + s.gpu_experts == 8  # every expert of both layers is routed to
    if crossover == "cache":
        assert s.gpu_experts == 8
    if crossover == "mixed":
        assert s.cpu_experts > 0 and s.gpu_experts > 0
    if crossover == "cpu":
        assert s.cpu_experts == 8 and s.bytes_h2d == 0


def _store(experts: int = 4) -> ExpertStore:
    g = torch.Generator().manual_seed(1)
    return ExpertStore.from_dense(
        torch.randn(experts, 6, 3, generator=g),
        torch.randn(experts, 3, 3, generator=g),
        "native",
        host_alloc(False),
    )


def test_cache_keeps_the_most_routed_experts() -> None:
    """Three slots: two cached, one scratch. A miss displaces the least routed cached expert
    (the oldest among equals) only when it is routed to more often; else it goes through the
    scratch slot. Every slot it is read from holds its weights."""
    store = _store()
    stats = MoeStats()
    cache = ExpertCache(3, store, torch.device("cpu"), stats)
    assert cache.scratch == (2,)

    def route(layer: int, expert: int, tokens: int = 1) -> int:
        stats.count_routed(layer, [(expert, tokens)])
        slot = cache.fetch(layer, expert, store)
        assert torch.equal(cache.gate_up.matrix(slot), store.gate_up.matrix(expert))
        assert torch.equal(cache.down.matrix(slot), store.down.matrix(expert))
        return slot

    assert {route(0, 0, 5), route(0, 1)} == {0, 1}  # free slots first
    assert route(0, 2) == cache.scratch[0]  # routed once, as often as (0, 1): not admitted
    assert (0, 2) not in cache and (0, 1) in cache
    assert route(0, 2) != cache.scratch[0]  # twice now: displaces (0, 1), routed once
    assert (0, 1) not in cache and (0, 0) in cache and (0, 2) in cache
    route(1, 0, 3)  # 3 tokens: more than (0, 2)'s 2, fewer than (0, 0)'s 5
    assert (1, 0) in cache and (0, 2) not in cache and (0, 0) in cache
    s = cache.stats
    assert (s.cache_hits, s.cache_misses) == (0, 5)
    assert s.bytes_h2d == 5 * store.expert_bytes == 5 * (18 + 9) * 4
    route(0, 0)
    assert s.cache_hits == 1
    one = ExpertCache(1, store, torch.device("cpu"), MoeStats())  # no scratch: always admits
    one.fetch(0, 1, store)
    one.fetch(0, 2, store)
    assert (0, 2) in one and (0, 1) not in one and one.scratch == ()


class _Scan:
    """The cache's choices made by a scan of every cached expert (the least routed, the least
    recently used among equals), leaving out the slots a step keeps."""

    def __init__(self, stats: MoeStats, cacheable: int, scratch: tuple[int, ...]) -> None:
        self.stats, self.cacheable, self.scratch = stats, cacheable, scratch
        self.cached: dict[tuple[int, int], int] = {}  # key -> slot, in use order
        self.evictions = 0
        self.kept_out = 0  # misses whose victim would have been a kept slot

    def fetch(
        self, key: tuple[int, int], keep: frozenset[int] | set[int] = frozenset()
    ) -> int | None:
        if key in self.cached:
            self.cached[key] = self.cached.pop(key)
            return self.cached[key]
        if len(self.cached) < self.cacheable:
            slot = self.cached[key] = len(self.cached)
            return slot
        uses = self.stats.routed.get
        free = [k for k in self.cached if self.cached[k] not in keep]
        victim = min(free, key=lambda k: uses(k, 0)) if free else None
        self.kept_out += victim != min(self.cached, key=lambda k: uses(k, 0))
        if victim is not None and uses(key, 0) > uses(victim, 0):
            self.cached[key] = self.cached.pop(victim)
            self.evictions += 1
            return self.cached[key]
        return next((s for s in self.scratch if s not in keep), None)


def test_cache_victims_match_a_scan_of_every_slot() -> None:
    """The cache picks its victim from a heap; on a random trace of routings, hits and
    misses every fetch returns the slot that a scan of all cached experts (the least routed,
    the least recently used among equals) would give, and the same experts stay cached."""
    layers, experts, slots = 4, 16, 9
    store = _store(experts)
    stats = MoeStats()
    cache = ExpertCache(slots, store, torch.device("cpu"), stats)
    scan = _Scan(stats, slots - 1, (slots - 1,))
    gen = torch.Generator().manual_seed(11)
    for _ in range(600):
        layer = int(torch.randint(layers, (1,), generator=gen))
        pick = torch.randperm(experts, generator=gen)[:3].tolist()
        tokens = torch.randint(1, 4, (3,), generator=gen).tolist()
        stats.count_routed(layer, list(zip(pick, tokens, strict=True)))
        for e in sorted(pick):
            assert cache.fetch(layer, e, store) == scan.fetch((layer, e))
            assert all(k in cache for k in scan.cached)
    assert scan.evictions > 50  # the trace evicts often enough to test the choice


@pytest.mark.parametrize(
    ("experts", "slots", "scratch", "picks"),
    [(16, 7, (6,), 5), (32, 40, (38, 39), 8)],  # 40 slots keep 2 of 3 (SCRATCH_SHARE)
)
def test_a_steps_misses_take_no_slot_the_step_reads(
    experts: int, slots: int, scratch: tuple[int, ...], picks: int
) -> None:
    """fetch_beside, as combine's grouped launch uses it (hits first, then the misses, each
    keeping the slots taken so far): on a random trace every fetch gives what a scan gives
    when the kept slots are left out (the least routed victim not kept, the scratch slots
    once each a step, None after), no slot serves two experts of a step, and every slot read
    holds its expert's weights. The small cache's trace often finds its victim kept."""
    layers = 3
    store = _store(experts)
    stats = MoeStats()
    cache = ExpertCache(slots, store, torch.device("cpu"), stats, scratch_slots=3)
    assert cache.scratch == scratch
    scan = _Scan(stats, slots - len(scratch), scratch)
    gen = torch.Generator().manual_seed(5)
    nones = 0
    for _ in range(400):
        layer = int(torch.randint(layers, (1,), generator=gen))
        pick = torch.randperm(experts, generator=gen)[:picks].tolist()
        tokens = torch.randint(1, 4, (picks,), generator=gen).tolist()
        stats.count_routed(layer, list(zip(pick, tokens, strict=True)))
        keep: set[int] = set()
        for e in sorted(pick, key=lambda e: (layer, e) not in scan.cached):
            want = scan.fetch((layer, e), keep)
            got = cache.fetch_beside(layer, e, store, keep)
            assert got == want
            if got is None:
                nones += 1
                continue
            assert got not in keep
            keep.add(got)
            for name, part in cache.gate_up.parts.items():
                assert torch.equal(part[got], store.gate_up.parts[name][e])
    assert scan.evictions > 30 and nones > 30  # the trace reaches both choices often
    assert scan.kept_out > (30 if slots < 16 else 0)


@pytest.mark.slow
@pytest.mark.parametrize(("slots", "skew", "least"), [(64, 0.0, 0.12), (128, 0.9, 0.9)])
def test_cache_hit_rate_when_a_tokens_experts_outnumber_the_slots(
    slots: int, skew: float, least: float
) -> None:
    """mixtral-8x22b's shape at batch 1 (56 layers of 8 experts, top 2, B4's 64 slots): with
    uniform routing an LRU cache hits nothing (0.000 on this trace), this one about
    (slots - 1) / 448 of the time (0.140); with two experts favoured 90 % of the time in each
    layer it keeps them (0.924, LRU 0.875)."""
    layers, experts = 56, 8
    store = _store(experts)
    stats = MoeStats()
    cache = ExpertCache(slots, store, torch.device("cpu"), stats)
    gen = torch.Generator().manual_seed(3)
    for token in range(300):
        if token == 100:
            stats.cache_hits = stats.cache_misses = 0
        for layer in range(layers):
            hot = torch.rand(1, generator=gen).item() < skew
            pick = (
                [layer % experts, (layer + 1) % experts]
                if hot
                else (torch.randperm(experts, generator=gen)[:2].tolist())
            )
            stats.count_routed(layer, [(e, 1) for e in pick])
            for e in sorted(pick):
                cache.fetch(layer, e, store)
    rate = stats.cache_hits / (stats.cache_hits + stats.cache_misses)
    assert rate >= least, rate


def test_latency_model_crossover() -> None:
    """cpu_s(t) = fixed + t * per_token against fetch_s + gpu_s = bytes / bandwidth + one call."""
    model = LatencyModel(
        cpu_fixed_s=2e-6,
        cpu_s_per_token=1e-6,
        pcie_bytes_per_s=1e9,
        expert_bytes=4500,
        gpu_s=0.4e-6,
    )
    assert model.fetch_s == pytest.approx(4.5e-6)
    assert model.cpu_max_tokens == 2  # 2 + 2 = 4 us < 4.9 us; 2 + 3 = 5 us is not
    assert model.cpu_s(3) == pytest.approx(5e-6)
    assert LatencyModel(1e-3, 1e-6, 1e9, 10).cpu_max_tokens == 0  # reading alone loses
    assert LatencyModel(0.0, 0.0, 1e9, 10).cpu_max_tokens == 2**31 - 1  # free CPU
    assert LatencyModel(0.0, 1e-6, 1e9, 4500, max_cpu_tokens_override=7).cpu_max_tokens == 7


def test_overlapped_cpu_takes_the_experts_that_end_the_layer_sooner() -> None:
    """A CPU 0.5 ms slower than a fetch plus a call (2.5 against 2.0 ms): taken alone, every
    miss is fetched; beside the device, one of two misses goes to the CPU (the layer ends at
    2.5 ms instead of 4.0), and two of four (5.0 ms instead of 8.0)."""
    model = LatencyModel(
        cpu_fixed_s=2.5e-3,
        cpu_s_per_token=0.0,
        pcie_bytes_per_s=1e9,
        expert_bytes=2_000_000,
        gpu_s=0.0,
    )
    assert model.cpu_experts(0, [(3, 1), (5, 1)], overlap=False) == set()
    assert len(model.cpu_experts(0, [(3, 1), (5, 1)], overlap=True)) == 1
    assert len(model.cpu_experts(0, [(e, 1) for e in range(4)], overlap=True)) == 2
    # Two cached experts keep the device busy: a lone miss is cheaper on the CPU.
    busy = LatencyModel(2.5e-3, 0.0, 1e9, 2_000_000, gpu_s=0.4e-3)  # alone: 2.5 > 2.4 ms
    assert busy.cpu_experts(2, [(7, 1)], overlap=True) == {7}
    assert busy.cpu_experts(0, [(7, 1)], overlap=True) == set()
    # Fewest tokens first: the CPU's cost grows with tokens, a fetch's does not.
    per_token = LatencyModel(0.5e-3, 1e-3, 1e9, 2_000_000)
    assert per_token.cpu_experts(0, [(1, 9), (2, 1)], overlap=True) == {2}
    # A pinned crossover stays the rule.
    pinned = LatencyModel(1.0, 0.0, 1e9, 10, max_cpu_tokens_override=1)
    assert pinned.cpu_experts(0, [(1, 1), (2, 2)], overlap=True) == {1}


def test_observed_cpu_times_move_the_placement() -> None:
    """The B4 case on the H200 at 3af1b80 (bench/results/moe_step_profile_h200.json): timed
    idle at start a CPU expert (1.5 ms) beats a fetch plus a call (2.0 ms), but served beside
    the engine it took 2.35 ms. Observations pull cpu_scale toward what the CPU really takes
    (one outlier counts at most CPU_SCALE_LIMIT), and a lone miss beside a cached expert is
    then fetched; of two misses one still goes to the CPU, which runs beside the device."""
    from hybridgen.experts.latency import CPU_SCALE_LIMIT

    model = LatencyModel(0.9e-3, 0.6e-3, 1e9, 1_830_000, gpu_s=0.17e-3)
    assert model.cpu_experts(1, [(4, 1)], overlap=True) == {4}
    assert model.cpu_max_tokens == 1
    for _ in range(40):
        model.observe_cpu(2, 2, 2 * 2.35e-3)  # two experts of one token each, 2.35 ms apiece
    assert model.cpu_scale == pytest.approx(2.35 / 1.5, rel=0.02)
    assert model.cpu_s(1) == pytest.approx(2.35e-3, rel=0.02)
    assert model.cpu_experts(1, [(4, 1)], overlap=True) == set()
    assert len(model.cpu_experts(0, [(4, 1), (6, 1)], overlap=True)) == 1
    assert model.cpu_max_tokens == 0 and model.figures()["cpu_scale"] == model.cpu_scale
    model.observe_cpu(1, 1, 10.0)  # a stall
    assert model.cpu_scale < 2.35 / 1.5 + 0.1 * CPU_SCALE_LIMIT


def test_served_cpu_experts_are_observed(checkpoint) -> None:  # type: ignore[no-untyped-def]
    """The engine's own CPU experts feed the latency model, and each step's routing is
    counted per (layer, expert)."""
    path = checkpoint("mixtral")
    config = EngineConfig(
        model=str(path), device="cpu", expert_cache_slots=SLOTS, expert_cpu_max_tokens=1
    )
    engine = Engine(config)
    assert engine.experts is not None
    latency = engine.experts[1]
    calls = []
    observe = latency.observe_cpu
    latency.observe_cpu = lambda *a: (calls.append(a), observe(*a))[1]  # type: ignore[method-assign]
    engine.generate(_prompts(path), GREEDY)
    stats = engine.moe_stats()
    cache = engine.experts[0]
    engine.release()
    assert len(calls) == stats["cpu_experts"] and all(c[2] > 0 for c in calls)
    routed = cache.stats.routed
    spec = engine.spec
    assert {layer for layer, _ in routed} == set(range(spec.num_layers))
    assert 2 / spec.num_local_experts <= stats["top2_share"] <= 1.0
    prompt_tokens = sum(len(p) for p in _prompts(path))
    per_layer = (prompt_tokens + 3 * (NEW_TOKENS - 1)) * spec.num_experts_per_tok
    assert sum(t for (layer, _), t in routed.items() if layer == 0) == per_layer


def test_moe_counters_start_with_the_first_served_step(
    checkpoint, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    """What the start-up runs through the model (on CUDA a profiling prefill of one token
    repeated, which routes everything to two experts) is not counted as served."""
    path = checkpoint("mixtral")
    place = Engine._place
    prefilled = []

    def start_up_prefill(engine: Engine, measured):  # type: ignore[no-untyped-def]
        place(engine, measured)
        if hasattr(engine, "degrade"):  # the last start-up placement: the engine can step
            engine.prompt_logits([0] * 40)
            assert engine.moe_stats()["gpu_experts"] > 0  # it was counted until start-up ended
            prefilled.append(True)

    monkeypatch.setattr(Engine, "_place", start_up_prefill)
    config = EngineConfig(model=str(path), device="cpu", expert_cache_slots=SLOTS)
    engine = Engine(config)
    assert prefilled
    stats = engine.moe_stats()
    assert engine.experts is not None and not engine.experts[0].stats.routed
    assert stats["gpu_experts"] == stats["cpu_experts"] == stats["bytes_h2d"] == 0
    engine.generate(_prompts(path)[:1], GREEDY)
    assert engine.moe_stats()["gpu_experts"] > 0
    engine.release()


def test_a_stalled_cpu_timing_is_taken_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """One token timed slower than sixteen is a stall, not the CPU's speed: both are timed
    again (up to CALIBRATION_ATTEMPTS), so the model does not keep the CPU out for good."""
    from hybridgen.experts import latency as expert_latency

    timings = iter([12e-3, 10.9e-3, 1.5e-3, 10.9e-3])  # 1 token, 16 tokens, then again
    monkeypatch.setattr(expert_latency, "best_of", lambda runs, fn, device: next(timings))
    store = _store()
    cache = ExpertCache(2, store, torch.device("cpu"), MoeStats())
    model = expert_latency.calibrate(store, cache, torch.device("cpu"), None, None, 1.0)
    assert model.cpu_s_per_token == pytest.approx(9.4e-3 / 15)
    assert model.cpu_s(1) == pytest.approx(1.5e-3)
    stalled = iter([12e-3, 10.9e-3] * expert_latency.CALIBRATION_ATTEMPTS)
    monkeypatch.setattr(expert_latency, "best_of", lambda runs, fn, device: next(stalled))
    kept = expert_latency.calibrate(store, cache, torch.device("cpu"), None, None, 1.0)
    assert kept.cpu_s_per_token == 0 and kept.cpu_s(1) == pytest.approx(12e-3)  # the last


def test_calibration_is_affine_and_takes_configured_bandwidths() -> None:
    """The CPU is timed at 1 and 16 tokens (a fixed read plus a cost per token); a configured
    host or device bandwidth replaces the measured weight-read time."""
    from hybridgen.experts.latency import calibrate

    store = _store()
    cache = ExpertCache(2, store, torch.device("cpu"), MoeStats())
    measured = calibrate(store, cache, torch.device("cpu"), None)
    assert measured.cpu_fixed_s >= 0 and measured.cpu_s_per_token >= 0 and measured.gpu_s > 0
    assert measured.pcie_bytes_per_s == 25e9 and cache.stats.cache_misses == 0
    given = calibrate(store, cache, torch.device("cpu"), None, 1.0, 2.0)
    assert given.cpu_fixed_s == pytest.approx(store.expert_bytes / 1e9)
    assert given.gpu_s == pytest.approx(store.expert_bytes / 2e9)  # read once, as stored


def test_calibration_times_the_cpu_at_the_cpu_daemons_threads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under the daemons the CPU daemon's pool (one thread per core it holds, fewer than this
    process's) computes the CPU's experts: the calibration times them at that count, then
    gives this process its own pool back."""
    from hybridgen.experts import latency as expert_latency

    store = _store()
    cache = ExpertCache(2, store, torch.device("cpu"), MoeStats())
    seen: list[int] = []
    run_cpu = store.run_cpu

    def counted(expert: int, x: torch.Tensor) -> torch.Tensor:
        seen.append(torch.get_num_threads())
        return run_cpu(expert, x)

    monkeypatch.setattr(store, "run_cpu", counted)
    before = torch.get_num_threads()
    expert_latency.calibrate(store, cache, torch.device("cpu"), None, cpu_threads=1)
    assert seen and set(seen) == {1}
    assert torch.get_num_threads() == before
    seen.clear()
    expert_latency.calibrate(store, cache, torch.device("cpu"), None)
    assert set(seen) == {before}


@pytest.mark.parametrize("overlap", [True, False])
def test_a_cpu_kept_out_is_tried_again(overlap: bool) -> None:
    """cpu_scale learns only from the CPU's own experts. Timed at 4x what it takes (a start-up
    beside other work, a few slow early experts), the CPU gets no miss; every EXPLORE_LAYERS
    layers with misses and none on the CPU, the fewest-token miss goes there anyway, and
    what it really takes is learned until the CPU takes its share again. A miss-free layer
    does not count, nor does a pinned crossover ever explore."""
    from hybridgen.experts import latency as expert_latency

    model = LatencyModel(6e-3, 0.0, 1e9, 2_000_000, gpu_s=0.4e-3)  # timed 6 ms, device 2.4
    assert model.cpu_experts(0, [(3, 1)], overlap) == set()
    explored = []
    for layer in range(20 * expert_latency.EXPLORE_LAYERS):
        model.cpu_experts(2, [], overlap)  # no misses: not counted
        picked = model.cpu_experts(0, [(3, 2), (5, 1)], overlap)
        if picked:
            explored.append(layer)
            model.observe_cpu(1, 1, 1.5e-3)  # it really takes 1.5 ms
    gaps = {b - a for a, b in itertools.pairwise(explored)}
    assert expert_latency.EXPLORE_LAYERS in gaps, explored
    assert model.cpu_experts(0, [(3, 1)], overlap) == {3}, "learned: the CPU's share again"
    assert model.cpu_scale < 2.4 / 6
    pinned = LatencyModel(6e-3, 0.0, 1e9, 2_000_000, max_cpu_tokens_override=0)
    for _ in range(3 * expert_latency.EXPLORE_LAYERS):
        assert pinned.cpu_experts(0, [(3, 1)], overlap) == set()


def test_bad_cold_weights_config_names_the_key() -> None:
    with pytest.raises(ConfigError, match="expert_cache_slots"):
        EngineConfig(expert_cache_slots=0)
    with pytest.raises(ConfigError, match="expert_cpu_max_tokens"):
        EngineConfig(expert_cpu_max_tokens=-1)


def test_a_slow_round_trip_sends_the_miss_to_the_device() -> None:
    """A CPU a little faster than a fetch plus a call (2.5 against 2.4 ms beside two cached
    experts) takes a lone miss while EXPERT_RUN costs nothing beyond its compute; once the
    round trip is seen to add 2 ms (the rings, the wake-ups), the miss is fetched."""
    model = LatencyModel(2.5e-3, 0.0, 1e9, 2_000_000, gpu_s=0.4e-3)
    assert model.cpu_experts(2, [(7, 1)], overlap=True) == {7}
    for _ in range(60):
        model.observe_remote(2e-3)
    assert model.remote_s == pytest.approx(2e-3, rel=0.01)
    assert model.cpu_experts(2, [(7, 1)], overlap=True) == set()
    assert model.figures()["remote_us"] == pytest.approx(2e3, rel=0.01)


class _SlowDaemon:
    """A CPU daemon whose EXPERT_RUN answer is written `delay_s` late beyond `compute_s` of
    work, and read `late_s` after that (the GPU daemon busy launching the device's experts)."""

    def __init__(self, store: ExpertStore, compute_s: float, delay_s: float, late_s: float):
        self.store, self.compute_s, self.delay_s, self.late_s = store, compute_s, delay_s, late_s
        self.cpu_s = self.answered_at = 0.0

    def submit(self, layer: int, jobs: list[tuple[int, torch.Tensor]]) -> int:
        self.answered_at = time.monotonic() + self.compute_s + self.delay_s
        return 1

    def wait(self, seq: int, jobs: list[tuple[int, torch.Tensor]]) -> list[torch.Tensor]:
        time.sleep(max(self.answered_at + self.late_s - time.monotonic(), 0.0))
        self.cpu_s += self.compute_s
        return [self.store.run_cpu(e, x) for e, x in jobs]


def test_the_daemons_round_trip_is_measured_apart_from_its_compute(checkpoint) -> None:  # type: ignore[no-untyped-def]
    """The MoE block hands its CPU experts to the CPU daemon: the daemon's reported compute
    time goes to cpu_scale, the rest of the time until the answer was written to remote_s;
    not the time the answer then waited to be read."""
    path = checkpoint("mixtral")
    cold = load_model(str(path), torch.device("cpu"), torch.float32, host_experts="native").model
    blocks = [layer.mlp for layer in cold.layers]
    cache, latency = enable_cold_weights(blocks, 2, 1000, torch.device("cpu"))  # type: ignore[arg-type]
    latency.cpu_fixed_s, latency.cpu_s_per_token = 1e-3, 0.0
    cache.remote = _SlowDaemon(blocks[0].store, 2e-3, delay_s=20e-3, late_s=40e-3)  # type: ignore[union-attr]
    x = torch.randn(1, cold.spec.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        blocks[0](x)
    assert cache.stats.cpu_daemon_experts == 2
    assert latency.cpu_scale == pytest.approx(1 + 0.1 * (2e-3 / 2e-3 - 1))  # 2 ms for 2 calls
    assert 0.1 * 20e-3 <= latency.remote_s < 0.1 * 40e-3
