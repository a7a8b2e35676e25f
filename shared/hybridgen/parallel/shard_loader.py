"""One rank's shard of a checkpoint directory or GGUF file, loaded tensor by tensor as
loader.py loads a whole model: each tensor is sliced (sharding.py) before it is copied, so
a rank's device only ever holds its shard."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from hybridgen.models.default_model import resolve_model
from hybridgen.models.errors import ModelLoadError
from hybridgen.models.gguf_file import is_gguf
from hybridgen.models.loader import (
    _split_fused_experts,
    checkpoint_tensors,
    copy_weights,
    gguf_tensors,
    model_spec,
    open_gguf,
)
from hybridgen.models.spec import ModelSpec
from hybridgen.parallel.model import ShardedCausalLM
from hybridgen.parallel.sharding import TP_KEY, shard_tensors


def full_spec(model: str, device: torch.device, dtype: torch.dtype | None) -> ModelSpec:
    """The whole model's spec in the dtype it loads in (loader.load_model's choice)."""
    spec = model_spec(model)
    if Path(model).is_dir():
        return replace(spec, dtype=dtype or spec.dtype)
    if is_gguf(model):
        default = spec.dtype if device.type == "cuda" else torch.float32
        return replace(spec, dtype=dtype or default)
    raise ModelLoadError(
        f"{TP_KEY} > 1 loads a checkpoint directory or a GGUF file; {model!r} is a synthetic "
        "preset, which tensor parallel does not draw (set tensor_parallel: 1)"
    )


@torch.inference_mode()
def load_shard(
    model: str, device: torch.device, dtype: torch.dtype | None, rank: int, ranks: int
) -> ShardedCausalLM:
    """Rank `rank`'s shard of `model` on `device`, of `ranks` ranks."""
    model = resolve_model(model)
    spec = full_spec(model, device, dtype)
    with torch.device("meta"):
        net = ShardedCausalLM(spec, rank, ranks).to(spec.dtype)
    net = net.to_empty(device=device)
    if spec.tie_word_embeddings:
        net.lm_head.weight = net.embed_tokens.weight
    if Path(model).is_dir():
        tensors = checkpoint_tensors(Path(model))
    else:
        tensors = gguf_tensors(open_gguf(model), spec)
    copy_weights(net, shard_tensors(_split_fused_experts(tensors), rank, ranks), model)
    return net.eval()
