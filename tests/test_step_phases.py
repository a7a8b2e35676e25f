"""The engine's account of its own time (EngineStats.seconds, GetModelInfo step_s_*): where a
served run's time went, by phase, so that a benchmark tells a slow prefill from a slow Warm
read, a write-back or an idle engine."""

from __future__ import annotations

import time

import pytest

from hybridgen.engine.engine import FORWARD_PHASES, STEP_PHASES
from hybridgen.engine.info import counter_info, engine_info
from hybridgen.sampling.params import SamplingParams
from hybridgen.serving.service import model_info_to_pb
from tests.engine_helpers import small_engine
from tests.hf_reference import sample_prompts

SLOW_KEEP_S = 0.3
SLOW_SCHEDULE_S = 0.005


def test_the_engine_accounts_for_its_time_by_phase(
    checkpoint, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    """A short prompt (decode from Hot) beside one too long for Hot (it reads Warm), with a
    write-back made slow and every schedule slowed: each phase gets its time, the slowed ones
    at least what was added, and together they cover the run's wall time; GetModelInfo
    reports the same figures."""
    path = checkpoint("llama3")
    short, long = sample_prompts(path, 2, [12, 60])
    engine = small_engine(path, num_kv_blocks=8, max_model_len=96, warm_pool_mb=2)
    assert engine.offload is not None
    keep, schedule = engine.offload.keep, engine.scheduler.schedule

    def slow_keep(*args, **kwargs):  # type: ignore[no-untyped-def]
        time.sleep(SLOW_KEEP_S)
        return keep(*args, **kwargs)

    def slow_schedule():  # type: ignore[no-untyped-def]
        time.sleep(SLOW_SCHEDULE_S)
        return schedule()

    monkeypatch.setattr(engine.offload, "keep", slow_keep)
    monkeypatch.setattr(engine.scheduler, "schedule", slow_schedule)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    engine.add_request("short", short, params)
    engine.add_request("long", long, params)
    start, steps = time.perf_counter(), 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    wall = time.perf_counter() - start
    seconds = engine.stats.seconds
    assert set(seconds) == set(STEP_PHASES)
    assert all(s > 0 for s in seconds.values()), seconds
    assert seconds["outputs"] >= 2 * SLOW_KEEP_S  # both requests finished, each wrote back
    assert seconds["schedule"] >= steps * SLOW_SCHEDULE_S
    assert 0.9 * wall <= sum(seconds.values()) <= wall
    pb = model_info_to_pb({**engine_info(engine), **counter_info(engine), "max_queue": 1})
    assert [getattr(pb, f"step_s_{p}") for p in STEP_PHASES] == [seconds[p] for p in STEP_PHASES]
    # Its passes: every prompt token computed (again after the one preemption: Hot holds 64
    # tokens), and every token but each admission's first (its prompt's pass) from a decode
    # row.
    passes = engine.stats.passes
    assert set(passes) == set(FORWARD_PHASES) and passes["warm"].passes > 0
    assert engine.stats.preemptions == 1
    assert sum(c.prompt_tokens for c in passes.values()) > len(short) + len(long)
    assert sum(c.rows for c in passes.values()) == 2 * 16 - 2 - engine.stats.preemptions
    assert sum(c.passes for c in passes.values()) >= engine.stats.steps
    for p, c in passes.items():
        assert (pb_n := getattr(pb, f"step_n_{p}")) == c.passes and getattr(
            pb, f"step_rows_{p}"
        ) == c.rows
        assert p == "decode" or getattr(pb, f"step_tokens_{p}") == c.prompt_tokens, pb_n
    engine.release()
