"""The facts about a loaded engine that GetModelInfo reports, as one dict."""

from __future__ import annotations

from typing import Any

from hybridgen.gpu_daemon.engine import Engine


def engine_info(engine: Engine) -> dict[str, Any]:
    """Model and pool facts that stay fixed after load, keyed by GetModelInfo field names."""
    spec, config = engine.spec, engine.config
    return {
        "model": spec.name,
        "architecture": spec.architecture,
        "family": spec.family,
        "synthetic": spec.synthetic,
        "vocab_size": spec.vocab_size,
        "max_model_len": engine.max_model_len,
        "dtype": str(spec.dtype).removeprefix("torch."),
        "device": str(engine.device),
        "kv_block_size": config.block_size,
        "kv_blocks_total": engine.plan.num_blocks,
        "max_num_seqs": config.max_num_seqs,
        "eos_token_ids": sorted(engine.eos_ids),
    }
