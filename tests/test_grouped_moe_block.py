"""The MoE block with its device-cached int8 / int4 experts in one grouped launch per layer
(experts/grouped.py, kernels/triton_grouped_experts.py) against the per-expert path, on the
tiny Qwen3-MoE (16 experts, top-4) and tiny Mixtral (8, top-2) presets.

On CUDA both paths run their Triton kernels. Without a GPU the cache lives on the CPU and
the grouped kernels run under TRITON_INTERPRET=1: `ops._use_triton` is patched to say yes,
which the grouped path asks; the per-expert path then takes torch's CPU int8 / int4 kernels.
Either way the two agree to fp32 rounding, not to the bit (K splits sum in another order).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hybridgen.experts import latency as latency_module
from hybridgen.experts.grouped import HitLaunches
from hybridgen.experts.store import ExpertCache, MoeStats
from hybridgen.kernels import ops
from hybridgen.kernels import triton_quant_gemv as t_qgemv
from hybridgen.models import moe as moe_module
from hybridgen.models.loader import load_model
from hybridgen.models.moe import enable_cold_weights, moe_blocks
from tests.kernel_helpers import DEVICE, rel_err

pytestmark = pytest.mark.slow

SLOTS = 6
"""Device cache slots for all layers: some experts hit, others are fetched or on the CPU."""
STEPS = 4


def _run(
    model: str, fmt: str, limit: int, xs: list[torch.Tensor], launches: list[int]
) -> tuple[list[torch.Tensor], MoeStats]:
    """Every step through every MoE layer, the first half with every miss fetched (the cache
    fills), the rest with misses of up to `limit` tokens on the CPU -> (outputs, counters);
    `launches` (the grouped launches' pairs) cleared of the calibration's."""
    loaded = load_model(model, DEVICE, torch.float32, host_experts=fmt)  # type: ignore[arg-type]
    blocks = moe_blocks(loaded.model)
    cache, latency = enable_cold_weights(blocks, SLOTS, 0, DEVICE)
    launches.clear()
    outs = []
    with torch.no_grad():
        for step, x in enumerate(xs):
            latency.max_cpu_tokens_override = 0 if step < len(xs) // 2 else limit
            outs += [block(x) for block in blocks]
    return outs, cache.stats


def _counted_launches(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The grouped launch on (Triton's interpreter off CUDA), each launch's pairs recorded in
    the list returned."""
    if DEVICE.type == "cpu":
        monkeypatch.setattr(ops, "_use_triton", lambda t: True)
    launches: list[int] = []
    real = ops.grouped_expert_swiglu

    def counted(*args: Any) -> torch.Tensor:
        launches.append(args[4].shape[0])
        return real(*args)

    monkeypatch.setattr(ops, "grouped_expert_swiglu", counted)
    return launches


def _counted_gemms(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The grouped GEMM launch, each launch's padded positions recorded in the list returned."""
    gemms: list[int] = []
    real = ops.grouped_expert_gemm_swiglu

    def counted(*args: Any) -> torch.Tensor:
        gemms.append(args[3][0].shape[0])
        return real(*args)

    monkeypatch.setattr(ops, "grouped_expert_gemm_swiglu", counted)
    return gemms


PAIRWISE = [
    ("tiny-mixtral", "int4", 1, 0),
    ("tiny-qwen3-moe", "int8", 1, 0),
    ("tiny-mixtral", "int8", 1, 1),
    ("tiny-qwen3-moe", "int4", 1, 1),
    ("tiny-mixtral", "int4", 3, 1),
    ("tiny-qwen3-moe", "int8", 3, 1),
]
"""Model x format x (tokens, limit): every pair of any two of them, in 6 cases of the 12 (each
takes 11-32 s under Triton's interpreter)."""


@pytest.mark.parametrize(("model", "fmt", "tokens", "limit"), PAIRWISE)
def test_grouped_block_equals_per_expert_path(
    monkeypatch: pytest.MonkeyPatch, model: str, fmt: str, tokens: int, limit: int
) -> None:
    """Steps of `tokens` rows through every MoE layer: the grouped path's outputs are the
    per-expert path's, its counters the same, and it launched at most once per layer and
    step. limit 0: every miss is fetched; 1: later, a miss with one token runs on the CPU."""
    launches = _counted_launches(monkeypatch)
    gen = torch.Generator().manual_seed(tokens * 10 + limit)
    hidden = 128
    xs = [torch.randn(tokens, hidden, generator=gen).to(DEVICE) for _ in range(STEPS)]
    monkeypatch.setattr(ops, "GROUPED_EXPERTS", False)
    expected, theirs = _run(model, fmt, limit, xs, launches)
    assert not launches
    monkeypatch.setattr(ops, "GROUPED_EXPERTS", True)
    alone: list[int] = []  # experts the grouped path fetched and ran on their own
    fetch_alone = ExpertCache.fetch

    def counted_alone(self: ExpertCache, layer: int, expert: int, store: Any) -> int:
        alone.append(expert)
        return fetch_alone(self, layer, expert, store)

    monkeypatch.setattr(ExpertCache, "fetch", counted_alone)
    got, mine = _run(model, fmt, limit, xs, launches)
    for out, ref in zip(got, expected, strict=True):
        assert out.shape == ref.shape and out.dtype == ref.dtype
        assert rel_err(out, ref) < 1e-5
    assert (mine.cpu_experts, mine.gpu_experts) == (theirs.cpu_experts, theirs.gpu_experts)
    assert mine.cache_hits + mine.cache_misses == mine.gpu_experts
    assert mine.routed == theirs.routed
    # Hits come up within the steps. Each launch has the layer's device experts as its pairs,
    # misses included (copied in first); only a second miss for the scratch slot in one
    # step runs on its own, after the launch.
    assert mine.cache_hits > 0
    if tokens == 1:
        assert sum(launches) + len(alone) == mine.gpu_experts
    assert len(alone) < mine.cache_misses  # some misses joined the launch
    assert 0 < len(launches) <= len(expected)  # one per layer and step at most
    if limit == 1:
        assert mine.cpu_experts > 0


@pytest.mark.parametrize(
    ("tokens", "fmt"), [(24, "int4"), (60, "int4"), (80, "int4"), (24, "int8")]
)
def test_a_prompts_step_groups_its_experts_of_many_rows(
    monkeypatch: pytest.MonkeyPatch, tokens: int, fmt: str
) -> None:
    """A step of `tokens` rows (a prompt's chunk beside decodes, or a prompt alone past
    GROUPED_STEP_ROWS), most of them routed to the same two experts (past MAX_ROWS): in int4
    those run in the layer's grouped GEMM and the others in its grouped GEMV, in int8 (no
    GEMM) on their own, dequantized, and none past GROUPED_STEP_ROWS is grouped. Either way
    the outputs are the per-expert path's. Before, every expert of such a step ran alone."""
    assert tokens - 4 > t_qgemv.MAX_ROWS
    launches = _counted_launches(monkeypatch)
    gemms = _counted_gemms(monkeypatch)
    gen = torch.Generator().manual_seed(tokens)
    # tokens - 4 rows of one token route to the same two experts; 4 others spread
    xs = [
        torch.cat(
            [
                torch.randn(1, 128, generator=gen).expand(tokens - 4, -1),
                torch.randn(4, 128, generator=gen),
            ]
        )
        .contiguous()
        .to(DEVICE)
        for _ in range(2)
    ]
    monkeypatch.setattr(ops, "GROUPED_EXPERTS", False)
    expected, theirs = _run("tiny-mixtral", fmt, 0, xs, launches)
    monkeypatch.setattr(ops, "GROUPED_EXPERTS", True)
    alone: list[int] = []  # rows of the experts run on their own
    run_alone = ExpertCache.run

    def counted(self: ExpertCache, slot: int, x: torch.Tensor) -> torch.Tensor:
        alone.append(x.shape[0])
        return run_alone(self, slot, x)

    monkeypatch.setattr(ExpertCache, "run", counted)
    got, mine = _run("tiny-mixtral", fmt, 0, xs, launches)
    for out, ref in zip(got, expected, strict=True):
        assert rel_err(out, ref) < 1e-5
    assert (mine.gpu_experts, mine.routed) == (theirs.gpu_experts, theirs.routed)
    big = [n for n in alone if n > t_qgemv.MAX_ROWS]  # `alone` has the calibration's, too
    if fmt == "int8" and tokens <= ops.GROUPED_STEP_ROWS:
        assert big and sum(launches) > 0 and not gemms, (launches, alone)
    elif fmt == "int8":
        assert big and not launches and not gemms
    elif tokens - 4 > ops.GEMM_MAX_ROWS:
        # past the GEMM's rows the two busy experts run alone (cuBLAS's tiles win there),
        # the few-row ones still in the layer's grouped GEMV
        assert not gemms and sum(launches) > 0 and len(big) >= len(expected), (gemms, big)
    else:
        # a layer's many-row experts in one GEMM, the few-row ones in the GEMV; on its own
        # only a miss that found no scratch slot (one here, 6 slots in all, which a few-row
        # miss of a lower id may have taken first)
        assert len(gemms) > len(expected) // 2 and all(g >= 16 for g in gemms), gemms
        assert len(big) <= mine.cache_misses and len(big) < len(expected), (big, gemms)


def test_a_step_whose_experts_all_have_many_rows_runs_them_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A step of 80 rows of one token (every expert it routes to past GEMM_MAX_ROWS): no
    grouped launch at all (its host table would buy nothing), the per-expert path's outputs."""
    tokens = 80
    assert tokens > ops.GEMM_MAX_ROWS
    launches = _counted_launches(monkeypatch)
    gemms = _counted_gemms(monkeypatch)
    tables: list[int] = []  # steps that built the grouped path's host table
    real_pack = moe_module.pack_step

    def counted_pack(ids: torch.Tensor, *args: Any) -> Any:
        tables.append(ids.shape[0])
        return real_pack(ids, *args)

    monkeypatch.setattr(moe_module, "pack_step", counted_pack)
    gen = torch.Generator().manual_seed(80)
    xs = [torch.randn(1, 128, generator=gen).expand(tokens, -1).contiguous().to(DEVICE)]
    monkeypatch.setattr(ops, "GROUPED_EXPERTS", False)
    expected, theirs = _run("tiny-mixtral", "int4", 0, xs, launches)
    monkeypatch.setattr(ops, "GROUPED_EXPERTS", True)
    got, mine = _run("tiny-mixtral", "int4", 0, xs, launches)
    for out, ref in zip(got, expected, strict=True):
        assert rel_err(out, ref) < 1e-5
    assert (mine.gpu_experts, mine.routed) == (theirs.gpu_experts, theirs.routed)
    assert not launches and not gemms and not tables


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("tokens", [1, 2])
def test_all_hit_steps_run_from_static_buffers(
    monkeypatch: pytest.MonkeyPatch, fmt: str, tokens: int
) -> None:
    """With HitLaunches set (MoeDecodeGraphs sets them: a CUDA graph on the device, the same
    static buffers run eagerly here), a step whose pairs all hit the cache gives the grouped
    launch's exact outputs from one HitLaunch per step shape, for fresh inputs each step; so
    does a step whose misses are all fetched (copied in before it); a step with an expert
    on the CPU takes the grouped path."""
    if DEVICE.type == "cpu":
        monkeypatch.setattr(ops, "_use_triton", lambda t: True)
    loaded = load_model("tiny-qwen3-moe", DEVICE, torch.float32, host_experts=fmt)  # type: ignore[arg-type]
    blocks = moe_blocks(loaded.model)
    cache, latency = enable_cold_weights(blocks, 64, 0, DEVICE)
    latency.max_cpu_tokens_override = 0
    block, cold = blocks[0], blocks[1]
    assert block.store is not None
    for e in range(block.num_experts):  # every expert of layer 0 cached, none of layer 1
        cache.stats.count_routed(0, [(e, 2)])
        cache.fetch(0, e, block.store)
    gen = torch.Generator().manual_seed(tokens)
    xs = [torch.randn(tokens, 128, generator=gen).to(DEVICE) for _ in range(3)]
    with torch.no_grad():
        expected = [block.combine(x, *block.route(x)) for x in xs]
        pool = torch.cuda.graph_pool_handle() if DEVICE.type == "cuda" else None
        cache.hit_launches = HitLaunches(cache, pool)
        runs: list[int] = []
        real = HitLaunches.run

        def counted(self: HitLaunches, x: torch.Tensor, *args: Any) -> torch.Tensor:
            runs.append(x.shape[0])
            return real(self, x, *args)

        monkeypatch.setattr(HitLaunches, "run", counted)
        got = [block.combine(x, *block.route(x)) for x in xs]
        # Layer 1 misses every expert, computed on the CPU: the grouped path.
        cpu = cache.stats.cpu_experts
        latency.max_cpu_tokens_override = tokens
        cold.combine(xs[0], *cold.route(xs[0]))
        assert cache.stats.cpu_experts > cpu and runs == [tokens] * 3
        # Layer 2 misses every expert, fetched: copied into slots first, then the same launch.
        latency.max_cpu_tokens_override = 0
        third, misses = blocks[2], cache.stats.cache_misses
        fetched = third.combine(xs[1], *third.route(xs[1]))
        assert cache.stats.cache_misses > misses and runs == [tokens] * 4
        assert len(cache.hit_launches) == 1  # one per step shape, for every layer
        cache.hit_launches = None
        assert torch.equal(fetched, third.combine(xs[1], *third.route(xs[1])))  # all hit now
    for out, ref in zip(got, expected, strict=True):
        assert torch.equal(out, ref)
    assert len(runs) == 4


def test_calibration_shares_out_one_grouped_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where a step's device experts run in one grouped launch, the latency model's device
    time for an expert is what GROUPED_CALIBRATION_EXPERTS pairs add to a launch of one,
    shared out (the launch's own cost is the layer's); without the launch, one call's time.
    Timings here read 10 us and 2 us a pair of the grouped launches timed."""
    launches = _counted_launches(monkeypatch)

    def timed(runs: int, fn: Any, device: torch.device) -> float:
        before = len(launches)
        fn()
        return 10e-6 + 2e-6 * sum(launches[before:])

    monkeypatch.setattr(latency_module, "best_of", timed)
    loaded = load_model("tiny-qwen3-moe", DEVICE, torch.float32, host_experts="int4")
    _, latency = enable_cold_weights(moe_blocks(loaded.model), 1, 0, DEVICE)  # 1 slot: auto
    assert launches == [8, 1] and latency.gpu_s == pytest.approx(2e-6)
    monkeypatch.setattr(ops, "GROUPED_EXPERTS", False)
    _, alone = enable_cold_weights(moe_blocks(loaded.model), 1, 0, DEVICE)
    assert launches == [8, 1] and alone.gpu_s == pytest.approx(10e-6)


@pytest.mark.parametrize(("tokens", "alike"), [(3, False), (80, False), (40, True)])
def test_misses_copied_beside_the_hits_launch_give_the_same_outputs(
    monkeypatch: pytest.MonkeyPatch, tokens: int, alike: bool
) -> None:
    """A layer whose misses reach SIDE_COPY_BYTES copies them on a side stream (CUDA) and
    launches its hits first, its copied misses after: two launches, pairs reordered, the
    same outputs as the one launch. Here every miss reaches it (the threshold at 0). 80
    tokens: a prompt's step, whose experts of many rows (the grouped GEMM) wait for the
    copies too; 40 alike tokens: only such experts (40 rows each), no GEMV pair at all."""
    launches = _counted_launches(monkeypatch)
    gemms = _counted_gemms(monkeypatch)
    gen = torch.Generator().manual_seed(5)
    if alike:
        x = torch.randn(1, 128, generator=gen).expand(tokens, -1).contiguous()
        xs = [x.to(DEVICE)] * STEPS
    else:
        xs = [torch.randn(tokens, 128, generator=gen).to(DEVICE) for _ in range(STEPS)]
    expected, theirs = _run("tiny-mixtral", "int4", 0, xs, launches)
    one_launch = list(launches)
    monkeypatch.setattr(moe_module, "SIDE_COPY_BYTES", 0)
    reordered: list[int] = []
    real = moe_module.copied_last

    def counted(packed: Any, copied: Any) -> Any:
        out = real(packed, copied)
        reordered.append(out[1])
        return out

    monkeypatch.setattr(moe_module, "copied_last", counted)
    got, mine = _run("tiny-mixtral", "int4", 0, xs, launches)
    for out, ref in zip(got, expected, strict=True):
        assert rel_err(out, ref) < 1e-5
    assert (mine.cache_hits, mine.cache_misses) == (theirs.cache_hits, theirs.cache_misses)
    assert reordered, "layers with misses took the side path"
    if tokens > 3:  # the grouped GEMM ran after the copies, the GEMV pairs too if any
        assert gemms
        assert not alike or (not launches and all(early == 0 for early in reordered))
        return
    assert any(early > 0 for early in reordered), "hits launched ahead of copied misses"
    assert sum(launches) == sum(one_launch)  # the same pairs, in more launches
    assert len(launches) > len(one_launch)
