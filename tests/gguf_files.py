"""Tiny GGUF files written with gguf.GGUFWriter from the tiny HF checkpoints (checkpoints.py),
as llama.cpp's converter writes them: ggml names, the llama architecture's q/k rows permuted,
Mixtral as llama with stacked experts, the tokenizer as `tokenizer.ggml.*` metadata.

gguf-py quantizes Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, BF16 and F16; Q4_K is encoded here from its
format (256-value super-blocks of eight 32-value groups, 6-bit scales and mins); Q5_K and Q6_K
get random blocks with sane fp16 super-scales (the file then holds other weights than the
checkpoint, so those compare against transformers reading the same file).

Not a test module.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from safetensors.torch import load_file

_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
}
QK_K = 256


def encode_q4_k(w: np.ndarray) -> np.ndarray:
    """float32 [rows, cols] (cols % 256 == 0) -> Q4_K blocks [rows, cols / 256 * 144] uint8:
    d, dmin (fp16), 12 bytes of 6-bit scales and mins, 128 bytes of nibbles; value =
    d * sc * q - dmin * m per 32-value group (ggml's block_q4_K)."""
    rows, cols = w.shape
    g = w.reshape(-1, 8, 32).astype(np.float32)  # [blocks, groups, 32]
    lo, hi = np.minimum(g.min(-1), 0), g.max(-1)
    scale, minus = (hi - lo) / 15, -lo  # per group: value = scale * q - minus
    d = (scale.max(-1) / 63).astype(np.float16)
    dmin = (minus.max(-1) / 63).astype(np.float16)
    d32, dmin32 = np.maximum(d.astype(np.float32), 1e-8), np.maximum(dmin.astype(np.float32), 1e-8)
    sc = np.clip(np.rint(scale / d32[:, None]), 0, 63).astype(np.uint8)
    m = np.clip(np.rint(minus / dmin32[:, None]), 0, 63).astype(np.uint8)
    eff_s = np.maximum(d.astype(np.float32)[:, None] * sc, 1e-12)
    eff_m = dmin.astype(np.float32)[:, None] * m
    q = np.clip(np.rint((g + eff_m[..., None]) / eff_s[..., None]), 0, 15).astype(np.uint8)
    packed = np.zeros((g.shape[0], 12), dtype=np.uint8)
    packed[:, 0:4] = (sc[:, 0:4] & 63) | ((sc[:, 4:8] >> 4) << 6)
    packed[:, 4:8] = (m[:, 0:4] & 63) | ((m[:, 4:8] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:8] & 15) | ((m[:, 4:8] & 15) << 4)
    pairs = q.reshape(-1, 4, 2, 32)  # 64-value chunks: groups 2j (low nibble), 2j+1 (high)
    qs = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(-1, 128)
    blocks = np.concatenate(
        [d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), packed, qs], axis=1
    )
    return blocks.reshape(rows, cols // QK_K * 144)


def random_k_blocks(qtype: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random Q5_K / Q6_K blocks whose fp16 super-scales are small and finite."""
    size = {"Q5_K": 176, "Q6_K": 210}[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows * cols // QK_K, size), dtype=np.uint8)
    scale = np.full((blocks.shape[0], 1), 0.002, dtype=np.float16).view(np.uint8)
    if qtype == "Q5_K":  # d, dmin first
        blocks[:, 0:2], blocks[:, 2:4] = scale, scale
    else:  # ql, qh, int8 scales, then d last
        blocks[:, -2:] = scale
    return blocks.reshape(rows, -1)


def llama3_rope_factors(cfg: dict[str, Any]) -> np.ndarray | None:
    """rope_freqs as llama.cpp's converter writes it for Llama 3.1 scaling (None without)."""
    scaling = cfg.get("rope_scaling") or {}
    if scaling.get("rope_type") != "llama3":
        return None
    dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    freqs = 1.0 / (cfg["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, old = scaling["factor"], scaling["original_max_position_embeddings"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    out = []
    for wavelen in 2 * np.pi / freqs:
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k permutation (HF's rotate-half pairs -> ggml's interleaved ones)."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def encode(w: np.ndarray, qtype: str, seed: int = 0) -> tuple[np.ndarray, Any]:
    """(data, raw ggml type) for add_tensor; 1-D tensors and F32 stay float32."""
    if qtype == "F32" or w.ndim == 1:
        return w.astype(np.float32), None
    kind = gguf.GGMLQuantizationType[qtype]
    if qtype == "F16":
        return w.astype(np.float16), None
    if qtype == "Q4_K":
        flat = w.reshape(-1, w.shape[-1])
        return encode_q4_k(flat).reshape(*w.shape[:-1], -1), kind
    if qtype in ("Q5_K", "Q6_K"):
        flat = random_k_blocks(qtype, int(np.prod(w.shape[:-1])), w.shape[-1], seed)
        return flat.reshape(*w.shape[:-1], -1), kind
    return gguf.quants.quantize(w.astype(np.float32), kind), kind


def roundtrip(w: torch.Tensor, qtype: str) -> torch.Tensor:
    """What a GGUF of type `qtype` holds for w, dequantized (the reference's weights)."""
    data, kind = encode(w.float().numpy(), qtype)
    if kind is None:
        return torch.from_numpy(data.astype(np.float32))
    return torch.from_numpy(gguf.quants.dequantize(data, kind).astype(np.float32))


def _tokenizer(writer: gguf.GGUFWriter, directory: Path, style: str) -> None:
    data = json.loads((directory / "tokenizer.json").read_text())
    config = json.loads((directory / "tokenizer_config.json").read_text())
    vocab = dict(data["model"]["vocab"])
    added = {t["content"]: t["id"] for t in data["added_tokens"]}
    vocab.update(added)
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {
        t for t in added if t in {s["content"] for s in data["added_tokens"] if s["special"]}
    }
    if style == "llama":
        writer.add_tokenizer_model("llama")
        writer.add_token_scores([-float(i) for i in range(len(tokens))])
        byte = {f"<0x{b:02X}>" for b in range(256)}
        writer.add_token_types([3 if t in special else 6 if t in byte else 1 for t in tokens])
    else:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("qwen2" if style == "qwen2" else "default")
        merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
        writer.add_token_merges(merges)
        writer.add_token_types([3 if t in special else 1 for t in tokens])
    writer.add_token_list(tokens)
    for key, add in (
        ("bos_token", writer.add_bos_token_id),
        ("eos_token", writer.add_eos_token_id),
    ):
        if config.get(key):
            add(vocab[config[key]])
    writer.add_add_bos_token(style == "llama")
    template = directory / "chat_template.jinja"
    if template.exists():
        writer.add_chat_template(template.read_text())


def _metadata(writer: gguf.GGUFWriter, cfg: dict[str, Any], experts: int, scaling: bool) -> None:
    heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(cfg.get("num_key_value_heads") or heads)
    writer.add_key_length(cfg.get("head_dim") or hidden // heads)
    writer.add_value_length(cfg.get("head_dim") or hidden // heads)
    writer.add_rope_dimension_count(cfg.get("head_dim") or hidden // heads)
    writer.add_rope_freq_base(float(cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"]))
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    rope = cfg.get("rope_scaling") or {}
    if scaling and rope.get("type", rope.get("rope_type")) == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["factor"]))
    writer.add_vocab_size(cfg["vocab_size"])
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(cfg["num_experts_per_tok"])
    if "moe_intermediate_size" in cfg:
        writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])


def _ggml_tensors(
    state: dict[str, torch.Tensor], cfg: dict[str, Any], arch: str
) -> dict[str, np.ndarray]:
    """HF tensors -> ggml-named float32 arrays (q/k permuted for llama; experts stacked)."""
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    out: dict[str, np.ndarray] = {}
    experts: dict[str, dict[int, np.ndarray]] = {}
    for name, t in state.items():
        w = t.float().numpy()
        if name in _NAMES:
            out[_NAMES[name]] = w
            continue
        _, _, layer, rest = name.split(".", 3)
        if rest.startswith(("block_sparse_moe.experts.", "mlp.experts.")) and rest.endswith(
            ".weight"
        ):  # save_pretrained: one per expert (Mixtral's w1 w3 w2, Qwen's gate/up/down_proj)
            _, _, e, which, _ = rest.split(".")
            kind = {"w1": "gate", "w3": "up", "w2": "down"}.get(which, which.removesuffix("_proj"))
            experts.setdefault(f"blk.{layer}.ffn_{kind}_exps.weight", {})[int(e)] = w
            continue
        rest = rest.replace("block_sparse_moe.gate.", "mlp.gate.")
        if rest.startswith("mlp.experts."):  # transformers 5: gate_up [E, 2I, H], down [E, H, I]
            if rest.endswith("gate_up_proj"):
                gate, up = np.split(w, 2, axis=1)
                out[f"blk.{layer}.ffn_gate_exps.weight"] = gate
                out[f"blk.{layer}.ffn_up_exps.weight"] = up
            else:
                out[f"blk.{layer}.ffn_down_exps.weight"] = w
            continue
        if arch == "llama" and rest.startswith(("self_attn.q_proj", "self_attn.k_proj")):
            w = _permute(w, heads if "q_proj" in rest else kv_heads)
        out[f"blk.{layer}.{_LAYER_NAMES[rest]}"] = w
    for name, per_expert in experts.items():  # llama.cpp stacks them: [E, out, in]
        out[name] = np.stack([per_expert[e] for e in sorted(per_expert)])
    return out


def write_gguf(
    directory: Path,
    out: Path,
    qtype: str = "F32",
    types: dict[str, str] | None = None,
    scaling: bool = False,
) -> Path:
    """A GGUF of the HF checkpoint in `directory`: matrices in `qtype` (or `types[ggml name
    suffix]`, e.g. {"attn_q.weight": "Q5_K"}), vectors in F32. `scaling`: the checkpoint's
    rope scaling too (linear as metadata, llama3 as rope_freqs), which transformers' GGUF
    reader ignores: only for comparisons against the checkpoint itself."""
    cfg = json.loads((directory / "config.json").read_text())
    model_type = cfg["model_type"]
    arch = {"qwen2": "qwen2", "qwen3_moe": "qwen3moe"}.get(model_type, "llama")
    experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
    state = load_file(str(directory / "model.safetensors"))
    if cfg.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_name(f"tiny-{model_type}")
    _metadata(writer, cfg, experts, scaling)
    style = "qwen2" if model_type in ("qwen2", "qwen3_moe") else "gpt2"
    if "<0x00>" in (directory / "tokenizer.json").read_text():  # SentencePiece-style
        style = "llama"
    _tokenizer(writer, directory, style)
    factors = llama3_rope_factors(cfg) if scaling else None
    if factors is not None:
        writer.add_tensor("rope_freqs.weight", factors)
    for i, (name, w) in enumerate(_ggml_tensors(state, cfg, arch).items()):
        kind = next((t for suffix, t in (types or {}).items() if name.endswith(suffix)), qtype)
        data, raw = encode(w, kind, seed=i)
        writer.add_tensor(name, data, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
