"""A small CPU engine for the Warm-tier, degrade and tuning tests: 8-token blocks, 32-token
steps and lossless Warm records, so a few short prompts already spill out of a tiny Hot pool."""

from __future__ import annotations

from pathlib import Path

from hybridgen.engine_config import EngineConfig
from hybridgen.gpu_daemon.engine import Engine


def small_engine(path: Path, **options: object) -> Engine:
    defaults: dict[str, object] = {"max_num_seqs": 4, "warm_codec": "lossless"}
    config = EngineConfig(
        model=str(path),
        device="cpu",
        block_size=8,
        max_model_len=256,
        max_num_batched_tokens=32,
        **{**defaults, **options},  # type: ignore[arg-type]
    )
    return Engine(config)
