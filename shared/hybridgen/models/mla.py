"""Multi-head latent attention (DeepSeek-V2), with its KV cache holding the latent.

Each token's keys and values are one compressed latent c = RMSNorm(x W_kv_a)[:kv_lora_rank]
plus one rotated key k_pe (qk_rope_head_dim) that every head shares; kv_b_proj expands c to
per-head k_nope and v. The cache keeps [c, k_pe] as a single KV head of kv_lora_rank +
qk_rope_head_dim (576 for DeepSeek-V2 and -Lite, against 16 heads x (192 + 128) = 5120 for
V2-Lite's keys and values as MHA), and that is the Hot block content.

Attention runs in latent space ("weight absorption", DeepSeek-V2 paper section 2.1.3): with
W_uk, W_uv the per-head key and value parts of kv_b_proj,
  q_nope . (W_uk c) = (W_uk^T q_nope) . c   and   sum_j p_j (W_uv c_j) = W_uv (sum_j p_j c_j),
so each head's query becomes [W_uk^T q_nope, q_pe], attends over the cached [c, k_pe] as
multi-query attention with one KV head, and its output's first kv_lora_rank entries go through
W_uv. This is why: the unchanged paged decode and prefill kernels (reference and Triton) and
the block pool run it as they are, with no per-step decompression of the whole context (which
would cost kv_b_proj over every cached token, every step). The value operand is the cached
[c, k_pe] too (the rope key's value columns are dropped after), so K and V are one tensor in
the Hot pool (ModelSpec.kv_copies 1): 576 values a token and layer for V2-Lite, 8.9x fewer
than its 16 heads' keys and values would be as MHA.

The softmax scale is HF's: qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 under
yarn scaling. The rope is DeepSeek's interleaved one (pairs of adjacent channels, HF's
complex multiplication), in fp32, on q_pe and k_pe only.

Tiers: the Hot codec must be native and the Warm tier off (kv_cache.hot_codec,
kv_cache.warm_pool_mb), refused at start by `latent_kv_unsupported`: their quantizers and
attention are written and checked for ordinary K/V heads only.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn

from hybridgen.kernels import ops
from hybridgen.models.dense_quant import project
from hybridgen.models.paged_attention import paged_attention
from hybridgen.models.spec import MlaSpec, ModelSpec

if TYPE_CHECKING:
    from hybridgen.models.llama import AttentionBatch


class MlaAttention(nn.Module):
    """q_proj (or q_a_proj, q_a_layernorm, q_b_proj), kv_a_proj_with_mqa, kv_a_layernorm,
    kv_b_proj and o_proj, named as HF's."""

    def __init__(self, spec: ModelSpec, layer: int) -> None:
        super().__init__()
        assert spec.mla is not None
        self.spec, self.layer, m = spec, layer, spec.mla
        self.mla: MlaSpec = m
        h, heads = spec.hidden_size, spec.num_heads
        q_out = heads * (m.qk_nope_head_dim + m.qk_rope_head_dim)
        if m.q_lora_rank:
            self.q_a_proj: nn.Module = nn.Linear(h, m.q_lora_rank, bias=False)
            self.q_a_layernorm = nn.Parameter(torch.ones(m.q_lora_rank))
            self.q_b_proj: nn.Module = nn.Linear(m.q_lora_rank, q_out, bias=False)
        else:
            self.q_proj: nn.Module = nn.Linear(h, q_out, bias=False)
        self.kv_a_proj_with_mqa: nn.Module = nn.Linear(h, m.cache_dim, bias=False)
        self.kv_a_layernorm = nn.Parameter(torch.ones(m.kv_lora_rank))
        self.kv_b_proj = nn.Linear(
            m.kv_lora_rank, heads * (m.qk_nope_head_dim + m.v_head_dim), bias=False
        )
        self.o_proj: nn.Module = nn.Linear(heads * m.v_head_dim, h, bias=False)
        self.scale = softmax_scale(spec)

    def forward(
        self,
        x: torch.Tensor,
        batch: AttentionBatch,
        kv: ops.KvCache,
        rope: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        """x: [T, H] -> [T, H]; writes the step's latents into `kv` (native (K, V) views)."""
        m, t, heads = self.mla, x.shape[0], self.spec.num_heads
        q = self._query(x).view(t, heads, m.qk_nope_head_dim + m.qk_rope_head_dim)
        q_nope, q_pe = q.split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        latent, k_pe = project(self.kv_a_proj_with_mqa, x).split(
            [m.kv_lora_rank, m.qk_rope_head_dim], dim=-1
        )
        latent = self._norm(latent, self.kv_a_layernorm)
        q_pe = rope_interleaved(q_pe, batch.positions, *rope)
        k_pe = rope_interleaved(k_pe[:, None], batch.positions, *rope)[:, 0]
        w = self.kv_b_proj.weight.view(heads, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
        w_uk, w_uv = w.split([m.qk_nope_head_dim, m.v_head_dim], dim=1)
        q_latent = torch.einsum("thn,hnc->thc", q_nope, w_uk)  # [T, heads, kv_lora_rank]
        query = torch.cat([q_latent, q_pe], dim=-1)  # [T, heads, cache_dim]
        key = torch.cat([latent, k_pe], dim=-1)[:, None]  # [T, 1, cache_dim]
        assert isinstance(kv, tuple), "MLA runs on the native Hot codec"
        write_latent(key, kv[0], batch.slot_mapping)  # kv[1] is the same tensor
        out = paged_attention(query, batch, kv, self.layer, self.scale)
        values = torch.einsum("thc,hvc->thv", out[..., : m.kv_lora_rank], w_uv)
        return project(self.o_proj, values.reshape(t, heads * m.v_head_dim))

    def _query(self, x: torch.Tensor) -> torch.Tensor:
        if not self.mla.q_lora_rank:
            return project(self.q_proj, x)
        return project(self.q_b_proj, self._norm(project(self.q_a_proj, x), self.q_a_layernorm))

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return ops.add_rms_norm(x.contiguous(), None, weight, self.spec.rms_norm_eps)[0]


def write_latent(key: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
    """key [T, 1, D] into the contiguous cache [N, S, 1, D] at slots [T] (int64; < 0:
    skipped), with no host sync and no data-dependent shape, so CUDA graphs capture it: a
    skipped row rewrites the step's highest slot with that slot's own key (with nothing to
    write, slot 0 with what it holds), so duplicate indices always carry equal values."""
    flat = cache.view(-1, *cache.shape[2:])  # [N * S, 1, D]
    valid = slots >= 0
    top = slots.argmax().view(1)  # a tensor index: slots[0-d tensor] would call .item()
    highest = slots.index_select(0, top)
    fallback = highest.clamp(min=0)
    fill = torch.where(highest >= 0, key.index_select(0, top), flat.index_select(0, fallback))
    rows = torch.where(valid[:, None, None], key.to(cache.dtype), fill)
    flat.index_copy_(0, torch.where(valid, slots, fallback), rows)


def rope_interleaved(
    x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """x: [T, heads, D] rotated by DeepSeek's rope, which turns adjacent channel pairs
    (2i, 2i + 1) by frequency i (HF: a complex multiplication in fp32) -> a new tensor.
    cos, sin: the runner's tables [positions, >= D] in HF's cat(freqs, freqs) layout."""
    half = x.shape[-1] // 2
    c = cos[positions, :half].unsqueeze(1)  # [T, 1, D/2]
    s = sin[positions, :half].unsqueeze(1)
    pairs = x.float().unflatten(-1, (half, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    return torch.stack([a * c - b * s, a * s + b * c], dim=-1).flatten(-2).to(x.dtype)


def softmax_scale(spec: ModelSpec) -> float:
    """HF's scaling: qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 under yarn."""
    assert spec.mla is not None
    scale = (spec.mla.qk_nope_head_dim + spec.mla.qk_rope_head_dim) ** -0.5
    rope = spec.rope
    if rope.rope_type != "default" and rope.mscale_all_dim and rope.factor > 1:
        mscale = 0.1 * rope.mscale_all_dim * math.log(rope.factor) + 1.0
        scale *= mscale * mscale
    return scale


def latent_kv_unsupported(spec: ModelSpec, hot_codec: str, warm_pool_mb: float) -> str | None:
    """Why an MLA model cannot run with these KV tier settings, naming the key; None if it
    can (or the model has no MLA)."""
    if spec.mla is None:
        return None
    if hot_codec != "native":
        return (
            f"kv_cache.hot_codec={hot_codec!r} is not supported for multi-head latent attention "
            f"({spec.architecture}): its cache already holds the compressed latent; use 'native'"
        )
    if warm_pool_mb > 0:
        return (
            f"kv_cache.warm_pool_mb={warm_pool_mb} is not supported for multi-head latent "
            f"attention ({spec.architecture}) yet; set it to 0"
        )
    return None
