"""Decode-first steps (model.step_latency_ms): a step that carries decodes takes only the
prefill its measured cost model allows within the target; steps without decodes take the
whole max_num_batched_tokens; tokens are the same either way."""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from functools import partial

import pytest
import torch

from hybridgen.config.engine import EngineConfig
from hybridgen.engine import step_budget
from hybridgen.engine.block_pool import BlockPool
from hybridgen.engine.engine import Engine
from hybridgen.engine.info import launch_info, step_info
from hybridgen.engine.scheduler import Scheduler, SchedulerConfig
from hybridgen.engine.sequence import Sequence
from hybridgen.engine.step_budget import MIN_TOKENS, StepBudget, key_weight
from hybridgen.models.presets import preset_spec
from hybridgen.sampling.params import SamplingParams
from hybridgen.serving.service import model_info_to_pb

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def test_cost_model_inverts_and_learns() -> None:
    sb = StepBudget(target_s=0.040, key_weight=1e-4)
    for context in (0, 1000, 100_000):
        for units in (10.0, 500.0, 5000.0):
            n = sb.tokens_for(units, context)
            assert sb.units(n, context) <= units < sb.units(n + 1, context)
    assert sb.allowance(8) is None, "nothing measured yet: no limit"
    sb.observe(8, [], 0.010)  # a decode-only step of 8 rows: 10 ms
    assert sb.allowance(8) is None, "no prefill measured yet"
    sb.observe(0, [(400, 0)], sb.units(400, 0) * 5e-5)  # prefill alone: 50 us a unit
    assert sb.per_unit == pytest.approx(5e-5, rel=1e-6)
    assert sb.allowance(0) is None, "a step with no decodes is not limited"
    assert sb.allowance(8) == pytest.approx((0.040 - 0.010) / 5e-5)
    # Mixed steps take 5 ms more than their parts (eager decodes): the bucket learns it.
    for _ in range(40):
        sb.observe(8, [(200, 0)], 0.015 + sb.units(200, 0) * 5e-5)
    assert sb.mixed[8] == pytest.approx(0.015, rel=1e-3)
    assert sb.per_unit == pytest.approx(5e-5, rel=1e-6), "mixed steps teach mixed(B) only"
    assert sb.allowance(8) == pytest.approx((0.040 - 0.015) / 5e-5, rel=1e-3)
    for _ in range(20):  # mixed steps now cost 50 ms beside their prefill: over the target
        sb.observe(8, [(200, 0)], 0.050 + sb.units(200, 0) * 5e-5)
    # The step overruns the target by 10 ms before any prefill: prefill may add as much.
    assert sb.allowance(8) == pytest.approx(0.010 / 5e-5, rel=1e-3)


def test_mixed_cost_is_learned_per_batch_bucket() -> None:
    """What a step with 64 decodes costs beside prefill (its eager decodes: a host cost that
    grows with the batch) says nothing of a step with 4: that bucket goes by its own
    measurements, or by its decode-only steps until it has some."""
    sb = StepBudget(target_s=0.025, key_weight=0.0, per_unit=2e-5)
    sb.observe(4, [], 0.0067)
    sb.observe(64, [], 0.0083)
    sb.observe(64, [(16, 0)], 0.031)  # 64 decodes and 16 prompt tokens: 31 ms
    assert sb.mixed_s(64) == pytest.approx(0.031 - 16 * 2e-5)
    assert sb.allowance(4) == pytest.approx((0.025 - 0.0067) / 2e-5)
    sb.observe(4, [(500, 0)], 0.020)
    assert sb.mixed_s(4) == pytest.approx(0.010)
    assert sb.allowance(4) == pytest.approx((0.025 - 0.010) / 2e-5)


def test_first_prefill_measured_beside_decodes() -> None:
    """With no prefill-alone step seen, a mixed step's time beyond its decodes is the prefill's
    (never less than a quarter of the step)."""
    sb = StepBudget(target_s=0.040, key_weight=0.0, decode={8: 0.010})
    sb.observe(8, [(100, 0)], 0.030)
    assert sb.per_unit == pytest.approx(0.020 / 100)
    sb = StepBudget(target_s=0.040, key_weight=0.0, decode={8: 0.010})
    sb.observe(8, [(100, 0)], 0.008)  # faster than its decodes alone: noise
    assert sb.per_unit == pytest.approx(0.002 / 100)


def test_key_weight_follows_the_shape() -> None:
    """llama3-8b: 4 x 4096 flops of attention per key and layer against 2 x 218M of dense
    work per token and layer: 128K keys of context cost ~4.9 times a token's dense work."""
    assert key_weight(preset_spec("llama3-8b")) == pytest.approx(2 * 4096 / 218.1e6, rel=0.01)


def _scheduler(budget: StepBudget | None) -> Scheduler:
    return Scheduler(SchedulerConfig(8, 256, 1024), BlockPool(256, 16), step_budget=budget)


def _seq(i: int, prompt: int) -> Sequence:
    return Sequence(f"r{i}", prompt, list(range(1, prompt + 1)), GREEDY, 0, i)


def test_prefill_beside_decodes_is_capped() -> None:
    sb = StepBudget(target_s=0.040, key_weight=0.0, per_unit=1e-4, decode={4: 0.030})
    sched = _scheduler(sb)
    decoding = [_seq(i, 8) for i in range(4)]
    for s in decoding:
        sched.add(s)
    first = sched.schedule()  # no decodes yet: 4 x 8 tokens, unlimited
    assert first.num_tokens == [8, 8, 8, 8]
    for s in decoding:
        s.num_computed_tokens = s.num_tokens
        s.token_ids.append(5)
    sched.add(_seq(9, 500))
    mixed = sched.schedule()
    # 10 ms of spare time at 0.1 ms per token: 100 prefill tokens beside 4 decodes.
    assert mixed.num_tokens == [1, 1, 1, 1, 100]
    sb.decode[4] = 0.040  # decodes alone at the target: the prompt still moves
    for s in decoding:
        s.num_computed_tokens = s.num_tokens
        s.token_ids.append(5)
    sched.running[-1].num_computed_tokens += 100
    assert sched.schedule().num_tokens == [1, 1, 1, 1, MIN_TOKENS]
    sb.decode[4] = 0.045  # 5 ms over: prefill may add 5 ms (50 tokens) beyond the decodes
    for s in decoding:
        s.num_computed_tokens = s.num_tokens
        s.token_ids.append(5)
    sched.running[-1].num_computed_tokens += MIN_TOKENS
    overrun = sched.schedule().num_tokens
    assert overrun[:4] == [1, 1, 1, 1] and overrun[4] in (49, 50)  # 5 ms, to float rounding


@pytest.mark.slow
@pytest.mark.parametrize(("latency_ms", "overrun"), [(0.0, 1.0), (0.001, 0.0), (0.001, 1.0)])
def test_engine_steps_with_decodes_stay_small(  # type: ignore[no-untyped-def]
    checkpoint, latency_ms: float, overrun: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 1 us target with the limit held there (OVERRUN_SHARE 0) leaves no room beside
    decodes (MIN_TOKENS a step); with the default, the decodes' overrun of it makes room for
    more than MIN_TOKENS; 0 turns the limit off, and the same prompt goes in at
    max_num_batched_tokens."""
    monkeypatch.setattr(step_budget, "OVERRUN_SHARE", overrun)
    engine = Engine(
        EngineConfig(
            model="tiny-llama",
            device="cpu",
            max_model_len=512,
            max_num_batched_tokens=256,
            step_latency_ms=latency_ms,
        )
    )
    # a 200-token prompt measures the prefill per token (an 8-token one is mostly overhead)
    engine.add_request("a", list(range(1, 201)), SamplingParams(temperature=0.0, max_tokens=40))
    for _ in range(4):  # a's prefill, then decodes (measured)
        engine.step()
    engine.add_request("b", list(range(10, 400)), GREEDY)
    sizes = []
    while "b" in engine.seqs and engine.seqs["b"].num_computed_tokens < 390:
        batch_before = engine.seqs["b"].num_computed_tokens
        engine.step()
        sizes.append(engine.seqs["b"].num_computed_tokens - batch_before)
    if latency_ms and overrun == 0.0:  # a's prefill alone measured its cost: chunks stay small
        assert max(sizes) == MIN_TOKENS
    elif latency_ms:
        assert max(sizes) > MIN_TOKENS, sizes
    else:
        assert max(sizes) == 256 - 1, "the whole budget beside a's decode"


def test_decode_times_include_the_forward_when_the_host_samples() -> None:
    """With the tokens picked on the host (placements.sample: cpu, as the CPU daemon does),
    the forward pass runs before the step hands over its rows: its measured decode time is
    the step's, not the microseconds after it (GetModelInfo read 0.0026 ms a step)."""
    engine = Engine(
        EngineConfig(model="tiny-llama", device="cpu", max_model_len=256, sample_placement="cpu")
    )
    for i in range(4):
        engine.add_request(f"r{i}", list(range(1 + i, 20 + i)), GREEDY)
    walls = []
    while engine.has_unfinished():
        start = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - start)
    assert engine.step_times.decode, "decode steps were measured"
    assert min(engine.step_times.decode.values()) > 0.2 * min(walls)


def _clock_sync(rows: int, tokens: int, first: bool) -> tuple[float, float | None]:
    """A step that runs as it is called (a MoE model reading its expert picks back in every
    layer: the host's launches and the device's work add up), whose eager decodes cost 25 ms
    more beside prefill than a graphed decode-only step."""
    if not rows:
        return 0.002 + 20e-6 * tokens, None
    if not tokens:
        return 0.006 + 35e-6 * rows, None
    return 0.031 + 35e-6 * rows + 20e-6 * tokens, None


def _clock_async(
    rows: int, tokens: int, first: bool, launch: float = 0.022
) -> tuple[float, float | None]:
    """The H100's llama3-8b as measured: graphed decode steps 6 ms + 35 us a row; an eager
    step's launch takes the host `launch` (16-30 ms measured), behind which the device needs
    23 us a prompt token (and the decode rows' 6 ms + 35 us each); the first eager step
    compiles a kernel: 1.7 s, all of it in its launch."""
    if not tokens:
        return 0.006 + 35e-6 * rows, None
    if first:
        return 1.7, 1.699
    device = (0.006 + 35e-6 * rows if rows else 0.0) + 23e-6 * tokens
    return max(launch + 0.0005, device), launch


def _burst(
    engine: Engine, seed: int, clock: list[float], steps: list[tuple[int, int, float]]
) -> float:
    """64 prompts of 512 tokens at once, 64 new tokens each, on the simulated clock: the
    median time to first token."""
    rng = random.Random(seed)
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    for i in range(64):
        engine.add_request(f"{seed}-{i}", [rng.randrange(3, 200) for _ in range(512)], params)
    start, ttft = clock[0], {}
    steps.clear()
    while engine.has_unfinished():
        engine.step()
        for rid, seq in engine.seqs.items():
            if rid not in ttft and seq.num_output_tokens:
                ttft[rid] = clock[0] - start
    return statistics.median(ttft.values())


@pytest.mark.slow
@pytest.mark.parametrize(
    ("clock_of", "ttft_s"),
    [(_clock_sync, 3.0), (_clock_async, 1.5), (partial(_clock_async, launch=0.030), 1.0)],
    ids=["sync", "host_floor", "host_floor_over_target"],
)
def test_bursts_in_a_row_keep_their_ttft(
    monkeypatch: pytest.MonkeyPatch,
    clock_of: Callable[..., tuple[float, float | None]],
    ttft_s: float,
) -> None:
    """The engine's own scheduler and step budget on a simulated clock; two bursts of 64
    prompts in a row keep the same TTFT, and steps with decodes stay short.

    sync: the H100's B2 alternated between a TTFT p50 of ~1 s and ~12 s with a gap p50 of
    31 ms: a mixed step cost ~31 ms however little prefill it carried, so one factor over
    (decodes + prefill) for every batch size went to its cap and held the next burst's
    prefill to MIN_TOKENS a step ([1.10, 28.3] s here; now mixed(B) per bucket).

    host_floor: on the H100 (in-process, 3 bursts) an eager step's 20-30 ms launch was a floor
    under steps of 8 decodes and 16 prompt tokens, and the first burst's compile spike set
    the prefill's cost per token 12x too high: TTFT p50 9.5, 4.9 and 6.6 s. On this clock
    without the launch floor and the medians: 12.8, 8.9 and 7.3 s; with them 2.14 (the
    compile's 1.7 s in it), 0.50 and 0.51 s, ~800-1,000 prompt tokens a step. With a 30 ms
    launch, over the 25 ms target, the steps take the launch's time, and more prefill."""
    engine = Engine(
        EngineConfig(
            model="tiny-llama",
            device="cpu",
            max_model_len=1024,
            max_num_seqs=64,
            max_num_batched_tokens=2048,
            decode_steps=1,
            step_latency_ms=25.0,
            num_kv_blocks=64 * 40,
        )
    )
    # the simulated clock's shape: llama3-8b's attention against its dense work per token
    engine.step_times.key_weight = key_weight(preset_spec("llama3-8b"))
    clock: list[float] = [0.0]
    steps: list[tuple[int, int, float]] = []
    observe = engine.step_times.observe

    def simulated(rows: int, chunks: list[tuple[int, int]], seconds: float, _: object) -> None:
        tokens = sum(n for n, _ in chunks)
        seconds, launch = clock_of(rows, tokens, bool(tokens) and clock[0] == 0.0)
        clock[0] += seconds
        steps.append((rows, tokens, seconds))
        observe(rows, chunks, seconds, launch)

    monkeypatch.setattr(engine.step_times, "observe", simulated)
    p50s, gaps = [], []
    for seed in range(3):
        p50s.append(_burst(engine, seed, clock, steps))
        gaps.append(max(t for rows, _, t in steps if rows))  # the first: nothing measured yet
    assert max(p50s[1:]) < 1.5 * min(p50s[1:]), p50s
    assert max(p50s[1:]) < ttft_s and p50s[0] < ttft_s + 1.7, p50s  # the compile: 1.7 s
    assert max(gaps[1:]) < 0.05, gaps


def test_a_fixed_cost_of_prefill_steps_is_not_charged_per_token() -> None:
    """Steps that pay 300 ms for any prefill and 50 us a token (a MoE model's experts): once
    one kind of step carried prefill of sizes 2x apart, per_unit is their slope, not the
    prefill-only step's average (1.2 ms a token), and the fixed part goes to mixed(B)."""
    sb = StepBudget(target_s=0.025, key_weight=0.0, decode={1: 0.014})
    sb.observe(0, [(256, 0)], 0.300 + 256 * 50e-6)
    assert sb.per_unit == pytest.approx(0.3128 / 256)
    sb.observe(1, [(48, 0)], 0.314 + 48 * 50e-6)
    assert sb.per_unit == pytest.approx(0.3128 / 256), "one size of each kind: no slope"
    sb.observe(1, [(200, 0)], 0.314 + 200 * 50e-6)
    assert sb.per_unit == pytest.approx(50e-6)
    assert sb.average == pytest.approx(0.3128 / 256)
    sb.observe(1, [(100, 0)], 0.314 + 100 * 50e-6)
    assert sb.mixed_s(1) == pytest.approx(0.314, rel=0.02)
    # 289 ms over the target: prefill may add as much, ~5,800 tokens at the slope
    assert sb.allowance(1) == pytest.approx((0.314 - 0.025) / 50e-6, rel=0.02)
    noisy = StepBudget(target_s=0.025, key_weight=0.0, per_unit=1e-3)
    for units, seconds in [(50, 0.32), (200, 0.31)]:  # longer with fewer tokens: noise
        noisy.observe(0, [(units, 0)], seconds)
    assert noisy.per_unit == pytest.approx(step_budget.SLOPE_FLOOR * noisy.average)


def _clock_moe(rows: int, tokens: int, first: bool) -> tuple[float, float | None]:
    """B4c on the H100 (qwen3-30b-a3b, half its int4 experts in host memory): decode-only
    steps 14-34 ms; any step with prefill ~300 ms more (nearly every expert touched, a third
    fetched), and 50 us a prompt token beyond that."""
    decode = 0.0087 + 0.0063 * rows if rows else 0.0
    return decode + (0.300 + 50e-6 * tokens if tokens else 0.0), None


def test_prompts_beside_decodes_go_in_whole_where_prefill_costs_a_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """B4c's 4 streams at once, served: one prompt goes in alone, three arrive while it
    decodes. Every step with prefill costs ~300 ms, so small chunks waste them: the three
    have their first tokens 0.98 s after they came, three such steps (with per_unit the
    average cost per token, the last waited 2.6 s on this clock)."""
    engine = Engine(
        EngineConfig(
            model="tiny-llama",
            device="cpu",
            max_model_len=512,
            max_num_seqs=4,
            max_num_batched_tokens=2048,
            decode_steps=1,
            step_latency_ms=25.0,
        )
    )
    engine.step_times.key_weight = 0.0
    clock = [0.0]
    observe = engine.step_times.observe

    def simulated(rows: int, chunks: list[tuple[int, int]], seconds: float, _: object) -> None:
        seconds, launch = _clock_moe(rows, sum(n for n, _ in chunks), False)
        clock[0] += seconds
        observe(rows, chunks, seconds, launch)

    monkeypatch.setattr(engine.step_times, "observe", simulated)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    engine.add_request("a", list(range(3, 259)), params)
    engine.step()
    came = clock[0]
    for i in range(3):
        engine.add_request(f"b{i}", list(range(10 + i, 266 + i)), params)
    ttft: dict[str, float] = {}
    while len(ttft) < 3:
        engine.step()
        ttft.update(
            (rid, clock[0] - came)
            for rid, seq in engine.seqs.items()
            if rid.startswith("b") and rid not in ttft and seq.num_output_tokens
        )
    assert max(ttft.values()) < 1.1, ttft


def test_model_info_reports_both_step_models() -> None:
    """GetModelInfo carries what the step budget goes by: decode-only steps and the part of
    mixed ones beside their prefill, by batch bucket, also when they come as JSON (the
    rings' stats), and the launch floor."""
    engine = Engine(EngineConfig(model="tiny-llama", device="cpu", max_model_len=256))
    engine.step_times.observe(4, [], 0.007)
    engine.step_times.observe(0, [(100, 0)], 0.002)
    engine.step_times.observe(4, [(100, 0)], 0.012)
    for launch in (0.021, 0.023, 0.022):
        engine.step_times.observe(0, [(100, 0)], 0.030, launch)
    info = {**step_info(engine), **launch_info(engine)}
    assert info["decode_step_ms"] == {4: pytest.approx(7.0)}
    assert info["mixed_step_ms"] == {4: pytest.approx(10.0)}
    assert info["eager_launch_ms"] == pytest.approx(21.0)  # the least of the window
    as_json = {
        k: {str(r): ms for r, ms in v.items()} if isinstance(v, dict) else v
        for k, v in info.items()
    }
    pb = model_info_to_pb(as_json)
    assert dict(pb.mixed_step_ms) == {4: pytest.approx(10.0)}
    assert dict(pb.decode_step_ms) == {4: pytest.approx(7.0)}
    assert pb.eager_launch_ms == pytest.approx(21.0)


def test_launch_floor_is_learned_from_two_launches_and_fills_with_prefill() -> None:
    """One launch may have compiled a kernel: the floor counts from the second on, as the
    least of the last WINDOW. A step held by the host (its device work ended as its launch
    returned) only bounds the prefill's cost from above; a step the device held measures
    it."""
    sb = StepBudget(target_s=0.025, key_weight=0.0, decode={8: 0.007})
    sb.observe(0, [(2048, 0)], 1.7, 1.699)  # the compile: host-bound, nothing to learn from
    assert sb.per_unit is None and sb.launch is None
    per = 0.047 / 2048
    sb.observe(0, [(2048, 0)], 0.047, 0.022)  # the device held it: 23 us a token
    assert sb.per_unit == pytest.approx(per)
    assert sb.launch == pytest.approx(0.022), "of 1.699 and 0.022 the lower"
    sb.observe(8, [(16, 0)], 0.0225, 0.022)  # host-bound: mixed(8) no more than decode(8)
    assert sb.mixed_s(8) == pytest.approx(0.007)
    assert sb.allowance(8) == pytest.approx((0.025 - 0.007) / per)
    for _ in range(step_budget.WINDOW):  # the launch now takes 30 ms, above the target
        sb.observe(0, [(100, 0)], 0.030, 0.030)
    assert sb.launch == pytest.approx(0.030), "once no shorter launch is left in the window"
    assert sb.per_unit == pytest.approx(per), "host-bound steps never raise it"
    assert sb.allowance(8) == pytest.approx((0.030 - 0.007) / per), "the floor is free"


@pytest.mark.parametrize("sample", ["gpu", "cpu"])
def test_engine_times_the_launch_where_the_device_runs_behind(
    monkeypatch: pytest.MonkeyPatch, sample: str
) -> None:
    """Where a step does not run as it is called (a CUDA device, a dense model), the engine
    hands the step budget each eager step's launch time, up to when the step was queued and
    not its wait for the tokens (here 50 ms, added after queuing), whether the device samples
    or hands the host each row's candidates (placements.sample); on a CPU none."""
    engine = Engine(
        EngineConfig(model="tiny-llama", device="cpu", max_model_len=256, sample_placement=sample)
    )
    seen: list[tuple[float, float | None]] = []
    observe = engine.step_times.observe

    def record(rows: int, chunks: list[tuple[int, int]], s: float, launch: float | None) -> None:
        seen.append((s, launch))
        observe(rows, chunks, s, launch)

    monkeypatch.setattr(engine.step_times, "observe", record)
    engine.add_request("a", list(range(1, 60)), GREEDY)
    engine.step()
    assert seen and seen[-1][1] is None, "a CPU runs each step as it is called"
    runner = engine.runner
    monkeypatch.setattr(runner, "computes_as_called", False)
    wait = 0.05
    if sample == "gpu":  # the tokens come back through _to_host after they were queued
        monkeypatch.setattr(runner, "_to_host", _slowly(runner._to_host, wait))
    else:  # the candidates come back through .numpy() after they were queued
        monkeypatch.setattr(torch.Tensor, "numpy", _slowly(torch.Tensor.numpy, wait))
    for i in range(3):
        engine.add_request(f"b{i}", list(range(5 + i, 80 + i)), GREEDY)
        engine.step()
    launches = [(s, launch) for s, launch in seen if launch is not None]
    assert len(launches) >= 2 and all(0 < launch <= s - wait for s, launch in launches), seen
    assert engine.step_times.launch is not None


def _slowly(fn: Callable[..., object], wait: float) -> Callable[..., object]:
    def slow(*args: object) -> object:
        time.sleep(wait)
        return fn(*args)

    return slow


def test_no_launch_where_host_layers_wait_for_the_cpu(  # type: ignore[no-untyped-def]
    checkpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Host layers whose rows the CPU computes make the host wait inside the forward pass:
    their steps' launch is no floor, and the budget is not handed one."""
    engine = Engine(
        EngineConfig(
            model=str(checkpoint("llama3", num_hidden_layers=3)),
            device="cpu",
            max_model_len=128,
            gpu_layers=1,
            host_layer_compute="cpu",
        )
    )
    assert engine.host_layers is not None and engine.host_layers.waits_on_host(64)
    monkeypatch.setattr(engine.runner, "computes_as_called", False)
    seen: list[float | None] = []
    observe = engine.step_times.observe

    def record(rows: int, chunks: list[tuple[int, int]], s: float, launch: float | None) -> None:
        seen.append(launch)
        observe(rows, chunks, s, launch)

    monkeypatch.setattr(engine.step_times, "observe", record)
    for i in range(3):
        engine.add_request(f"r{i}", list(range(3 + i, 40 + i)), GREEDY)
        engine.step()
    assert seen and all(launch is None for launch in seen)
