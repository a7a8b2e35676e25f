"""The Llama decoder, which also covers Mistral (sliding window), Qwen2 (qkv bias), Mixtral
(a sparse mixture of experts in place of the MLP, moe.py), Qwen2-MoE (qkv bias, experts and a
shared expert), Qwen3-MoE (RMSNorm over each q and k head, experts) and DeepSeek-V2
(multi-head latent attention, mla.py; shared experts and grouped routing, deepseek_moe.py).

Tokens of all sequences in a step are packed into one flat batch of T tokens, so every
projection is a single matmul; only attention looks at sequence boundaries, through the
`AttentionBatch` that the runner builds. q/k/v and gate/up are fused into one weight each
(the loader concatenates HF's separate tensors).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from hybridgen.kernels import ops
from hybridgen.models.deepseek_moe import DeepseekMoeBlock
from hybridgen.models.dense_quant import QuantLinear, project, project_swiglu
from hybridgen.models.host_layers import HostLayers
from hybridgen.models.mla import MlaAttention
from hybridgen.models.moe import SparseMoeBlock, moe_blocks
from hybridgen.models.paged_attention import paged_attention
from hybridgen.models.spec import ModelSpec


class WarmKeys(Protocol):
    """Keys of this step's sequences that live in the Warm tier (gpu_daemon.warm_tier): a
    leading run of whole blocks of each sequence; the Hot cache holds the rest."""

    def decode_partial(
        self, layer: int, q: torch.Tensor, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def prefix(
        self, layer: int, seq: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor] | None: ...


@dataclass
class AttentionBatch:
    """Where each token of a step sits in the paged KV cache, and what it attends to.

    Invariant: the first `num_decode` sequences have exactly one query token each and come
    first in the packed batch; the rest are prefill chunks.
    """

    positions: torch.Tensor
    """[T] int64 absolute position of each token."""
    slot_mapping: torch.Tensor
    """[T] int64 cache slot (block * block_size + offset) for each token's K/V; -1 skips."""
    block_tables: torch.Tensor
    """[B, M] int32 physical block ids of each sequence."""
    seq_lens: torch.Tensor
    """[B] int32 keys per sequence after this step (cached context plus new tokens)."""
    num_decode: int
    """Sequences with a single query token, which take the paged decode kernel."""
    query_start_loc: list[int]
    """Host copy: B + 1 offsets of each sequence's tokens in the packed batch."""
    seq_lens_host: list[int]
    """Host: keys per sequence after this step, Warm ones included (prefill path)."""
    warm: WarmKeys | None = None
    """Keys in the Warm tier; then block_tables and seq_lens cover only the Hot part."""


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, layer: int) -> None:
        super().__init__()
        self.spec, self.layer = spec, layer
        # nn.Linear, or a QuantLinear (weights.format int8/int4, dense_quant.quantize_dense).
        self.qkv_proj: nn.Module = nn.Linear(
            spec.hidden_size, spec.q_size + 2 * spec.kv_size, bias=spec.attention_bias
        )
        self.o_proj: nn.Module = nn.Linear(spec.q_size, spec.hidden_size, bias=False)
        self.scale = spec.head_dim**-0.5
        # Qwen3: each query and key head RMS-normed over head_dim before the rotation.
        self.q_norm = nn.Parameter(torch.ones(spec.head_dim)) if spec.qk_norm else None
        self.k_norm = nn.Parameter(torch.ones(spec.head_dim)) if spec.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        batch: AttentionBatch,
        kv: ops.KvCache,
        rope: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        s = self.spec
        t = x.shape[0]
        if isinstance(self.qkv_proj, QuantLinear) and self.q_norm is None and isinstance(kv, tuple):
            # Rotation and the cache write in the projection's kernel where it can.
            where = ops.RopeWrite(
                batch.positions, *rope, *kv, batch.slot_mapping, s.num_heads, s.num_kv_heads
            )
            q = self.qkv_proj(x, rope=where)
        else:
            qkv = project(self.qkv_proj, x)  # [T, (Hq + 2 Hkv) * D]
            q, k, v = qkv.split([s.q_size, s.kv_size, s.kv_size], dim=-1)
            q = self._head_norm(q.reshape(t, s.num_heads, s.head_dim), self.q_norm)
            k = self._head_norm(k.reshape(t, s.num_kv_heads, s.head_dim), self.k_norm)
            v = v.reshape(t, s.num_kv_heads, s.head_dim)
            ops.write_kv(q, k, v, batch.positions, rope[0], rope[1], kv, batch.slot_mapping)
        out = paged_attention(q, batch, kv, self.layer, self.scale, s.sliding_window)
        return project(self.o_proj, out.reshape(t, s.q_size))

    def _head_norm(self, x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        """x [T, heads, D] RMS-normed per head with `weight` [D] (a new tensor); x itself
        without a weight."""
        if weight is None:
            return x
        normed = ops.add_rms_norm(x.reshape(-1, x.shape[-1]), None, weight, self.spec.rms_norm_eps)
        return normed[0].view(x.shape)


class MLP(nn.Module):
    """SwiGLU of `width` (default the spec's intermediate_size)."""

    def __init__(self, spec: ModelSpec, width: int | None = None) -> None:
        super().__init__()
        width = width or spec.intermediate_size
        self.gate_up_proj: nn.Module = nn.Linear(spec.hidden_size, 2 * width, bias=False)
        self.down_proj: nn.Module = nn.Linear(width, spec.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return project(self.down_proj, project_swiglu(self.gate_up_proj, x))


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer: int) -> None:
        super().__init__()
        self.eps = spec.rms_norm_eps
        self.input_layernorm = nn.Parameter(torch.ones(spec.hidden_size))
        # Multi-head latent attention (DeepSeek-V2) or the ordinary kind.
        self.self_attn: nn.Module = (
            Attention(spec, layer) if spec.mla is None else MlaAttention(spec, layer)
        )
        self.post_attention_layernorm = nn.Parameter(torch.ones(spec.hidden_size))
        # Dense SwiGLU, or a sparse block of experts (of spec.expert_size each).
        block = DeepseekMoeBlock if spec.family == "deepseek_v2" else SparseMoeBlock
        self.mlp: nn.Module = block(spec, MLP) if spec.is_moe_layer(layer) else MLP(spec)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        batch: AttentionBatch,
        kv: ops.KvCache,
        rope: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = self.attend(x, residual, batch, kv, rope)
        return self.mlp(x), residual

    def attend(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        batch: AttentionBatch,
        kv: ops.KvCache,
        rope: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer up to its MLP: (the MLP's normed input [T, H], the residual stream)."""
        # HF order: residual add in model dtype, then RMSNorm; fused into one op here.
        x, residual = ops.add_rms_norm(x, residual, self.input_layernorm, self.eps)
        x = self.self_attn(x, batch, kv, rope)
        return ops.add_rms_norm(x, residual, self.post_attention_layernorm, self.eps)


class CausalLM(nn.Module):
    """Embedding, decoder layers, final norm and LM head; names follow HF minus the fusions."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec, i) for i in range(spec.num_layers))
        self.norm = nn.Parameter(torch.ones(spec.hidden_size))
        self.lm_head: nn.Module = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.host_layers: HostLayers | None = None
        """Layers whose projections live in host memory (weights.gpu_layers), if any."""

    def forward(
        self,
        input_ids: torch.Tensor,
        batch: AttentionBatch,
        kv_caches: list[ops.KvCache],
        rope: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        """input_ids: [T] -> final hidden states [T, H] (normed)."""
        if self.host_layers is not None:
            self.host_layers.begin_step(input_ids.shape[0])
        x = self.embed_tokens(input_ids)
        residual: torch.Tensor | None = None
        for layer, kv in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, batch, kv, rope)
        return self.final_norm(x, residual)

    def final_norm(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """The last layer's output and the residual stream -> final hidden states [T, H]."""
        return ops.add_rms_norm(x, residual, self.norm, self.spec.rms_norm_eps)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, H] -> logits [N, V] in float32 (the LM head runs in model dtype, as HF)."""
        return project(self.lm_head, hidden).float()


def empty_model(
    spec: ModelSpec, device: torch.device, expert_device: torch.device | None = None
) -> CausalLM:
    """A model with uninitialised weights in spec.dtype, allocated once on `device`; MoE
    experts on `expert_device` (default `device`): the CPU keeps them in host memory for
    Cold-Weights, "meta" allocates none (their ExpertStore is built apart)."""
    with torch.device("meta"):
        net = CausalLM(spec).to(spec.dtype)
    blocks = moe_blocks(net)
    held = [block.experts for block in blocks]
    for block in blocks:
        block.experts = nn.ModuleList()
    net = net.to_empty(device=device)
    for block, experts in zip(blocks, held, strict=True):
        block.experts = experts.to_empty(device=expert_device or device)
    if spec.tie_word_embeddings:
        net.lm_head.weight = net.embed_tokens.weight
    return net
