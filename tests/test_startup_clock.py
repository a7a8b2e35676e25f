"""The engine's start-up by stage (Engine.startup_s, in the engine_ready log line): a slow
start names its stage (hybrid's B6 server took 71 s to serve against pure_gpu's 26 on an
H100, e5ab8ad, with no word on where)."""

from __future__ import annotations

import time

import pytest
from structlog.testing import capture_logs

from hybridgen.engine import engine as engine_module
from tests.engine_helpers import small_engine

SLOW_S = 0.3
STAGES = [
    "load",
    "host_layers",
    "moe",
    "memory_plan",
    "warm_tier",
    "attn_warm",
    "moe_gate",
    "kv_pool_and_graphs",
    "spill_costs",
    "regions",
    "other",
]


def test_start_up_names_the_time_of_each_stage(checkpoint, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """A Warm-tier engine with its spill-cost timing made slow: every stage is there, in
    order, the slowed one with at least the time added, together no more than the
    constructor took; engine_ready logs the same."""
    measure = engine_module.measure_spill_costs

    def slow(*args, **kwargs):  # type: ignore[no-untyped-def]
        time.sleep(SLOW_S)
        return measure(*args, **kwargs)

    monkeypatch.setattr(engine_module, "measure_spill_costs", slow)
    path = checkpoint("llama3")
    start = time.perf_counter()
    with capture_logs() as logs:
        engine = small_engine(path, num_kv_blocks=12, max_model_len=96, warm_pool_mb=2)
    wall = time.perf_counter() - start
    stages = engine.startup_s
    assert list(stages) == STAGES
    assert all(s >= 0 for s in stages.values())
    assert stages["spill_costs"] >= SLOW_S and stages["load"] > 0
    assert sum(stages.values()) <= wall
    ready = [e for e in logs if e["event"] == "engine_ready"]
    assert ready[0]["startup_s"] == {k: round(v, 2) for k, v in stages.items()}
    engine.release()
