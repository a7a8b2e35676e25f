"""Model shapes, parsed from an HF `config.json` or given by a synthetic preset."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from hybridgen.models.errors import ModelLoadError

# HF architecture name -> our model family. All share one decoder (llama.py); the differences
# are carried as flags in the spec (num_local_experts > 0 swaps the MLP for moe.py).
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "DeepseekV2ForCausalLM": "deepseek_v2",
}
QWEN_MOE = ("qwen2_moe", "qwen3_moe")
"""The families whose MoE config follows Qwen's (num_experts, moe_intermediate_size, ...)."""

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class RopeSpec:
    """Rotary embedding parameters, normalised from the several HF spellings."""

    theta: float
    """Base of the rotary frequencies (`rope_theta`)."""
    rope_type: str = "default"
    """One of default, linear, dynamic, llama3, yarn."""
    factor: float = 1.0
    """Context extension factor of the scaled types."""
    original_max_position: int | None = None
    """`original_max_position_embeddings` of llama3, yarn and dynamic scaling."""
    low_freq_factor: float = 1.0
    """llama3 scaling: wavelengths above original_max/low_freq_factor are divided by factor."""
    high_freq_factor: float = 4.0
    """llama3 scaling: wavelengths below original_max/high_freq_factor are kept."""
    beta_fast: float = 32.0
    """yarn: rotations per context above which a frequency is kept."""
    beta_slow: float = 1.0
    """yarn: rotations per context below which a frequency is interpolated."""
    attention_factor: float | None = None
    """yarn: scale applied to cos/sin; None derives it from factor as HF does."""
    mscale: float | None = None
    """yarn (DeepSeek style): mscale numerator; None when absent."""
    mscale_all_dim: float | None = None
    """yarn (DeepSeek style): mscale denominator; None when absent."""
    truncate: bool = True
    """yarn: round the correction range to whole dimensions (HF default)."""
    freq_factors: tuple[float, ...] | None = None
    """Each rotary frequency divided by its factor (head_dim / 2 of them): a GGUF's
    rope_freqs tensor, how llama.cpp stores Llama 3.1's scaling; None: none."""


@dataclass(frozen=True)
class MlaSpec:
    """Multi-head latent attention's widths (DeepSeek-V2, models/mla.py)."""

    q_lora_rank: int
    """Width of the query's low-rank bottleneck (q_a_proj, q_b_proj); 0: a plain q_proj."""
    kv_lora_rank: int
    """Width of the compressed key/value latent that the KV cache holds."""
    qk_nope_head_dim: int
    """Per-head query/key width without rotary embedding (from the latent via kv_b_proj)."""
    qk_rope_head_dim: int
    """Width of the rotated query part and of the one rope key all heads share."""
    v_head_dim: int
    """Per-head value width (from the latent via kv_b_proj)."""

    @property
    def cache_dim(self) -> int:
        """Width of one token's cached "head": the latent and the rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class ModelSpec:
    """Everything the engine needs to know about a decoder-only model's shape."""

    architecture: str
    """HF architecture name, e.g. LlamaForCausalLM."""
    family: str
    """llama, mistral, qwen2, mixtral, qwen2_moe, qwen3_moe or deepseek_v2."""
    vocab_size: int
    """Rows of the embedding and of the LM head."""
    hidden_size: int
    """Width of the residual stream."""
    intermediate_size: int
    """Width of the dense MLP (Mixtral: of each expert, unless moe_intermediate_size is set)."""
    num_layers: int
    """Decoder layers."""
    num_heads: int
    """Query heads."""
    num_kv_heads: int
    """Key/value heads (GQA when fewer than num_heads); MLA: 1, the shared latent."""
    head_dim: int
    """Width of one head; MLA: of the cached latent and rope key (MlaSpec.cache_dim)."""
    max_position_embeddings: int
    """Longest context the model supports."""
    rms_norm_eps: float
    """Epsilon of every RMSNorm."""
    rope: RopeSpec
    """Rotary embedding parameters."""
    tie_word_embeddings: bool = False
    """LM head shares the embedding matrix."""
    attention_bias: bool = False
    """q/k/v projections carry a bias (Qwen2)."""
    sliding_window: int = 0
    """Keys older than this many positions are invisible; 0 means full attention."""
    num_local_experts: int = 0
    """Experts of each layer's sparse MoE block (Mixtral; DeepSeek's n_routed_experts); 0 for
    a dense MLP."""
    num_experts_per_tok: int = 0
    """Experts each token is routed to (top-k); 0 for a dense MLP."""
    moe_intermediate_size: int = 0
    """Width of each routed expert (Qwen-MoE); 0: intermediate_size (Mixtral)."""
    norm_topk_prob: bool = True
    """The top-k router weights are divided by their sum (Mixtral, Qwen3-MoE); False keeps
    them as the softmax's probabilities over all experts (Qwen2-MoE's default)."""
    shared_expert_intermediate_size: int = 0
    """Width of the dense shared expert every token also runs, scaled by
    sigmoid(shared_expert_gate x) (Qwen2-MoE); 0: none."""
    shared_expert_gated: bool = True
    """The shared expert's output is scaled by its sigmoid gate (Qwen2-MoE); False adds it
    as it is (DeepSeek-V2's shared experts, which have no gate)."""
    expert_groups: int = 1
    """Routed experts split into this many groups (DeepSeek's n_group); the top-k picks only
    among the topk_groups groups with the highest best score (group_limited_greedy)."""
    topk_groups: int = 1
    """Groups the top-k picks from (DeepSeek's topk_group); expert_groups: all (greedy)."""
    routed_scaling_factor: float = 1.0
    """The top-k router weights are multiplied by this (DeepSeek-V2)."""
    mla: MlaSpec | None = None
    """Multi-head latent attention (DeepSeek-V2) in place of the q/k/v projections."""
    dense_layers: tuple[int, ...] = ()
    """Layers of a MoE model with a dense MLP of intermediate_size instead of experts
    (Qwen-MoE's mlp_only_layers and decoder_sparse_step, DeepSeek's first_k_dense_replace)."""
    qk_norm: bool = False
    """RMSNorm over each query and key head before the rotary embedding (Qwen3)."""
    router_weights_in_model_dtype: bool = False
    """The top-k router weights are cast from fp32 to the model dtype before they scale the
    experts' outputs (Qwen-MoE, as HF does); Mixtral's stay fp32."""
    dtype: torch.dtype = torch.bfloat16
    """Checkpoint dtype (`torch_dtype`/`dtype`)."""
    eos_token_ids: tuple[int, ...] = ()
    """EOS ids from config.json (generation_config.json may override)."""
    bos_token_id: int | None = None
    """BOS id from config.json."""
    synthetic: bool = False
    """Seeded random weights from a preset, not a real checkpoint."""
    name: str = ""
    """Preset name or checkpoint directory, for display."""

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def rope_dim(self) -> int:
        """Width of the rotated part of a query head (MLA: qk_rope_head_dim)."""
        return self.head_dim if self.mla is None else self.mla.qk_rope_head_dim

    @property
    def expert_size(self) -> int:
        """Width of each routed expert."""
        return self.moe_intermediate_size or self.intermediate_size

    def is_moe_layer(self, layer: int) -> bool:
        """Layer `layer` routes experts (else it has a dense MLP)."""
        return bool(self.num_local_experts) and layer not in self.dense_layers

    @property
    def moe_layer_count(self) -> int:
        """Layers that route experts."""
        return sum(self.is_moe_layer(i) for i in range(self.num_layers))

    @property
    def kv_copies(self) -> int:
        """Tensors a layer's Hot-KV keeps: K and V (2), or one that is both (1, MLA: its
        cached latent and rope key are the keys and, absorbed, the values)."""
        return 2 if self.mla is None else 1

    def kv_bytes_per_token(self, dtype: torch.dtype | None = None) -> int:
        """Bytes of K and V for one token over all layers."""
        itemsize = (dtype or self.dtype).itemsize
        return self.kv_copies * self.num_layers * self.kv_size * itemsize

    def num_parameters(self) -> int:
        h, v = self.hidden_size, self.vocab_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        if self.attention_bias:
            attn += self.q_size + 2 * self.kv_size
        if self.qk_norm:
            attn += 2 * self.head_dim
        # Experts and the router's row per expert; a shared expert and its gate's one row.
        if self.mla is not None:
            attn = self._mla_parameters()
        moe = self.num_local_experts * (3 * h * self.expert_size + h)
        if self.shared_expert_intermediate_size:
            moe += 3 * h * self.shared_expert_intermediate_size + int(self.shared_expert_gated) * h
        layers = self.num_layers * (attn + 2 * h) + self.moe_layer_count * moe
        layers += (self.num_layers - self.moe_layer_count) * 3 * h * self.intermediate_size
        head = 0 if self.tie_word_embeddings else v * h
        return layers + v * h + head + h

    def _mla_parameters(self) -> int:
        """One MLA layer's attention parameters (projections and the two latent norms)."""
        assert self.mla is not None
        m, h, heads = self.mla, self.hidden_size, self.num_heads
        q_out = heads * (m.qk_nope_head_dim + m.qk_rope_head_dim)
        q = h * q_out if not m.q_lora_rank else m.q_lora_rank * (h + 1 + q_out)
        kv = h * m.cache_dim + m.kv_lora_rank
        kv += m.kv_lora_rank * heads * (m.qk_nope_head_dim + m.v_head_dim)
        return q + kv + heads * m.v_head_dim * h


def _require(cfg: dict[str, Any], key: str, path: Path, kind: type = int) -> Any:
    if key not in cfg:
        raise ModelLoadError(f"{path}: required key '{key}' is missing")
    value = cfg[key]
    if kind is int and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
        raise ModelLoadError(f"{path}: '{key}'={value!r} must be a positive integer")
    if kind is float and (not isinstance(value, (int, float)) or value <= 0):
        raise ModelLoadError(f"{path}: '{key}'={value!r} must be a positive number")
    return value


def parse_rope(cfg: dict[str, Any], path: Path) -> RopeSpec:
    """Accept transformers 4.x (`rope_theta` + `rope_scaling`) and 5.x (`rope_parameters`)."""
    params = dict(cfg.get("rope_parameters") or {})
    scaling = dict(cfg.get("rope_scaling") or {})
    merged = {**scaling, **params}
    theta = merged.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    known = {"default", "linear", "dynamic", "llama3", "yarn"}
    if rope_type not in known:
        raise ModelLoadError(
            f"{path}: rope_scaling.rope_type={rope_type!r} is not supported; "
            f"supported: {sorted(known)}"
        )
    factor = float(merged.get("factor", 1.0))
    if rope_type != "default" and factor <= 0:
        raise ModelLoadError(f"{path}: rope_scaling.factor={factor} must be > 0")
    orig = merged.get("original_max_position_embeddings")
    if rope_type in ("llama3",) and orig is None:
        raise ModelLoadError(f"{path}: rope_scaling.original_max_position_embeddings is required")
    return RopeSpec(
        theta=float(theta),
        rope_type=rope_type,
        factor=factor,
        original_max_position=int(orig) if orig is not None else None,
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        beta_fast=float(merged.get("beta_fast") or 32.0),
        beta_slow=float(merged.get("beta_slow") or 1.0),
        attention_factor=merged.get("attention_factor"),
        mscale=merged.get("mscale"),
        mscale_all_dim=merged.get("mscale_all_dim"),
        truncate=bool(merged.get("truncate", True)),
    )


def _as_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _parse_experts(cfg: dict[str, Any], path: Path) -> tuple[int, int]:
    """(num_local_experts, num_experts_per_tok) of a Mixtral config, validated; Qwen's
    configs name the experts num_experts (transformers 5 writes num_local_experts)."""
    key = (
        "num_local_experts"
        if "num_local_experts" in cfg or "num_experts" not in cfg
        else "num_experts"
    )
    experts = _require(cfg, key, path)
    per_token = _require(cfg, "num_experts_per_tok", path)
    if per_token > experts:
        raise ModelLoadError(
            f"{path}: num_experts_per_tok={per_token} must be at most {key}={experts}"
        )
    return experts, per_token


def _dense_layers(cfg: dict[str, Any], path: Path, layers: int) -> tuple[int, ...]:
    """The layers of a Qwen-MoE config with a dense MLP: those in mlp_only_layers, and those
    decoder_sparse_step skips (a layer routes experts when (layer + 1) % step == 0)."""
    step = cfg.get("decoder_sparse_step", 1)
    if not isinstance(step, int) or isinstance(step, bool) or step <= 0:
        raise ModelLoadError(f"{path}: 'decoder_sparse_step'={step!r} must be a positive integer")
    only = cfg.get("mlp_only_layers") or []
    if not isinstance(only, list) or any(
        not isinstance(i, int) or not 0 <= i < layers for i in only
    ):
        raise ModelLoadError(
            f"{path}: 'mlp_only_layers'={only!r} must list layer indices in [0, {layers})"
        )
    return tuple(i for i in range(layers) if i in only or (i + 1) % step)


def _qwen_moe_fields(cfg: dict[str, Any], path: Path, family: str) -> dict[str, Any]:
    """The ModelSpec fields of a Qwen2-MoE or Qwen3-MoE config beyond the dense ones."""
    layers = _require(cfg, "num_hidden_layers", path)
    shared = 0
    if family == "qwen2_moe":
        shared = _require(cfg, "shared_expert_intermediate_size", path)
    if family == "qwen3_moe" and cfg.get("attention_bias"):
        raise ModelLoadError(f"{path}: attention_bias=true is not supported for {family}")
    if cfg.get("use_sliding_window"):
        raise ModelLoadError(f"{path}: use_sliding_window=true is not supported for {family}")
    dense = _dense_layers(cfg, path, layers)
    if len(dense) == layers:
        raise ModelLoadError(f"{path}: mlp_only_layers and decoder_sparse_step leave no MoE layer")
    return {
        "moe_intermediate_size": _require(cfg, "moe_intermediate_size", path),
        "norm_topk_prob": bool(cfg.get("norm_topk_prob", False)),
        "shared_expert_intermediate_size": shared,
        "dense_layers": dense,
        "qk_norm": family == "qwen3_moe",
        "router_weights_in_model_dtype": True,
        "attention_bias": family == "qwen2_moe" and bool(cfg.get("qkv_bias", True)),
        "sliding_window": 0,
    }


def _positive_or_zero(cfg: dict[str, Any], key: str, path: Path, default: int = 0) -> int:
    value = cfg.get(key)
    value = default if value is None else value
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ModelLoadError(f"{path}: '{key}'={value!r} must be an integer >= 0")
    return value


def _mla(cfg: dict[str, Any], path: Path) -> MlaSpec:
    """DeepSeek-V2's attention widths, validated."""
    rope_dim = _require(cfg, "qk_rope_head_dim", path)
    if rope_dim % 2:
        raise ModelLoadError(f"{path}: 'qk_rope_head_dim'={rope_dim} must be even")
    if cfg.get("attention_bias"):
        raise ModelLoadError(f"{path}: attention_bias=true is not supported for deepseek_v2")
    return MlaSpec(
        q_lora_rank=_positive_or_zero(cfg, "q_lora_rank", path),
        kv_lora_rank=_require(cfg, "kv_lora_rank", path),
        qk_nope_head_dim=_require(cfg, "qk_nope_head_dim", path),
        qk_rope_head_dim=rope_dim,
        v_head_dim=_require(cfg, "v_head_dim", path),
    )


def _deepseek_routing(cfg: dict[str, Any], path: Path, experts: int) -> dict[str, Any]:
    """DeepSeek-V2's router: topk_method, its groups and the scaling factor, validated."""
    method = cfg.get("topk_method") or "greedy"
    if method not in ("greedy", "group_limited_greedy"):
        raise ModelLoadError(
            f"{path}: topk_method={method!r} is not supported; "
            "supported: ['greedy', 'group_limited_greedy']"
        )
    groups = topk = 1
    if method == "group_limited_greedy":
        groups, topk = _require(cfg, "n_group", path), _require(cfg, "topk_group", path)
        if experts % groups or topk > groups:
            raise ModelLoadError(
                f"{path}: n_group={groups} must divide n_routed_experts={experts} and "
                f"topk_group={topk} must be at most n_group"
            )
    if cfg.get("norm_topk_prob"):
        raise ModelLoadError(
            f"{path}: norm_topk_prob=true is not supported for deepseek_v2 (transformers' "
            "DeepseekV2 ignores it and DeepSeek's own code divides by the sum: set it false)"
        )
    return {
        "expert_groups": groups,
        "topk_groups": topk,
        "routed_scaling_factor": float(_require(cfg, "routed_scaling_factor", path, float)),
        "norm_topk_prob": False,
    }


def _deepseek_fields(cfg: dict[str, Any], path: Path, rope: RopeSpec) -> dict[str, Any]:
    """The ModelSpec fields of a DeepSeek-V2 config beyond the dense ones: MLA (its latent
    cached as one KV head), shared experts, grouped top-k routing, leading dense layers."""
    if rope.rope_type not in ("default", "yarn"):
        raise ModelLoadError(
            f"{path}: rope_scaling.rope_type={rope.rope_type!r} is not supported for "
            "deepseek_v2; supported: ['default', 'yarn']"
        )
    layers = _require(cfg, "num_hidden_layers", path)
    experts = _require(cfg, "n_routed_experts", path)
    per_token = _require(cfg, "num_experts_per_tok", path)
    if per_token > experts:
        raise ModelLoadError(
            f"{path}: num_experts_per_tok={per_token} must be at most n_routed_experts={experts}"
        )
    dense = _positive_or_zero(cfg, "first_k_dense_replace", path)
    if dense >= layers:
        raise ModelLoadError(
            f"{path}: first_k_dense_replace={dense} leaves no MoE layer of {layers}"
        )
    if cfg.get("moe_layer_freq", 1) != 1:
        raise ModelLoadError(
            f"{path}: moe_layer_freq={cfg['moe_layer_freq']!r} is not supported; use 1 "
            "(transformers' DeepseekV2 ignores it)"
        )
    mla = _mla(cfg, path)
    width = _require(cfg, "moe_intermediate_size", path)
    return {
        "num_local_experts": experts,
        "num_experts_per_tok": per_token,
        "moe_intermediate_size": width,
        "shared_expert_intermediate_size": width * _positive_or_zero(cfg, "n_shared_experts", path),
        "shared_expert_gated": False,
        "dense_layers": tuple(range(dense)),
        "num_kv_heads": 1,
        "head_dim": mla.cache_dim,
        "mla": mla,
        "attention_bias": False,
        "sliding_window": 0,
        **_deepseek_routing(cfg, path, experts),
    }


def parse_config(path: Path) -> ModelSpec:
    """Read `config.json` and validate what the engine depends on, naming the bad key."""
    try:
        cfg = json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelLoadError(f"{path} is missing: a model directory needs config.json") from None
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path} is not valid JSON: {e}") from None
    archs = cfg.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ModelLoadError(
            f"{path}: architectures={archs!r} is not supported; "
            f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
        )
    family = SUPPORTED_ARCHITECTURES[arch]
    heads = _require(cfg, "num_attention_heads", path)
    hidden = _require(cfg, "hidden_size", path)
    kv_heads = cfg.get("num_key_value_heads") or heads
    if heads % kv_heads:
        raise ModelLoadError(
            f"{path}: num_attention_heads={heads} must be a multiple of "
            f"num_key_value_heads={kv_heads}"
        )
    if cfg.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"{path}: hidden_act={cfg['hidden_act']!r} not supported; use 'silu'")
    if cfg.get("mlp_bias"):
        raise ModelLoadError(f"{path}: mlp_bias=true is not supported")
    dtype_name = cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16"
    if dtype_name not in _DTYPES:
        raise ModelLoadError(f"{path}: dtype={dtype_name!r} not supported; use {list(_DTYPES)}")
    window = cfg.get("sliding_window") or 0
    if family == "qwen2" and not cfg.get("use_sliding_window", False):
        window = 0
    moe = family == "mixtral" or family in QWEN_MOE
    experts, per_token = _parse_experts(cfg, path) if moe else (0, 0)
    extra = _qwen_moe_fields(cfg, path, family) if family in QWEN_MOE else {}
    rope = parse_rope(cfg, path)
    if family == "deepseek_v2":
        extra = _deepseek_fields(cfg, path, rope)
    spec = ModelSpec(
        architecture=arch,
        family=family,
        vocab_size=_require(cfg, "vocab_size", path),
        hidden_size=hidden,
        intermediate_size=_require(cfg, "intermediate_size", path),
        num_layers=_require(cfg, "num_hidden_layers", path),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=cfg.get("head_dim") or hidden // heads,
        max_position_embeddings=_require(cfg, "max_position_embeddings", path),
        rms_norm_eps=float(_require(cfg, "rms_norm_eps", path, float)),
        rope=rope,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=family == "qwen2" or bool(cfg.get("attention_bias", False)),
        sliding_window=int(window),
        num_local_experts=experts,
        num_experts_per_tok=per_token,
        dtype=_DTYPES[dtype_name],
        eos_token_ids=_as_ids(cfg.get("eos_token_id")),
        bos_token_id=cfg.get("bos_token_id"),
        name=str(path.parent),
    )
    return replace(spec, **extra)
