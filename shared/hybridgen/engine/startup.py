"""What the engine sets up by measurement before it serves (Engine.__init__, in this order):

    setup_moe         MoE: where routers pick (moe_gate), and Cold-Weights: the experts' device
                      cache, sized from the budget with expert_cache_slots: auto
    place_attn_warm   attn_warm unpinned: both sides timed over synthetic Warm blocks, before
                      the KV pool is allocated
    measure_moe_gate  moe_gate unpinned and unprofiled: both sides timed, before the
                      decode graphs capture where the routers pick
    measure_regions   sample and kv_codec unpinned and unprofiled: both sides timed at the
                      live shapes, each placed on the faster one
    measure_spill_costs  spill_policy auto: a Warm block's read in a decode step and a block's
                      move Hot <-> Warm, for the spill decision (spill_policy.py)

StartupClock times each stage (and the weights' load, the KV pool and CUDA graphs between
them) for the engine_ready log line, so that a slow start names its stage.

Each takes explicit inputs, not the engine; the measure_* ones return the figures and the
faster side of each region, which the engine applies (Engine._place). The timers are
placement/region_timing.py's, the ones hybridgen-profiler uses offline. On a
CPU-only engine both sides are the CPU, so nothing is timed unless a test asks
(EngineConfig.measure_regions) and the defaults hold.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import structlog
import torch

from hybridgen.config.engine import EngineConfig
from hybridgen.engine.memory import BudgetTooSmall, plan_engine_memory, spare_expert_slots
from hybridgen.engine.spill_policy import SpillCosts
from hybridgen.experts.latency import LatencyModel
from hybridgen.experts.store import ExpertCache
from hybridgen.kernels.ops import KvCache
from hybridgen.kvtiers.warm_stats import WarmStats
from hybridgen.kvtiers.warm_tier import WarmTier
from hybridgen.models.llama import CausalLM
from hybridgen.models.moe import enable_cold_weights, moe_blocks
from hybridgen.placement.region_timing import (
    choose_placement,
    profile_attn_warm,
    profile_kv_codec,
    profile_moe_gate,
    profile_sample,
)
from hybridgen.placement.tuning_profile import RegionProfile

log = structlog.get_logger()

START_RUNS = 3
"""Timed runs per figure (the best counts)."""
START_SAMPLE_BATCH = 16
"""Decode batch sample and moe_gate are timed at (max_num_seqs if smaller)."""
ATTN_WARM_PROBE_BLOCKS = 512
"""Warm blocks the attn_warm timing attends: enough that launch costs do not decide."""
CPU_PROBE_BLOCKS = 64
"""The same on a CPU-only engine (tests, CI), where both sides are the CPU."""
MOVE_PROBE_BLOCKS = 16
"""Blocks the start-up timing of a move Hot -> Warm -> Hot copies each way."""


def place_moe_gate(model: CausalLM, placement: str) -> None:
    for block in moe_blocks(model):
        block.gate_on = placement


def setup_moe(
    config: EngineConfig, model: CausalLM, device: torch.device, held: Callable[[], int]
) -> tuple[ExpertCache, LatencyModel] | None:
    """The routers' configured placement, and Cold-Weights when expert_cache_slots is set:
    (the device cache, the latency model); None for a dense model or resident experts.
    `held`: the device bytes the engine's allocator holds now (plan_engine_memory's)."""
    blocks = moe_blocks(model)
    place_moe_gate(model, config.moe_gate_placement)
    slots = config.expert_cache_slots
    if slots is None or not blocks:
        return None
    experts = enable_cold_weights(
        blocks,
        1 if slots == "auto" else slots,
        config.expert_cpu_max_tokens,
        device,
        (config.cpu_bandwidth_gbps, config.gpu_bandwidth_gbps),
        config.cpu_expert_threads,
    )
    if slots == "auto":
        total = len(blocks) * blocks[0].num_experts
        _size_expert_cache(config, model, device, experts[0], total, held())
    return experts


def _size_expert_cache(
    config: EngineConfig,
    model: CausalLM,
    device: torch.device,
    cache: ExpertCache,
    experts: int,
    held: int,
) -> None:
    """expert_cache_slots: auto: plan with a one-slot cache, then give the cache what the
    budget leaves beyond the KV pool's minimum (memory.spare_expert_slots). `held`: what the
    allocator holds with the one slot, which the final plan counts as weights where it is
    above their bytes (int4 dense weights quantized on the device leave segments pinned):
    sized without it, B4a with weights.format int4 left 242 KV blocks of the 256 a sequence
    needs and did not start (H200, 08336d0)."""
    try:
        plan, _ = plan_engine_memory(config, model, device, held)
    except BudgetTooSmall as exc:
        raise BudgetTooSmall(
            f"cold_weights.expert_cache_slots=auto: not even one expert fits: {exc}"
        ) from exc
    fixed = config.kv_pool_mb is not None or config.num_kv_blocks is not None
    slots = min(1 + spare_expert_slots(plan, fixed, cache.expert_bytes), experts)
    cache.resize(slots)
    log.info(
        "expert_cache_sized",
        slots=slots,
        experts=experts,
        cache_mb=round(cache.nbytes / 2**20),
        expert_mb=round(cache.expert_bytes / 2**20, 1),
    )


def place_attn_warm(
    warm: WarmTier, config: EngineConfig, device: torch.device
) -> dict[str, RegionProfile]:
    """attn_warm unpinned (auto), or split without a share: on CUDA, time both sides over
    ATTN_WARM_PROBE_BLOCKS synthetic blocks of one layer and place it (auto), or share it so
    both finish together (split); {"attn_warm": figures} when timed. It gives its device
    memory back: left cached, it fragmented the budget the KV pool is allocated from next,
    and the steps ran up to 2x slower at the cap (bench/NOTES.md, B6)."""
    split_only = config.attn_warm == "split" and config.warm_split is None
    blocks = min(ATTN_WARM_PROBE_BLOCKS, warm.pool.capacity)
    if not (config.attn_warm == "auto" or split_only) or device.type != "cuda" or not blocks:
        return {}
    r = profile_attn_warm(warm, 1, blocks, START_RUNS, layers=1)
    torch.cuda.empty_cache()
    warm.stats = WarmStats()  # the probe is not traffic
    cpu_ms, gpu_ms = r.measured["cpu_ms"], r.measured["gpu_ms"]
    if split_only:
        warm.split = gpu_ms / (cpu_ms + gpu_ms)
    else:
        warm.mode, warm.split = choose_placement(cpu_ms, gpu_ms)
    log.info("attn_warm_placed", mode=warm.mode, cpu_share=round(warm.split, 3), **r.measured)
    return {"attn_warm": r}


def unplaced_regions(config: EngineConfig, device: torch.device) -> set[str]:
    """Of sample, kv_codec and moe_gate, those the engine times at start: neither pinned nor
    placed by a profile, when config.measure_regions (default: on CUDA) asks for it."""
    on = config.measure_regions
    if config.mode == "pure_gpu" or not (on or (on is None and device.type == "cuda")):
        return set()
    return {"sample", "kv_codec", "moe_gate"} - set(config.pinned_regions + config.profiled_regions)


def measure_moe_gate(
    config: EngineConfig, model: CausalLM, device: torch.device, graphed: bool
) -> dict[str, RegionProfile]:
    """{"moe_gate": both sides timed} when it is unplaced, for placing before the decode
    graphs are captured (`graphed`: they will be, so the router is timed as a graph replays
    it); {} otherwise. The placement is the profile's; the engine applies it."""
    blocks = moe_blocks(model)
    if "moe_gate" not in unplaced_regions(config, device) or not blocks:
        return {}
    with torch.inference_mode():
        r = profile_moe_gate(blocks[0], START_SAMPLE_BATCH, START_RUNS, graphed)
    log.info("region_measured", region="moe_gate", placement=r.placement, **r.measured)
    return {"moe_gate": r}


class StartupClock:
    """Seconds each start-up stage took, in order (Engine.startup_s, in the engine_ready
    log line): the stage named at each mark took the time since the last mark."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def mark(self, stage: str) -> None:
        now = time.perf_counter()
        self.seconds[stage] = self.seconds.get(stage, 0.0) + now - self._last
        self._last = now


def measure_regions(
    config: EngineConfig, device: torch.device, vocab_size: int, warm: WarmTier | None
) -> dict[str, RegionProfile]:
    """Time sample and kv_codec (with a Warm tier) both ways, unless the config pinned them
    or a profile placed them (config.measure_regions says where): each region's figures and
    the faster side, which the engine applies."""
    measured = {}
    free = unplaced_regions(config, device)
    with torch.inference_mode():
        if "sample" in free:
            batch = min(config.max_num_seqs, START_SAMPLE_BATCH)
            measured["sample"] = profile_sample(
                vocab_size, config.num_candidates, device, batch, START_RUNS
            )
        if "kv_codec" in free and warm is not None:
            measured["kv_codec"] = profile_kv_codec(warm, START_RUNS)
    for name, r in measured.items():
        log.info("region_measured", region=name, placement=r.placement, **r.measured)
    return measured


def measure_spill_costs(
    costs: SpillCosts, warm: WarmTier, kv_caches: Sequence[KvCache], config: EngineConfig
) -> None:
    """The spill decision's start-up figures: W, one Warm block read in a decode step in
    attn_warm's placement (timed over blocks of one layer, scaled to every layer), and on
    CUDA M, a block's move Hot -> Warm and back (_time_moves). Blocks of scratch caches are
    moved, so the KV pool is untouched; the tier's counters start again afterwards."""
    probe = ATTN_WARM_PROBE_BLOCKS if warm.device.type == "cuda" else CPU_PROBE_BLOCKS
    blocks = min(probe, warm.pool.capacity)
    if not blocks:
        return
    timed = profile_attn_warm(warm, 1, blocks, START_RUNS, layers=1).measured
    cpu, gpu = (timed[k] / 1e3 * warm.spec.num_layers / blocks for k in ("cpu_ms", "gpu_ms"))
    share = warm.cpu_blocks(1000) / 1000
    costs.warm_block_s = max(share * cpu, (1 - share) * gpu)  # the two sides run together
    if warm.device.type == "cuda":
        _time_moves(costs, warm, kv_caches)
    warm.stats = WarmStats()
    log.info(
        "spill_costs_measured",
        warm_block_us=round(costs.warm_block_s * 1e6, 2),
        move_block_us=None if costs.move_block_s is None else round(costs.move_block_s * 1e6, 2),
    )


def _time_moves(costs: SpillCosts, warm: WarmTier, kv_caches: Sequence[KvCache]) -> None:
    """M: MOVE_PROBE_BLOCKS zeroed blocks of scratch caches through the tier's store and
    load, the best of START_RUNS after one round for first calls. (On a CPU-only engine the
    first few indexing calls take tens of ms, so there M comes from the live stores only.)"""
    n = min(MOVE_PROBE_BLOCKS, warm.pool.capacity)
    scratch = [_zeros_like_blocks(kv, n) for kv in kv_caches]
    times = []
    for _ in range(START_RUNS + 1):  # the best of START_RUNS after one for first calls
        start = time.perf_counter()
        slots = warm.store(scratch, range(n))
        warm.load(scratch, slots, range(n))
        _sync(warm.device)
        times.append((time.perf_counter() - start) / (2 * n))
        warm.free(slots)
    costs.move_block_s = min(times[1:])
    del scratch
    torch.cuda.empty_cache()  # as place_attn_warm: nothing left to fragment the budget


def _zeros_like_blocks(kv: KvCache, n: int) -> KvCache:
    """A layer's Hot cache of `n` zeroed blocks, shaped and typed as `kv`."""

    def zeros(t: torch.Tensor) -> torch.Tensor:
        return torch.zeros((n, *t.shape[1:]), dtype=t.dtype, device=t.device)

    if isinstance(kv, tuple):
        return zeros(kv[0]), zeros(kv[1])
    parts = {f.name: getattr(kv, f.name) for f in dataclasses.fields(kv)}
    fresh: dict[str, Any] = {k: None if t is None else zeros(t) for k, t in parts.items()}
    return dataclasses.replace(kv, **fresh)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
