"""The op-region table: every region with its label and placement, and where each placement
came from (pinned by the config, measured, or the default), as the engine really runs it."""

from __future__ import annotations

from pathlib import Path

from hybridgen.config import parse_config
from hybridgen.gpu_daemon.engine import Engine
from hybridgen.gpu_daemon.info import engine_regions
from hybridgen.op_regions import GPU_BOUND_LAYER, format_table


def _engine(path: Path, yaml: dict[str, object]) -> Engine:
    config = parse_config({"model": {"name_or_path": str(path), "max_model_len": 256}, **yaml})
    return Engine(config.engine_config("cpu"))


def test_table_follows_the_engine(checkpoint) -> None:  # type: ignore[no-untyped-def]
    path = checkpoint("llama3")
    plain = _engine(path, {})
    rows = {r.name: r for r in engine_regions(plain)}
    assert set(GPU_BOUND_LAYER) | {"lm_head", "attn_warm", "kv_codec", "sample"} == set(rows)
    assert all(rows[n].label == "gpu-bound" and rows[n].placement == "gpu" for n in GPU_BOUND_LAYER)
    assert rows["attn_warm"].placement == "off"  # no Warm tier configured
    assert (rows["sample"].placement, rows["sample"].source) == ("gpu", "default")
    plain.release()

    pinned = _engine(
        path,
        {
            "kv_cache": {"warm_region_mb": 2},
            "placements": {"attn_warm": "cpu", "kv_codec": "cpu", "sample": "cpu"},
        },
    )
    rows = {r.name: r for r in engine_regions(pinned)}
    assert pinned.warm is not None and pinned.warm.codec_on == "cpu"
    for name in ("attn_warm", "kv_codec", "sample"):
        assert (rows[name].label, rows[name].placement, rows[name].source) == (
            "hybrid-aware",
            "cpu",
            "pinned",
        )
    text = format_table(list(rows.values()))
    assert text.splitlines()[0].split()[:5] == ["region", "scope", "label", "placement", "source"]
    assert "attn_warm   layer  hybrid-aware  cpu" in text
    pinned.release()
