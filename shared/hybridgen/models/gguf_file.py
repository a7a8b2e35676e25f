"""A GGUF file (ggml's format, what llama.cpp and Ollama serve): its metadata as a ModelSpec,
its tensors under the HF names the loader knows.

Read by gguf_reader.py, which memory-maps the file, so nothing is read twice and a tensor
is dequantized (by the `gguf` package, ggml's own code) only when the loader asks for it.
What llama.cpp's converter changed is undone here, as transformers undoes it:
  - names: `blk.N.attn_q.weight` -> `model.layers.N.self_attn.q_proj.weight`, and so on;
  - the llama architecture's q and k rows are permuted for ggml's interleaved rotary
    embedding (`permute` in convert_hf_to_gguf.py); `unpermute_rows` restores HF's order.
    Rows stay whole in every block type, so the permutation moves packed rows as they are;
  - Mixtral is the llama architecture with `expert_count` set, its experts stacked per layer
    ([E, out, in] tensors) or one tensor per expert in older files.

Everything is checked before a single weight is copied: an unsupported architecture or
tensor type, or a truncated or corrupt file, is a ModelLoadError naming it, raised at load,
before the server says it is serving.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hybridgen.models.errors import ModelLoadError
from hybridgen.models.gguf_reader import GgufReader, read_gguf
from hybridgen.models.spec import ModelSpec, RopeSpec

ROPE_FREQS = "rope_freqs.weight"
# general.architecture -> (HF architecture, family) of a dense model (llama with experts is
# Mixtral), or of Qwen3-MoE.
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
}
MOE_ARCHITECTURES = ("llama", "qwen3moe")
"""Those whose experts this loader reads."""
# ggml tensor types this loader reads: plain floats, and the block formats whose dequantization
# gguf-py implements (the legacy 32-element blocks and the 256-element K-quants).
SUPPORTED_TYPES: tuple[str, ...] = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0")
SUPPORTED_TYPES += ("Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
_LAYER = re.compile(r"blk\.(\d+)\.(.+)")
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_inp.weight": "block_sparse_moe.gate.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Mixtral's (and Qwen3-MoE's) experts: ggml's gate/up/down are HF's w1/w3/w2.
_EXPERT_W = {"ffn_gate": "w1", "ffn_up": "w3", "ffn_down": "w2"}
# What llama.cpp's llama converter permutes for its interleaved rotary embedding.
_PERMUTED = ("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias")
_STACKED_EXPERTS = re.compile(r"(ffn_gate|ffn_up|ffn_down)_exps\.weight")
_ONE_EXPERT = re.compile(r"(ffn_gate|ffn_up|ffn_down)\.(\d+)\.weight")


@dataclass(frozen=True)
class GgufTensor:
    """One tensor of the file: ggml type, HF shape and its rows as stored.

    `data` is [..., rows, bytes per row] uint8 for block types, the values for F32/F16 (the
    reader's view into the memory map, or a row-permuted copy of it)."""

    qtype: str
    """ggml type name, one of SUPPORTED_TYPES."""
    shape: tuple[int, ...]
    """HF order: [out, in] for a matrix, [E, out, in] for stacked experts."""
    data: np.ndarray
    """The stored rows."""

    def dequantize(self) -> torch.Tensor:
        """The values in float32, as gguf-py (and so transformers) computes them."""
        from gguf import GGMLQuantizationType, dequantize

        values = dequantize(self.data, GGMLQuantizationType[self.qtype])
        return torch.from_numpy(np.array(values, dtype=np.float32)).reshape(self.shape)


class GgufFile:
    """An opened, checked GGUF file."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._reader: GgufReader = read_gguf(self.path)
        self.arch = str(self.get("general.architecture", required=True))
        self._tensors = {t.name: t for t in self._reader.tensors}
        self._check_types()

    def get(self, key: str, default: Any = None, required: bool = False) -> Any:
        """A metadata value (GgufReader.get)."""
        return self._reader.get(key, default, required)

    def arch_key(self, key: str, default: Any = None, required: bool = False) -> Any:
        """`{architecture}.{key}`, e.g. llama.block_count."""
        return self.get(f"{self.arch}.{key}", default, required)

    def _check_types(self) -> None:
        for t in self._reader.tensors:
            if t.qtype.name not in SUPPORTED_TYPES:
                raise ModelLoadError(
                    f"{self.path}: tensor '{t.name}' has ggml type {t.qtype.name}, which is "
                    f"not supported; supported: {', '.join(SUPPORTED_TYPES)}"
                )

    def tensor_types(self) -> dict[str, int]:
        """How many tensors of each ggml type the file holds."""
        counts: dict[str, int] = {}
        for t in self._reader.tensors:
            counts[t.qtype.name] = counts.get(t.qtype.name, 0) + 1
        return counts

    def has_tensor(self, name: str) -> bool:
        return name in self._tensors

    def tensor(self, name: str) -> GgufTensor:
        """One tensor by its ggml name, as stored."""
        t = self._tensors[name]
        return GgufTensor(t.qtype.name, tuple(reversed(t.dims)), t.data)

    def rows(self, name: str) -> int:
        """Leading dimension of a tensor in HF order (a matrix's output rows)."""
        return self._tensors[name].dims[-1]

    def spec(self) -> ModelSpec:
        """The model's shape from the metadata, validated, naming the bad key."""
        return gguf_spec(self)

    def tensors(self, spec: ModelSpec) -> Iterator[tuple[str, GgufTensor]]:
        """Every tensor under its HF name (experts split per expert), q and k rows restored to
        HF's order for the llama architecture."""
        for t in self._reader.tensors:
            if t.name == ROPE_FREQS:  # read into the spec's RopeSpec, not a weight
                continue
            for name, part in _hf_parts(t.name, self.tensor(t.name)):
                yield name, self._unpermuted(name, part, spec)

    def _unpermuted(self, name: str, t: GgufTensor, spec: ModelSpec) -> GgufTensor:
        if self.arch != "llama" or not name.endswith(_PERMUTED):
            return t
        heads = spec.num_heads if ".q_proj." in name else spec.num_kv_heads
        return GgufTensor(t.qtype, t.shape, unpermute_rows(t.data, heads))


def unpermute_rows(rows: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's `permute` of q/k rows ([2, D/2] per head -> [D/2, 2]): the inverse of
    w.reshape(heads, 2, D / 2, ...).swapaxes(1, 2)."""
    n = rows.shape[0]
    if n % (2 * heads):
        raise ModelLoadError(f"q/k rows {n} are not a multiple of 2 x {heads} heads")
    half = n // heads // 2
    return np.ascontiguousarray(
        rows.reshape(heads, half, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)
    )


def _hf_parts(name: str, t: GgufTensor) -> Iterator[tuple[str, GgufTensor]]:
    """A ggml tensor's HF name(s): one, or one per expert of a stacked expert tensor."""
    if name in _GLOBAL_NAMES:
        yield _GLOBAL_NAMES[name], t
        return
    m = _LAYER.fullmatch(name)
    if m is None:
        yield name, t  # the loader names it as unexpected
        return
    prefix, rest = f"model.layers.{m.group(1)}.", m.group(2)
    if rest in _LAYER_NAMES:
        yield prefix + _LAYER_NAMES[rest], t
    elif s := _STACKED_EXPERTS.fullmatch(rest):
        moe = f"{prefix}block_sparse_moe.experts."
        for e in range(t.shape[0]):
            part = GgufTensor(t.qtype, t.shape[1:], t.data[e])
            yield f"{moe}{e}.{_EXPERT_W[s.group(1)]}.weight", part
    elif s := _ONE_EXPERT.fullmatch(rest):
        yield f"{prefix}block_sparse_moe.experts.{s.group(2)}.{_EXPERT_W[s.group(1)]}.weight", t
    else:
        yield name, t


def _positive(f: GgufFile, key: str, default: int | None = None) -> int:
    value = f.arch_key(key, default, required=default is None)
    if isinstance(value, list):  # per-layer arrays (some converters); all equal here
        if not value or any(v != value[0] for v in value):
            raise ModelLoadError(f"{f.path}: '{f.arch}.{key}'={value!r} varies by layer")
        value = value[0]
    if not isinstance(value, (int, np.integer)) or int(value) <= 0:
        raise ModelLoadError(f"{f.path}: '{f.arch}.{key}'={value!r} must be a positive integer")
    return int(value)


def _freq_factors(f: GgufFile, head_dim: int) -> tuple[float, ...] | None:
    """rope_freqs.weight: per-frequency divisors (Llama 3.1's scaling, as llama.cpp keeps it)."""
    if not f.has_tensor(ROPE_FREQS):
        return None
    factors = f.tensor(ROPE_FREQS).dequantize().flatten().tolist()
    if len(factors) != head_dim // 2:
        raise ModelLoadError(
            f"{f.path}: tensor '{ROPE_FREQS}' has {len(factors)} factors; expected "
            f"head_dim / 2 = {head_dim // 2}"
        )
    return tuple(factors)


def _rope(f: GgufFile, context: int, head_dim: int) -> RopeSpec:
    theta = float(f.arch_key("rope.freq_base", 10000.0))
    kind = str(f.arch_key("rope.scaling.type", "none"))
    factors = _freq_factors(f, head_dim)
    if kind == "none":
        return RopeSpec(theta=theta, freq_factors=factors)
    if kind not in ("linear", "yarn"):
        raise ModelLoadError(
            f"{f.path}: '{f.arch}.rope.scaling.type'={kind!r} is not supported; "
            "supported: none, linear, yarn"
        )
    factor = float(f.arch_key("rope.scaling.factor", 1.0))
    original = f.arch_key("rope.scaling.original_context_length")
    return RopeSpec(
        theta=theta,
        rope_type=kind,
        factor=factor,
        original_max_position=int(original) if original is not None else context,
        freq_factors=factors,
    )


def _dtype(f: GgufFile) -> torch.dtype:
    """The model dtype a file suggests: its half type when it holds only floats; bf16 for
    quantized files (the loader picks fp32 on a CPU, as for presets)."""
    types = set(f.tensor_types())
    if types <= {"F32", "F16"} and "F16" in types:
        return torch.float16
    if types == {"F32"}:
        return torch.float32
    return torch.bfloat16


def _experts(f: GgufFile) -> tuple[int, int]:
    experts = int(f.arch_key("expert_count", 0) or 0)
    if not experts:
        return 0, 0
    if f.arch not in MOE_ARCHITECTURES:
        raise ModelLoadError(
            f"{f.path}: a mixture of experts in architecture {f.arch!r} is not supported; "
            "supported: llama (Mixtral), qwen3moe"
        )
    per_token = _positive(f, "expert_used_count")
    if per_token > experts:
        raise ModelLoadError(
            f"{f.path}: '{f.arch}.expert_used_count'={per_token} must be at most "
            f"expert_count={experts}"
        )
    return experts, per_token


def gguf_spec(f: GgufFile) -> ModelSpec:
    """ModelSpec from a GGUF's `{arch}.*` and tokenizer metadata."""
    if f.arch not in ARCHITECTURES:
        raise ModelLoadError(
            f"{f.path}: general.architecture={f.arch!r} is not supported; "
            f"supported: {sorted(ARCHITECTURES)}"
        )
    arch, family = ARCHITECTURES[f.arch]
    experts, per_token = _experts(f)
    if experts and f.arch == "llama":
        arch, family = "MixtralForCausalLM", "mixtral"
    if f.arch == "qwen3moe" and not experts:
        raise ModelLoadError(f"{f.path}: 'qwen3moe.expert_count' is required")
    hidden, heads = _positive(f, "embedding_length"), _positive(f, "attention.head_count")
    kv_heads = _positive(f, "attention.head_count_kv", heads)
    if heads % kv_heads:
        raise ModelLoadError(
            f"{f.path}: '{f.arch}.attention.head_count'={heads} must be a multiple of "
            f"head_count_kv={kv_heads}"
        )
    context = _positive(f, "context_length")
    head_dim = _positive(
        f, "attention.key_length", _positive(f, "rope.dimension_count", hidden // heads)
    )
    tokens = f.get("tokenizer.ggml.tokens")
    vocab = f.arch_key("vocab_size") or (len(tokens) if tokens else f.rows("token_embd.weight"))
    inter_key = "feed_forward_length"
    if family == "mixtral" and f.arch_key("expert_feed_forward_length"):
        inter_key = "expert_feed_forward_length"
    expert_ffn = _positive(f, "expert_feed_forward_length") if family == "qwen3_moe" else None
    eos = f.get("tokenizer.ggml.eos_token_id")
    spec = ModelSpec(
        architecture=arch,
        family=family,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=_positive(f, inter_key, expert_ffn),  # qwen3moe: no dense layer
        num_layers=_positive(f, "block_count"),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=context,
        rms_norm_eps=float(f.arch_key("attention.layer_norm_rms_epsilon", required=True)),
        rope=_rope(f, context, head_dim),
        tie_word_embeddings=not f.has_tensor("output.weight"),
        attention_bias=f.has_tensor("blk.0.attn_q.bias"),
        sliding_window=int(f.arch_key("attention.sliding_window", 0) or 0),
        num_local_experts=experts,
        num_experts_per_tok=per_token,
        dtype=_dtype(f),
        eos_token_ids=(int(eos),) if eos is not None else (),
        bos_token_id=f.get("tokenizer.ggml.bos_token_id"),
        name=str(f.path),
    )
    if family != "qwen3_moe":
        return spec
    # llama.cpp's qwen3moe: every layer routes experts, their top-k weights renormalised.
    return replace(
        spec,
        moe_intermediate_size=expert_ffn or 0,
        norm_topk_prob=True,
        qk_norm=True,
        router_weights_in_model_dtype=True,
    )
