"""Builders for tiny random Hugging Face checkpoints, and transformers reference outputs.

Everything is built locally (no hub): a BPE trained on an embedded corpus (Llama 3, Qwen2 or
Llama 2 style) and small Llama / Qwen2 / Mistral / Mixtral / Qwen2-MoE / Qwen3-MoE models with
seeded random weights, saved with `save_pretrained`. Engine tests load these directories and
compare their greedy tokens with `hf_greedy`.

Not a test module: conftest.py wires these builders into fixtures.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch
from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)
from tokenizers.models import BPE

BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"
TOKENIZER_VOCAB_SIZE = 448
# Llama 3's own template, minus the date/tool preamble of 3.1.
LLAMA3_CHAT_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
CHAT_TEMPLATE = LLAMA3_CHAT_TEMPLATE
# Qwen2's ChatML template.
QWEN2_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LLAMA2_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + message['content'] | trim + ' [/INST]' }}{% else %}"
    "{{ ' ' + message['content'] | trim + eos_token }}{% endif %}{% endfor %}"
)
# Qwen2's pre-tokenizer regex (digits one by one, case-insensitive contractions).
QWEN2_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
CORPUS = """\
The quick brown fox jumps over the lazy dog. A large language model predicts the next token
from the tokens before it. Inference servers batch many requests together so that the GPU stays
busy, while the CPU prepares the next batch and samples tokens from the logits. Attention looks
back over every earlier position; the key-value cache keeps those keys and values so that each
new token costs one forward step instead of a whole prompt. Rotary position embeddings rotate
queries and keys by an angle that grows with the position, and scaling the frequencies lets a
model read longer contexts than it was trained on. Grouped-query attention shares each key and
value head between several query heads to shrink the cache. In the morning the weather was
clear and cold; by the evening it was raining, and the streets were quiet. She said: "Numbers
like 3.14159, 2048 and 1,000,000 appear in text too!" Why? Because people write them, don't they?
def main(): return sum(x * x for x in range(10))  # code, too
Unicode: café, naïve, Zürich, São Paulo, Ελληνικά, русский язык, 日本語のテキスト, 中文文本,
한국어 문장, emoji 🙂 🚀 👍🏽 ❤️ and symbols ∑ ∞ ≈ → ✓.
"""

# Per-kind architecture. Sizes are tiny; the choices that matter are in the comments.
_KINDS: dict[str, dict[str, Any]] = {
    "llama3": {
        "model_type": "llama",
        "num_attention_heads": 4,
        "num_key_value_heads": 2,  # GQA
        "head_dim": 16,
        "tie_word_embeddings": True,
        "rms_norm_eps": 1e-5,
        # original_max_position_embeddings=64 puts the 8 frequencies of head_dim 16 into all
        # three llama3 bands (kept, smoothed, divided by 8), so test lengths exercise the scaling.
        "rope": {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    },
    "llama2_linear": {
        "model_type": "llama",
        "num_attention_heads": 4,
        "num_key_value_heads": 4,  # plain multi-head attention
        "head_dim": 16,
        "tie_word_embeddings": False,
        "rms_norm_eps": 1e-6,
        "rope": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    },
    "qwen2": {
        "model_type": "qwen2",  # q/k/v projections always carry a bias
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "tie_word_embeddings": True,
        "rms_norm_eps": 1e-6,
        "rope": {"rope_type": "default", "rope_theta": 1000000.0},
    },
    "mistral": {
        "model_type": "mistral",
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 32,  # != hidden_size / heads, as in Mistral-Nemo
        "tie_word_embeddings": False,
        "rms_norm_eps": 1e-5,
        "sliding_window": 16,  # each query sees itself and the 15 tokens before it
        "rope": {"rope_type": "default", "rope_theta": 1000000.0},
    },
    "mixtral": {
        "model_type": "mixtral",  # Mistral attention + a sparse MoE block per layer
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "tie_word_embeddings": False,
        "rms_norm_eps": 1e-5,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,  # top-2 of 4, renormalised
        "rope": {"rope_type": "default", "rope_theta": 1000000.0},
    },
    "qwen2_moe": {
        "model_type": "qwen2_moe",  # Qwen2 attention (qkv bias) + experts + a shared expert
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "tie_word_embeddings": False,
        "rms_norm_eps": 1e-6,
        "num_experts": 8,
        "num_experts_per_tok": 2,  # top-2 of 8, softmax probabilities as they are
        "norm_topk_prob": False,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 96,
        "rope": {"rope_type": "default", "rope_theta": 1000000.0},
    },
    "qwen3_moe": {
        "model_type": "qwen3_moe",  # q/k RMSNorm per head, no bias, experts only
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,  # != hidden_size / heads, as in Qwen3-30B-A3B (2048 / 32 = 64, not 128)
        "tie_word_embeddings": False,
        "rms_norm_eps": 1e-6,
        "num_experts": 8,
        "num_experts_per_tok": 2,  # top-2 of 8, renormalised
        "norm_topk_prob": True,
        "moe_intermediate_size": 32,
        "rope": {"rope_type": "default", "rope_theta": 1000000.0},
    },
    "deepseek_v2": {
        "model_type": "deepseek_v2",  # MLA, shared experts, grouped top-k, a dense first layer
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "tie_word_embeddings": False,
        "rms_norm_eps": 1e-6,
        "q_lora_rank": None,  # DeepSeek-V2-Lite's plain q_proj
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 24,
        "n_routed_experts": 8,
        "num_experts_per_tok": 3,
        "n_shared_experts": 2,
        "moe_intermediate_size": 32,
        "topk_method": "group_limited_greedy",  # the top 3 among the best 2 of 4 groups
        "n_group": 4,
        "topk_group": 2,
        "routed_scaling_factor": 1.5,
        "norm_topk_prob": False,
        "first_k_dense_replace": 1,
        "rope": {"rope_type": "default", "rope_theta": 10000.0},
    },
}
KINDS = tuple(_KINDS)
# With std 0.02 the tied-embedding models (llama3, qwen2) only repeat one token and the untied ones
# have flat logits (median top-1/top-2 gap 0.04); std 0.2 gives varied continuations with logit
# std ~1.6 and a median gap ~0.35 (5th percentile ~0.03), far above fp32 noise (~1e-5).
INITIALIZER_RANGE = 0.2
# qwen2 writes this window with use_sliding_window=false (as real Qwen2 configs do with 32768):
# transformers ignores it, so an engine that applies it fails the greedy comparison.
QWEN2_UNUSED_SLIDING_WINDOW = 16


def _byte_level_backend(style: str, vocab_size: int, specials: list[str]) -> Tokenizer:
    backend = Tokenizer(BPE())
    if style == "qwen2":
        backend.normalizer = normalizers.NFC()
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(QWEN2_REGEX), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator([CORPUS], trainer)
    # Special tokens follow the trained vocabulary, as in Llama 3 and Qwen2.
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    return backend


def _sentencepiece_backend(vocab_size: int) -> Tokenizer:
    """Llama-2 layout: <unk> <s> </s>, 256 byte-fallback tokens, then merges of "▁" words."""
    specials = ["<unk>", "<s>", "</s>"]
    backend = Tokenizer(BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    backend.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="never")  # training only
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials + [f"<0x{b:02X}>" for b in range(256)],
        show_progress=False,
    )
    backend.train_from_iterator([CORPUS], trainer)
    backend.pre_tokenizer = None
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    # Only the three control tokens are added tokens; the byte tokens are plain vocabulary.
    data = json.loads(backend.to_str())
    data["added_tokens"] = [t for t in data["added_tokens"] if t["content"] in specials]
    return Tokenizer.from_str(json.dumps(data))


# Per style: (special tokens of the trained BPE, special token kwargs, tokenizer_config patch,
# chat template). llama3 is the default; qwen2 is forced for model_type qwen2 because
# transformers 5 loads those with its Qwen2Tokenizer recipe whatever tokenizer_class says.
_STYLES: dict[str, tuple[list[str], dict[str, str], dict[str, Any], str]] = {
    "llama3": (
        [BOS, EOS, "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        {"bos_token": BOS, "eos_token": EOS},
        {},
        LLAMA3_CHAT_TEMPLATE,
    ),
    "qwen2": (
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
        {"tokenizer_class": "Qwen2Tokenizer", "bos_token": None, "unk_token": None},
        QWEN2_CHAT_TEMPLATE,
    ),
    "llama2": (
        [],
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"},
        {"tokenizer_class": "LlamaTokenizerFast", "add_bos_token": True, "legacy": False},
        LLAMA2_CHAT_TEMPLATE,
    ),
}
TOKENIZER_STYLES = tuple(_STYLES)


def build_tokenizer(
    directory: Path, style: str = "llama3", vocab_size: int = TOKENIZER_VOCAB_SIZE
) -> None:
    """Train a BPE on CORPUS and save it with transformers' save_pretrained.

    "llama3": byte-level, BOS from a TemplateProcessing post-processor, Llama 3 chat tokens.
    "qwen2": byte-level with Qwen2's regex and NFC, no BOS, ChatML tokens, Qwen2Tokenizer class.
    "llama2": SentencePiece-style (byte fallback, "▁"), <s> via post-processor, LlamaTokenizer.
    """
    from transformers import PreTrainedTokenizerFast

    specials, tokens, patch, template = _STYLES[style]
    if style == "llama2":
        backend = _sentencepiece_backend(vocab_size)
    else:
        backend = _byte_level_backend(style, vocab_size, specials)
    if "bos_token" in tokens:
        bos, bos_id = tokens["bos_token"], backend.token_to_id(tokens["bos_token"])
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
    else:
        backend.post_processor = processors.ByteLevel(trim_offsets=False)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=backend, **tokens)
    wrapped.chat_template = template
    wrapped.save_pretrained(str(directory))
    config_path = Path(directory) / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) | patch
    config_path.write_text(json.dumps(config, indent=2) + "\n")


def _tokenizer_ids(directory: Path) -> dict[str, Any]:
    """Vocabulary size and the ids config.json / generation_config.json refer to."""
    backend = Tokenizer.from_file(str(directory / "tokenizer.json"))
    config = json.loads((directory / "tokenizer_config.json").read_text())
    ids = {"vocab": backend.get_vocab_size(), "eos": backend.token_to_id(config["eos_token"])}
    if config.get("bos_token"):
        ids["bos"] = backend.token_to_id(config["bos_token"])
    # Further stop tokens of the real families: Llama 3.1's <|eot_id|>, Qwen's <|endoftext|>.
    for extra in ("<|eot_id|>", "<|endoftext|>"):
        if (token_id := backend.token_to_id(extra)) is not None:
            ids["stop"] = token_id
            ids.setdefault("bos", token_id)  # Qwen2 configs name <|endoftext|> as BOS
    ids.setdefault("bos", None)
    return ids


def _make_config(kind: str, ids: dict[str, int], overrides: dict[str, Any]) -> Any:
    from transformers import AutoConfig

    spec = copy.deepcopy(_KINDS[kind])
    model_type = spec.pop("model_type")
    rope = spec.pop("rope")
    kwargs: dict[str, Any] = {
        "vocab_size": ids["vocab"],
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "max_position_embeddings": 512,
        "initializer_range": INITIALIZER_RANGE,
        "bos_token_id": ids["bos"],
        "eos_token_id": ids["eos"],
        "rope_parameters": rope,
        **spec,
        **overrides,
    }
    return AutoConfig.for_model(model_type, **kwargs)


@torch.no_grad()
def _randomize(model: torch.nn.Module, std: float, seed: int) -> None:
    """Seeded N(0, std) for every matrix and bias, 1 + N(0, 0.1) for norm scales.

    transformers initializes biases to 0 and norms to 1, which would leave qwen2's qkv bias and the
    RMSNorm weights untested; drawing everything ourselves also keeps weights independent of
    transformers' init code across versions.
    """
    gen = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():  # tied weights are listed once
        if "norm" in name:
            param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))
        else:
            param.copy_(std * torch.randn(param.shape, generator=gen))


def _hub_style_config(path: Path, kind: str) -> None:
    """Rewrite config.json's rope fields the way real hub checkpoints store them.

    transformers 5 saves `rope_parameters` (theta inside); Llama 3.1, Qwen2 and Mistral on the hub
    carry top-level `rope_theta` plus `rope_scaling` (null, or a dict with `rope_type`, or the old
    `type` key for linear-scaled Llama 2 fine-tunes). transformers 5 reads both.
    """
    cfg = json.loads(path.read_text())
    rope = dict(cfg.pop("rope_parameters"))
    cfg["rope_theta"] = rope.pop("rope_theta")
    rope_type = rope.pop("rope_type")
    if rope_type == "default":
        cfg["rope_scaling"] = None
    elif rope_type == "linear":
        cfg["rope_scaling"] = {"type": "linear", **rope}
    else:
        cfg["rope_scaling"] = {"rope_type": rope_type, **rope}
    if kind in ("qwen2", "qwen2_moe", "qwen3_moe"):
        cfg.pop("layer_types", None)  # real Qwen2 configs derive it from use_sliding_window
        cfg["sliding_window"] = QWEN2_UNUSED_SLIDING_WINDOW
        cfg["use_sliding_window"] = False
    if "num_local_experts" in cfg and kind != "mixtral":  # Qwen's configs say num_experts
        cfg["num_experts"] = cfg.pop("num_local_experts")
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def _generation_config(kind: str, ids: dict[str, Any]) -> dict[str, Any]:
    config: dict[str, Any] = {"bos_token_id": ids["bos"], "eos_token_id": ids["eos"]}
    if kind in ("llama3", "qwen2") and "stop" in ids:  # several stop ids, as the real files
        config["eos_token_id"] = [ids["eos"], ids["stop"]]
    if kind == "llama3":  # Llama 3.1's sampling defaults
        config |= {"do_sample": True, "temperature": 0.6, "top_p": 0.9}
    if kind == "qwen2":  # Qwen2.5-Instruct pads with <|endoftext|>
        config["pad_token_id"] = ids.get("stop")
    return config


# Tokenizer style per kind when build_checkpoint is not told (see build_tokenizer).
DEFAULT_TOKENIZER_STYLE = {
    "llama3": "llama3",
    "llama2_linear": "llama3",
    "qwen2": "qwen2",
    "mistral": "llama3",
    "mixtral": "llama3",
    "qwen2_moe": "qwen2",
    "qwen3_moe": "qwen2",
    "deepseek_v2": "llama3",
}


def build_checkpoint(
    kind: str,
    directory: Path,
    *,
    dtype: torch.dtype = torch.float32,
    max_shard_size: str | None = None,
    seed: int = 0,
    config_style: str = "hub",
    tokenizer_style: str | None = None,
    **overrides: Any,
) -> Path:
    """Write a tiny random `kind` checkpoint (see KINDS) into `directory` and return it.

    config_style "hub" writes rope fields like real hub checkpoints; "v5" keeps transformers 5's
    `rope_parameters`. tokenizer_style defaults per kind (DEFAULT_TOKENIZER_STYLE). `overrides`
    are config kwargs (e.g. num_hidden_layers=3).
    """
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # save_pretrained's shard bar only clutters test output
    if kind not in _KINDS:
        raise ValueError(f"unknown checkpoint kind {kind!r}; expected one of {KINDS}")
    if config_style not in ("hub", "v5"):
        raise ValueError(f"config_style must be 'hub' or 'v5', got {config_style!r}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    build_tokenizer(directory, tokenizer_style or DEFAULT_TOKENIZER_STYLE[kind])
    ids = _tokenizer_ids(directory)
    config = _make_config(kind, ids, overrides)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, config.initializer_range, seed)
    model = model.to(dtype)
    save_kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(directory), **save_kwargs)
    if config_style == "hub":
        _hub_style_config(directory / "config.json", kind)
    generation = _generation_config(kind, ids)
    (directory / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return directory
