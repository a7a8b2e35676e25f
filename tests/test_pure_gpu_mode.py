"""`mode: pure_gpu`: no Warm tier and every placement on the GPU, so the CPU only detokenizes
and streams. Checked: the engine config the mode gives, the errors for settings that would
put work on the CPU, and one `hybridgen serve` in that mode (GetModelInfo says pure_gpu, and
greedy tokens are HF's)."""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hybridgen.config.engine import EngineConfig
from hybridgen.config.file import (
    ConfigError,
    HybridGenConfig,
    KvCacheConfig,
    Placements,
    load_config,
    parse_config,
)
from hybridgen.engine.engine import Engine
from hybridgen.engine.info import engine_info, memory_info
from hybridgen.v1 import generation_pb2 as pb
from tests.hf_reference import hf_greedy, sample_prompts
from tests.test_config import EXAMPLE
from tests.test_serving import Server, wait_serving

NEW_TOKENS = 20


def test_engine_config_has_no_warm_tier_and_gpu_placements() -> None:
    hybrid = parse_config({"kv_cache": {"warm_region_mb": 8}}).engine_config("cpu")
    assert (hybrid.warm_pool_mb, hybrid.attn_warm, hybrid.mode) == (8, "auto", "hybrid")
    pure = parse_config({"mode": "pure_gpu", "kv_cache": {"warm_region_mb": 0}})
    assert pure.warm_pool_mb == 0
    engine = pure.engine_config("cpu")
    assert engine == dataclasses.replace(
        hybrid,
        warm_pool_mb=0,
        attn_warm="gpu",
        sample_placement="gpu",
        mode="pure_gpu",
        dynamic_tuning=False,
    )


def test_engine_config_forces_gpu_even_past_validation() -> None:
    """A config built in code skips the schema's checks; the mode still wins."""
    config = HybridGenConfig(
        mode="pure_gpu",
        kv_cache=KvCacheConfig(warm_region_mb=64),
        placements=Placements(attn_warm="cpu", sample="cpu"),
    )
    assert config.warm_pool_mb == 0
    engine = config.engine_config("cpu")
    assert (engine.warm_pool_mb, engine.attn_warm, engine.sample_placement) == (0, "gpu", "gpu")


def test_warm_region_with_pure_gpu_is_an_error_naming_both_keys(tmp_path: Path) -> None:
    message = r"^kv_cache\.warm_region_mb=8 is out of range: allowed 0 or null with mode=pure_gpu$"
    with pytest.raises(ConfigError, match=message):
        parse_config({"mode": "pure_gpu", "kv_cache": {"warm_region_mb": 8}})
    for warm in (0, None):
        assert parse_config({"mode": "pure_gpu", "kv_cache": {"warm_region_mb": warm}})
    path = tmp_path / "hybridgen_config.yaml"
    path.write_text("mode: pure_gpu\nkv_cache:\n  warm_region_mb: 512\n")
    with pytest.raises(
        ConfigError, match=rf"^{re.escape(str(path))}: kv_cache\.warm_region_mb=512 .*pure_gpu"
    ):
        load_config(path)


def test_example_file_validates_in_both_modes(tmp_path: Path) -> None:
    text = EXAMPLE.read_text()
    assert load_config(EXAMPLE).mode == "hybrid"
    assert text.count("\nmode: hybrid\n") == 1
    path = tmp_path / "pure.yaml"
    path.write_text(text.replace("\nmode: hybrid\n", "\nmode: pure_gpu\n"))
    assert load_config(path).engine_config("cpu").mode == "pure_gpu"


@pytest.mark.parametrize(
    ("field", "value", "allowed"),
    [
        ("warm_pool_mb", 8.0, "0 with mode=pure_gpu"),
        ("sample_placement", "cpu", "gpu with mode=pure_gpu"),
        ("mode", "pure_cpu", "hybrid or pure_gpu"),
    ],
)
def test_engine_config_rejects_cpu_work_in_pure_gpu(
    field: str, value: object, allowed: str
) -> None:
    with pytest.raises(
        ConfigError, match=rf"^{field}={value!r} is out of range: allowed {allowed}$"
    ):
        EngineConfig(**{"mode": "pure_gpu", field: value})  # type: ignore[arg-type]


def test_engine_reports_its_mode(checkpoint) -> None:  # type: ignore[no-untyped-def]
    data = {"mode": "pure_gpu", "model": {"name_or_path": str(checkpoint("llama3"))}}
    engine = Engine(parse_config(data).engine_config("cpu"))
    assert engine.warm is None
    assert engine_info(engine)["mode"] == "pure_gpu"
    assert memory_info(engine.device) == {"gpu_mem_peak_reserved_mb": 0.0}


# -- served ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:  # type: ignore[no-untyped-def]
    srv = Server(
        checkpoint("llama3"), tmp_path_factory.mktemp("serve-pure-gpu"), "mode: pure_gpu\n"
    )
    wait_serving(srv.port, proc=srv.proc)
    yield srv
    assert srv.stop() == 0
    assert srv.segments() == [], "a clean stop leaves nothing in /dev/shm"


@pytest.mark.slow
def test_served_pure_gpu_reports_its_mode_and_matches_hf(server: Server, checkpoint) -> None:  # type: ignore[no-untyped-def]
    info = server.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
    assert (info.mode, info.device, info.warm_blocks_total) == ("pure_gpu", "cpu", 0)
    assert info.gpu_mem_peak_reserved_mb == 0.0  # a CPU device
    path = checkpoint("llama3")
    prompts = sample_prompts(path, 2, [31, 9])
    for prompt, expected in zip(prompts, hf_greedy(path, prompts, NEW_TOKENS), strict=True):
        assert server.greedy(prompt, NEW_TOKENS, timeout=60) == expected


@pytest.mark.slow
def test_served_op_region_table(server: Server) -> None:
    """GetModelInfo carries the op-region table, and `serve --explain` prints it once ready:
    in pure_gpu every region is on the GPU and the Warm-tier regions are off."""
    info = server.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
    rows = {r.name: r for r in info.op_regions}
    assert (rows["attn_warm"].placement, rows["kv_codec"].placement) == ("off", "off")
    assert (rows["sample"].label, rows["sample"].placement) == ("hybrid-aware", "gpu")
    assert all(r.placement in ("gpu", "off") for r in info.op_regions)
    deadline = time.monotonic() + 30
    while "op-regions of" not in server.log_path.read_text() and time.monotonic() < deadline:
        time.sleep(0.2)
    printed = server.log_path.read_text().split("op-regions of", 1)[1].splitlines()
    assert printed[1].split()[:3] == ["region", "scope", "label"]
    assert any(line.split()[:4] == ["sample", "step", "hybrid-aware", "gpu"] for line in printed)
