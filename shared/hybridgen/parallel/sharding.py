"""How a model's weights split over N ranks (Megatron-style tensor parallel).

    q/k/v, gate/up (dense, each expert's, the shared expert's)  column-parallel: rows split
    o_proj, down (dense, each expert's, the shared expert's)     row-parallel: columns split,
                                                                 the outputs all-reduced
    embedding and LM head                                        vocab-parallel: rows split,
                                                                 padded to ceil(V / N) each
    norms, the router, the shared expert's gate                  replicated

Heads split whole (num_heads and num_kv_heads must divide by N: each rank keeps its own KV
heads, with no replication), and so do the MLP widths. A MoE model splits every expert's
intermediate width over the ranks (each rank holds a slice of every expert), so routing and
the per-expert loop stay as they are and one all-reduce after the block sums the slices.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import replace

import torch

from hybridgen.config.engine import ConfigError
from hybridgen.models.spec import ModelSpec

TP_KEY = "device_topology.gpu.tensor_parallel"
"""The config key every sharding error names."""
_COLUMN = re.compile(r".*\.(q_proj|k_proj|v_proj|gate_proj|up_proj|w1|w3)\.(weight|bias)")
_ROW = re.compile(r".*\.(o_proj|down_proj|w2)\.weight")
_VOCAB = ("model.embed_tokens.weight", "lm_head.weight")


def vocab_shard(vocab_size: int, ranks: int) -> int:
    """Rows of the embedding and the LM head on each rank: ceil(V / N); the last rank's are
    zero-padded, and the gathered logits cut back to V."""
    return -(-vocab_size // ranks)


def local_spec(spec: ModelSpec, ranks: int) -> ModelSpec:
    """The shape of one rank's shard of `spec`; a ConfigError naming the key when a width
    does not divide by `ranks`."""
    widths = {
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "intermediate_size": spec.intermediate_size,
        "moe_intermediate_size": spec.moe_intermediate_size,
        "shared_expert_intermediate_size": spec.shared_expert_intermediate_size,
    }
    if spec.mla is not None:
        raise ConfigError(
            f"{TP_KEY}={ranks} is out of range for {spec.name or spec.architecture}: allowed 1 "
            "(multi-head latent attention, DeepSeek-V2, is not split yet)"
        )
    for name, width in widths.items():
        if width % ranks:
            raise ConfigError(
                f"{TP_KEY}={ranks} is out of range for {spec.name or spec.architecture}: its "
                f"{name} ({width}) must divide by it (allowed: a divisor of {width})"
            )
    return replace(
        spec,
        num_heads=spec.num_heads // ranks,
        num_kv_heads=spec.num_kv_heads // ranks,
        intermediate_size=spec.intermediate_size // ranks,
        moe_intermediate_size=spec.moe_intermediate_size // ranks,
        shared_expert_intermediate_size=spec.shared_expert_intermediate_size // ranks,
        vocab_size=vocab_shard(spec.vocab_size, ranks),
    )


def shard_tensor(key: str, tensor: torch.Tensor, rank: int, ranks: int) -> torch.Tensor:
    """Rank `rank`'s part of the HF-named checkpoint tensor `key` (a view where it can be)."""
    if key in _VOCAB:
        rows = vocab_shard(tensor.shape[0], ranks)
        part = tensor[rank * rows : (rank + 1) * rows]
        if part.shape[0] == rows:
            return part
        padded = torch.zeros((rows, *tensor.shape[1:]), dtype=tensor.dtype)
        padded[: part.shape[0]] = part
        return padded
    if _COLUMN.fullmatch(key):
        return tensor.chunk(ranks, dim=0)[rank]
    if _ROW.fullmatch(key):
        return tensor.chunk(ranks, dim=1)[rank]
    return tensor


def shard_fused(
    name: str, tensor: torch.Tensor, spec: ModelSpec, rank: int, ranks: int
) -> torch.Tensor:
    """Rank `rank`'s part of our fused parameter `name` of the whole model `spec` (a
    synthetic preset's, drawn whole): q, k and v, and gate and up, each split on its own."""
    if name in ("embed_tokens.weight", "lm_head.weight"):
        return shard_tensor("lm_head.weight", tensor, rank, ranks)
    if name.endswith(("qkv_proj.weight", "qkv_proj.bias")):
        parts = tensor.split([spec.q_size, spec.kv_size, spec.kv_size])
    elif name.endswith("gate_up_proj.weight"):
        parts = tensor.chunk(2)
    elif name.endswith(("o_proj.weight", "down_proj.weight")):
        return tensor.chunk(ranks, dim=1)[rank]
    else:
        return tensor
    return torch.cat([part.chunk(ranks)[rank] for part in parts])


def shard_tensors(
    tensors: Iterable[tuple[str, torch.Tensor]], rank: int, ranks: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named tensors (one expert per name) -> rank `rank`'s parts, under the same names."""
    for key, tensor in tensors:
        yield key, shard_tensor(key, tensor, rank, ranks)
