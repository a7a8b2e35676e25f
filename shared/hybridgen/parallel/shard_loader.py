"""One rank's shard of a checkpoint directory or GGUF file, loaded tensor by tensor as
loader.py loads a whole model: each tensor is sliced (sharding.py) before it is copied, so
a rank's device only ever holds its shard; or of a synthetic preset, drawn as on one
device."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from hybridgen.models.default_model import resolve_model
from hybridgen.models.gguf_reader import is_gguf
from hybridgen.models.llama import CausalLM
from hybridgen.models.loader import (
    _split_fused_experts,
    checkpoint_tensors,
    copy_weights,
    gguf_tensors,
    model_spec,
    open_gguf,
)
from hybridgen.models.presets import STD
from hybridgen.models.spec import ModelSpec
from hybridgen.parallel.model import ShardedCausalLM
from hybridgen.parallel.sharding import shard_fused, shard_tensors


def full_spec(model: str, device: torch.device, dtype: torch.dtype | None) -> ModelSpec:
    """The whole model's spec in the dtype it loads in (loader.load_model's choice: a
    checkpoint's own, else bf16 on CUDA and fp32 on the CPU)."""
    spec = model_spec(model)
    if Path(model).is_dir():
        return replace(spec, dtype=dtype or spec.dtype)
    if is_gguf(model):
        default = spec.dtype if device.type == "cuda" else torch.float32
        return replace(spec, dtype=dtype or default)
    default = spec.dtype if device.type == "cuda" else torch.float32
    return replace(spec, dtype=dtype or default)


@torch.inference_mode()
def load_shard(
    model: str,
    device: torch.device,
    dtype: torch.dtype | None,
    rank: int,
    ranks: int,
    seed: int = 0,
) -> ShardedCausalLM:
    """Rank `rank`'s shard of `model` on `device`, of `ranks` ranks (a preset's drawn with
    `seed`)."""
    model = resolve_model(model)
    spec = full_spec(model, device, dtype)
    with torch.device("meta"):
        net = ShardedCausalLM(spec, rank, ranks).to(spec.dtype)
    net = net.to_empty(device=device)
    if spec.tie_word_embeddings:
        net.lm_head.weight = net.embed_tokens.weight
    if Path(model).is_dir():
        tensors = checkpoint_tensors(Path(model))
    elif is_gguf(model):
        tensors = gguf_tensors(open_gguf(model), spec)
    else:
        _draw_synthetic(net, spec, device, seed)
        return net.eval()
    copy_weights(net, shard_tensors(_split_fused_experts(tensors), rank, ranks), model)
    return net.eval()


def _draw_synthetic(net: ShardedCausalLM, spec: ModelSpec, device: torch.device, seed: int) -> None:
    """A preset's seeded weights, drawn whole parameter by parameter in presets.build_synthetic's
    order (so every rank count gives the same model as one device), each cut to its shard: a
    rank holds its shard and one whole parameter at most."""
    with torch.device("meta"):
        whole = CausalLM(spec)
    local = dict(net.named_parameters())
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, param in whole.named_parameters():
        if name.endswith(("layernorm", "_norm")) or name == "norm":
            local[name].fill_(1.0)
            continue
        w = torch.empty(param.shape, dtype=spec.dtype, device=device)
        w.normal_(0.0, STD, generator=gen)
        local[name].copy_(shard_fused(name, w, spec, net.rank, net.ranks))
