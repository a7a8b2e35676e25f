"""Load a model from an HF checkpoint directory, a GGUF file or a synthetic preset.

HF tensors are copied one at a time straight into the (fused) parameters on the target
device, so peak host memory is one tensor, not one model. A GGUF file's tensors come the same
way, dequantized one at a time under their HF names (gguf_file.py).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

import structlog
import torch
from safetensors import safe_open

from hybridgen.experts.arena import ExpertArena, arena_bytes
from hybridgen.experts.format import Format, host_alloc, unsupported
from hybridgen.models.default_model import resolve_model
from hybridgen.models.dense_quant import (
    QuantWeight,
    WeightFormat,
    choose_gemv,
    from_gguf_blocks,
    quantize_dense,
)
from hybridgen.models.errors import ModelLoadError
from hybridgen.models.generation_config import GenerationDefaults, load_generation_defaults
from hybridgen.models.gguf_file import GgufFile
from hybridgen.models.gguf_reader import is_gguf
from hybridgen.models.host_layers import offload_layers
from hybridgen.models.host_load import empty_split_model
from hybridgen.models.llama import CausalLM, empty_model
from hybridgen.models.moe import moe_blocks
from hybridgen.models.presets import build_synthetic, preset_spec
from hybridgen.models.spec import ModelSpec, parse_config
from hybridgen.models.tokenizer import Tokenizer
from hybridgen.models.tokenizer_source import load_tokenizer
from hybridgen.runtime.log import Progress

log = structlog.get_logger()

_LAYER_KEY = re.compile(r"model\.layers\.(\d+)\.(.+)")
# Mixtral (w1 w3 w2) and Qwen-MoE (gate_proj up_proj down_proj) as save_pretrained writes them
# (every transformers version): one tensor per expert.
_EXPERT_KEY = re.compile(r"experts\.(\d+)\.(w[123]|gate_proj|up_proj|down_proj)\.weight")
# Qwen2-MoE's shared expert and DeepSeek-V2's shared experts, a dense MLP beside the routed ones.
_SHARED_KEY = re.compile(r"shared_experts?\.(gate_proj|up_proj|down_proj)\.weight")
# DeepSeek-V2's multi-head latent attention (mla.py): its projections and its two norms.
_MLA_KEY = re.compile(
    r"self_attn\.(q_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj|"
    r"q_a_layernorm|kv_a_layernorm)\.weight"
)
# transformers 5's in-memory layout, all experts in one tensor: gate_up [E, 2I, H], down [E, H, I].
_FUSED_EXPERTS_KEY = re.compile(r"(model\.layers\.\d+)\.mlp\.experts\.(gate_up_proj|down_proj)")
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


@dataclass
class LoadedModel:
    """A model on its device with everything needed to serve it."""

    model: CausalLM
    spec: ModelSpec
    tokenizer: Tokenizer
    generation: GenerationDefaults
    expert_arena: ExpertArena | None = None
    """Cold-Weights experts in shared memory, for the CPU daemon (expert_arena.py)."""


def _target(spec: ModelSpec, key: str) -> tuple[str, int, int] | None:
    """HF tensor name -> (our parameter name, first row, last row) of the fused parameter;
    last row -1 means the whole parameter."""
    q, kv, inter = spec.q_size, spec.kv_size, spec.intermediate_size
    if key == "model.embed_tokens.weight":
        return "embed_tokens.weight", 0, spec.vocab_size
    if key == "model.norm.weight":
        return "norm", 0, spec.hidden_size
    if key == "lm_head.weight":
        return None if spec.tie_word_embeddings else ("lm_head.weight", 0, spec.vocab_size)
    m = _LAYER_KEY.fullmatch(key)
    if not m:
        return None
    prefix, rest = f"layers.{m.group(1)}.", m.group(2)
    if spec.is_moe_layer(int(m.group(1))) and rest.startswith(("block_sparse_moe.", "mlp.")):
        return _expert_target(spec, prefix, rest.split(".", 1)[1])
    if spec.mla is not None and rest.startswith("self_attn."):
        return _mla_target(spec, prefix, rest)
    fused = {
        "self_attn.q_proj": ("self_attn.qkv_proj", 0, q),
        "self_attn.k_proj": ("self_attn.qkv_proj", q, q + kv),
        "self_attn.v_proj": ("self_attn.qkv_proj", q + kv, q + 2 * kv),
        "mlp.gate_proj": ("mlp.gate_up_proj", 0, inter),
        "mlp.up_proj": ("mlp.gate_up_proj", inter, 2 * inter),
    }
    module, _, kind = rest.rpartition(".")
    if module in fused:
        name, lo, hi = fused[module]
        return f"{prefix}{name}.{kind}", lo, hi
    if rest in ("input_layernorm.weight", "post_attention_layernorm.weight"):
        return prefix + rest.removesuffix(".weight"), 0, spec.hidden_size
    if spec.qk_norm and rest in ("self_attn.q_norm.weight", "self_attn.k_norm.weight"):
        return prefix + rest.removesuffix(".weight"), 0, spec.head_dim
    if rest in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
        return prefix + rest, 0, -1
    return None


def _mla_target(spec: ModelSpec, prefix: str, rest: str) -> tuple[str, int, int] | None:
    """An MLA layer's attention tensor -> the parameter of the same name (a norm's without
    `.weight`); q_proj only without q_lora_rank, q_a_* and q_b_proj only with it."""
    assert spec.mla is not None
    m = _MLA_KEY.fullmatch(rest)
    if m is None:
        return None
    lora = bool(spec.mla.q_lora_rank)
    if (m.group(1) == "q_proj" and lora) or (m.group(1).startswith("q_a") and not lora):
        return None
    if m.group(1) == "q_b_proj" and not lora:
        return None
    if m.group(1).endswith("layernorm"):
        return prefix + rest.removesuffix(".weight"), 0, -1
    return prefix + rest, 0, -1


def _expert_target(spec: ModelSpec, prefix: str, rest: str) -> tuple[str, int, int] | None:
    """A MoE layer's MLP tensor (name after `block_sparse_moe.` or `mlp.`): the router, one
    expert's w1 / gate_proj, w3 / up_proj or w2 / down_proj, or the shared expert's and its
    gate's."""
    shared = spec.shared_expert_intermediate_size
    gated = shared and spec.shared_expert_gated
    if rest == "gate.weight" or (gated and rest == "shared_expert_gate.weight"):
        return f"{prefix}mlp.{rest}", 0, -1
    m = _EXPERT_KEY.fullmatch(rest)
    if m and int(m.group(1)) < spec.num_local_experts:
        return _mlp_part(f"{prefix}mlp.experts.{m.group(1)}.", m.group(2), spec.expert_size)
    m = _SHARED_KEY.fullmatch(rest)
    if m and shared:
        return _mlp_part(f"{prefix}mlp.shared_expert.", m.group(1), shared)
    return None


def _mlp_part(module: str, part: str, width: int) -> tuple[str, int, int]:
    """One of a SwiGLU's three HF matrices (Mixtral's or Llama's name) -> its fused target."""
    return {
        "w1": (f"{module}gate_up_proj.weight", 0, width),
        "gate_proj": (f"{module}gate_up_proj.weight", 0, width),
        "w3": (f"{module}gate_up_proj.weight", width, 2 * width),
        "up_proj": (f"{module}gate_up_proj.weight", width, 2 * width),
        "w2": (f"{module}down_proj.weight", 0, -1),
        "down_proj": (f"{module}down_proj.weight", 0, -1),
    }[part]


def _split_fused_experts(
    tensors: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """transformers 5's stacked expert tensors -> the per-expert names save_pretrained writes."""
    for key, src in tensors:
        m = _FUSED_EXPERTS_KEY.fullmatch(key)
        if m is None:
            yield key, src
            continue
        base = f"{m.group(1)}.block_sparse_moe.experts."
        for e, weight in enumerate(src):  # [2I, H] or [H, I] per expert
            if m.group(2) == "down_proj":
                yield f"{base}{e}.w2.weight", weight
            else:
                gate, up = weight.chunk(2)
                yield f"{base}{e}.w1.weight", gate
                yield f"{base}{e}.w3.weight", up


def hf_tensor_names(spec: ModelSpec) -> list[str]:
    """The HF names of every tensor of a checkpoint with this spec."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not spec.tie_word_embeddings:
        names.append("lm_head.weight")
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        names += _attention_names(spec, p)
        if spec.attention_bias:
            names += [p + f"self_attn.{x}_proj.bias" for x in "qkv"]
        if spec.qk_norm:
            names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
        names += _mlp_names(spec, i, p)
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
    return names


def _attention_names(spec: ModelSpec, p: str) -> list[str]:
    """The HF names of a layer's attention projections (and MLA's norms), prefix `p`."""
    if spec.mla is None:
        return [p + f"self_attn.{x}_proj.weight" for x in "qkvo"]
    q = ["q_a_proj", "q_a_layernorm", "q_b_proj"] if spec.mla.q_lora_rank else ["q_proj"]
    parts = [*q, "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj"]
    return [f"{p}self_attn.{x}.weight" for x in parts]


def _mlp_names(spec: ModelSpec, layer: int, p: str) -> list[str]:
    """The HF names of layer `layer`'s MLP or MoE block (prefix `p`)."""
    swiglu = [f"{x}_proj.weight" for x in ("gate", "up", "down")]
    if not spec.is_moe_layer(layer):
        return [f"{p}mlp.{w}" for w in swiglu]
    if spec.family == "mixtral":
        moe, swiglu = p + "block_sparse_moe.", [f"{w}.weight" for w in ("w1", "w2", "w3")]
    else:
        moe = p + "mlp."
    names = [moe + "gate.weight"]
    for e in range(spec.num_local_experts):
        names += [f"{moe}experts.{e}.{w}" for w in swiglu]
    if spec.shared_expert_intermediate_size and spec.shared_expert_gated:
        names += [f"{moe}shared_expert.{w}" for w in swiglu] + [moe + "shared_expert_gate.weight"]
    elif spec.shared_expert_intermediate_size:  # DeepSeek-V2's, ungated
        names += [f"{moe}shared_experts.{w}" for w in swiglu]
    return names


def to_hf_state_dict(model: CausalLM) -> dict[str, torch.Tensor]:
    """Our weights under HF names (views into the fused parameters, no copies)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    out = {}
    for key in hf_tensor_names(model.spec):
        target = _target(model.spec, key)
        assert target is not None, key
        name, lo, hi = target
        out[key] = params[name].detach() if hi < 0 else params[name].detach()[lo:hi]
    return out


def _shard_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ModelLoadError(f"{index}: invalid index ({e}); expected a 'weight_map'") from None
        files = [path / f for f in sorted(set(weight_map.values()))]
    elif (path / "model.safetensors").exists():
        files = [path / "model.safetensors"]
    else:
        raise ModelLoadError(
            f"{path}: no weights found; expected model.safetensors or model.safetensors.index.json"
        )
    for f in files:
        if not f.exists():
            raise ModelLoadError(f"{f} is listed in the index but missing")
    return files


def checkpoint_tensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a safetensors checkpoint, one at a time, with progress."""
    files = _shard_files(path)
    total = 0
    for f in files:
        with safe_open(f, framework="pt") as shard:
            total += len(shard.keys())
    progress, done = Progress("loading_weights", total, unit="tensors"), 0
    for f in files:
        with safe_open(f, framework="pt", device="cpu") as shard:
            for key in shard.keys():  # noqa: SIM118 - safe_open is not a dict
                done += 1
                progress.update(done, file=f.name)
                yield key, shard.get_tensor(key)


@torch.inference_mode()
def copy_weights(model: CausalLM, tensors: Iterable[tuple[str, torch.Tensor]], source: str) -> None:
    """Copy HF-named tensors into the fused parameters; fail on a missing or misshapen one."""
    spec = model.spec
    params = dict(model.named_parameters(remove_duplicate=False))
    filled: dict[str, int] = {}
    for key, src in _split_fused_experts(tensors):
        target = _target(spec, key)
        if target is None:
            if _IGNORED.fullmatch(key) or key == "lm_head.weight":
                continue
            raise ModelLoadError(f"{source}: unexpected tensor '{key}' for {spec.architecture}")
        name, lo, hi = target
        dest = params[name] if hi < 0 else params[name][lo:hi]
        if src.shape != dest.shape:
            raise ModelLoadError(
                f"{source}: tensor '{key}' has shape {tuple(src.shape)}, "
                f"expected {tuple(dest.shape)} from config.json"
            )
        dest.copy_(src)
        filled[name] = filled.get(name, 0) + dest.numel()
    missing = [n for n, p in model.named_parameters() if filled.get(n, 0) != p.numel()]
    if missing:
        raise ModelLoadError(f"{source}: checkpoint lacks tensors for {missing[:5]}")


def gguf_tensors(f: GgufFile, spec: ModelSpec) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a GGUF file under its HF name, dequantized to fp32, with progress."""
    progress = Progress("loading_weights", sum(f.tensor_types().values()), unit="tensors")
    for done, (name, tensor) in enumerate(f.tensors(spec), 1):
        progress.update(min(done, progress.total), file=f.path.name)
        yield name, tensor.dequantize()


def gguf_stored(f: GgufFile, spec: ModelSpec) -> dict[str, QuantWeight]:
    """The file's Q8_0 / Q4_0 / Q4_1 matrices repacked for QuantLinear, by HF name."""
    out = {}
    for name, tensor in f.tensors(spec):
        if len(tensor.shape) == 2 and (packed := from_gguf_blocks(tensor.qtype, tensor.data)):
            out[name] = packed
    return out


def open_gguf(model: str) -> GgufFile:
    """The GGUF file `model`, checked (its container is read once per process: read_gguf)."""
    return GgufFile(model)


def model_spec(model: str) -> ModelSpec:
    """The shape of `model` (a checkpoint directory's config.json, a GGUF file's metadata, or
    a preset), unloaded."""
    model = resolve_model(model)
    path = Path(model)
    if path.is_dir():
        return parse_config(path / "config.json")
    return open_gguf(model).spec() if is_gguf(model) else preset_spec(model)


def load_model(
    model: str,
    device: torch.device,
    dtype: torch.dtype | None = None,
    seed: int = 0,
    host_experts: Format | None = None,
    shm_instance: str | None = None,
    weights: WeightFormat = "native",
    gpu_layers: int | Literal["auto"] | None = None,
) -> LoadedModel:
    """`model` is a checkpoint directory, a GGUF file or a preset name (see presets.PRESETS).
    `host_experts`: MoE expert weights stay in host memory in that format, each block's
    ExpertStore (Cold-Weights), converted here layer by layer (presets draw them in it
    directly): in the instance's shared expert arena when `shm_instance` is given (the CPU
    daemon computes with them), else in pinned memory on CUDA. Everything else goes to
    `device`. `weights` int8 / int4: the dense projections become QuantLinear
    (dense_quant.py), a GGUF's Q8_0 / Q4_0 / Q4_1 blocks repacked as they are.
    `gpu_layers` (a dense model's weights.gpu_layers): the layers past it load straight into
    host memory (models/host_load.py; auto: every layer, the engine sizes the split)."""
    model = resolve_model(model)
    path = Path(model)
    spec = model_spec(model)
    if host_experts is not None and spec.num_local_experts:
        why = unsupported(host_experts, spec.hidden_size, spec.expert_size)
        if why is not None:
            raise ModelLoadError(f"cold_weights.expert_format={host_experts!r}: {why}; use int8")
    arena = None
    alloc = host_alloc(device.type == "cuda")
    if host_experts is not None and shm_instance is not None and spec.num_local_experts:
        arena = ExpertArena.create(
            shm_instance, arena_bytes(spec, host_experts, spec.moe_layer_count)
        )
        alloc = arena.alloc
    host_from = _host_from(spec, gpu_layers)
    if path.is_dir():
        tokenizer = load_tokenizer(model)
        spec = replace(spec, dtype=dtype or spec.dtype)
        net = _empty(spec, device, host_experts, host_from)
        copy_weights(net, checkpoint_tensors(path), str(path))
        generation = load_generation_defaults(path, tokenizer.eos_token_id)
    elif is_gguf(model):
        # Quantized files are dequantized to the model dtype: bf16 on a GPU, fp32 on a CPU.
        spec = replace(
            spec, dtype=dtype or (spec.dtype if device.type == "cuda" else torch.float32)
        )
        net = _empty(spec, device, host_experts, host_from)
        copy_weights(net, gguf_tensors(open_gguf(model), spec), model)
        tokenizer = load_tokenizer(model)
        generation = GenerationDefaults(
            eos_token_ids=spec.eos_token_ids, bos_token_id=spec.bos_token_id
        )
    else:
        preset_dtype = spec.dtype if device.type == "cuda" else torch.float32
        spec = replace(spec, dtype=dtype or preset_dtype)
        net = build_synthetic(spec, device, seed, host_experts, alloc, host_from, weights)
        tokenizer = load_tokenizer(model)
        generation = GenerationDefaults(eos_token_ids=spec.eos_token_ids)
    if weights != "native":
        stored = gguf_stored(open_gguf(model), spec) if is_gguf(model) else None
        quantize_dense(net, weights, stored, device)
    if host_from is not None:
        net.host_layers = offload_layers(net.layers, host_from, "stream", device, spec.dtype)
        if net.host_layers is not None:
            net.host_layers.resolved = gpu_layers != "auto"
    if weights == "int4" and device.type == "cuda":
        for (n, k, group), (kernel, times) in choose_gemv(net, spec.dtype).items():
            us = {name: round(s * 1e6, 1) for name, s in times.items()}
            log.info("int4_gemv_chosen", n=n, k=k, group=group, kernel=kernel, pass_us=us)
    if host_experts is not None:
        blocks = moe_blocks(net)
        progress = Progress(
            "experts_to_host", len(blocks), unit="layers", label="converting experts"
        )
        for i, block in enumerate(blocks):
            if block.store is None:  # a checkpoint's: native, then converted
                block.store = block.experts_to_host().convert(host_experts, alloc)
            if arena is not None:
                arena.record(block.store)
            progress.update(i + 1, format=host_experts)
        if arena is not None:
            arena.publish(device)
    return LoadedModel(net.eval(), spec, tokenizer, generation, arena)


def _host_from(spec: ModelSpec, gpu_layers: int | Literal["auto"] | None) -> int | None:
    """The first layer to load into host memory for weights.gpu_layers; None: load whole
    (unset, a MoE model or a value out of range: the engine names the error)."""
    if gpu_layers is None or spec.num_local_experts:
        return None
    if gpu_layers == "auto":
        return 0
    return gpu_layers if 0 <= gpu_layers < spec.num_layers else None


def _empty(
    spec: ModelSpec, device: torch.device, host_experts: Format | None, host_from: int | None
) -> CausalLM:
    """The checkpoint's empty model: its host layers' projections on the CPU."""
    if host_from is not None:
        return empty_split_model(spec, device, host_from, torch.device("cpu"))
    return empty_model(spec, device, torch.device("cpu") if host_experts else None)
