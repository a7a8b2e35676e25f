"""Synthetic presets: real model shapes with seeded random weights, for machines with no weights.

Every output that comes from a preset is labelled synthetic (ModelSpec.synthetic). Weights
are drawn directly on the target device, so an 8B model builds in seconds on a GPU.
"""

from __future__ import annotations

import difflib

import torch
from torch import nn

from hybridgen.experts.format import Alloc, Format, PackedMatrices, host_alloc
from hybridgen.experts.store import ExpertStore
from hybridgen.models.default_model import DEFAULT_MODEL
from hybridgen.models.dense_quant import WeightFormat
from hybridgen.models.errors import ModelLoadError, bad_model_path
from hybridgen.models.host_load import empty_split_model, keep_on_host
from hybridgen.models.llama import CausalLM, empty_model
from hybridgen.models.moe import SparseMoeBlock, moe_blocks
from hybridgen.models.spec import MlaSpec, ModelSpec, RopeSpec
from hybridgen.runtime.log import Progress

STD = 0.02
"""Standard deviation of every synthetic weight (norms are 1)."""

_LLAMA3_ROPE = RopeSpec(
    theta=500000.0,
    rope_type="llama3",
    factor=8.0,
    original_max_position=8192,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
)


def _spec(name: str, **kw: object) -> ModelSpec:
    defaults: dict[str, object] = dict(
        architecture="LlamaForCausalLM",
        family="llama",
        rms_norm_eps=1e-5,
        dtype=torch.bfloat16,
        synthetic=True,
        name=name,
    )
    defaults.update(kw)
    return ModelSpec(**defaults)  # type: ignore[arg-type]


def _mixtral(name: str, **kw: object) -> ModelSpec:
    """Mixtral's shape: 8 experts, top-2, 8 KV heads of 128, rope theta 1e6 (unless given)."""
    defaults: dict[str, object] = dict(
        architecture="MixtralForCausalLM",
        family="mixtral",
        num_kv_heads=8,
        head_dim=128,
        rope=RopeSpec(theta=1000000.0),
        num_local_experts=8,
        num_experts_per_tok=2,
        eos_token_ids=(257,),
        bos_token_id=256,
    )
    return _spec(name, **{**defaults, **kw})


def _qwen3_moe(name: str, **kw: object) -> ModelSpec:
    """Qwen3-MoE's shape: q/k RMSNorm, rope theta 1e6, top-8 renormalised, no shared expert."""
    defaults: dict[str, object] = dict(
        architecture="Qwen3MoeForCausalLM",
        family="qwen3_moe",
        rms_norm_eps=1e-6,
        rope=RopeSpec(theta=1000000.0),
        num_experts_per_tok=8,
        norm_topk_prob=True,
        qk_norm=True,
        router_weights_in_model_dtype=True,
        eos_token_ids=(257,),
        bos_token_id=256,
    )
    return _spec(name, **{**defaults, **kw})


def _deepseek_v2(name: str, mla: MlaSpec, **kw: object) -> ModelSpec:
    """DeepSeek-V2's shape: MLA (its latent and rope key cached as one KV head), shared
    experts beside the routed ones, a dense first layer, router weights never renormalised."""
    defaults: dict[str, object] = dict(
        architecture="DeepseekV2ForCausalLM",
        family="deepseek_v2",
        rms_norm_eps=1e-6,
        num_kv_heads=1,
        head_dim=mla.cache_dim,
        mla=mla,
        norm_topk_prob=False,
        shared_expert_gated=False,
        dense_layers=(0,),
        eos_token_ids=(257,),
        bos_token_id=256,
    )
    return _spec(name, **{**defaults, **kw})


PRESETS: dict[str, ModelSpec] = {
    "tiny-llama": _spec(
        "tiny-llama",
        vocab_size=512,
        hidden_size=128,
        intermediate_size=384,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        max_position_embeddings=4096,
        rope=RopeSpec(theta=10000.0),
        eos_token_ids=(257,),
        bos_token_id=256,
    ),
    "llama3-8b": _spec(
        "llama3-8b",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        max_position_embeddings=131072,
        rope=_LLAMA3_ROPE,
        eos_token_ids=(257,),
        bos_token_id=256,
    ),
    "llama3-70b": _spec(
        "llama3-70b",
        vocab_size=128256,
        hidden_size=8192,
        intermediate_size=28672,
        num_layers=80,
        num_heads=64,
        num_kv_heads=8,
        head_dim=128,
        max_position_embeddings=131072,
        rope=_LLAMA3_ROPE,
        eos_token_ids=(257,),
        bos_token_id=256,
    ),
    "qwen2-7b": _spec(
        "qwen2-7b",
        architecture="Qwen2ForCausalLM",
        family="qwen2",
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_layers=28,
        num_heads=28,
        num_kv_heads=4,
        head_dim=128,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        rope=RopeSpec(theta=1000000.0),
        attention_bias=True,
        eos_token_ids=(257,),
        bos_token_id=256,
    ),
    "mistral-7b": _spec(
        "mistral-7b",
        architecture="MistralForCausalLM",
        family="mistral",
        vocab_size=32768,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        max_position_embeddings=32768,
        rope=RopeSpec(theta=1000000.0),
        eos_token_ids=(257,),
        bos_token_id=256,
    ),
    "tiny-mixtral": _mixtral(
        "tiny-mixtral",
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_layers=4,
        num_heads=4,
        head_dim=32,
        num_kv_heads=2,
        max_position_embeddings=4096,
    ),
    "mixtral-8x7b": _mixtral(
        "mixtral-8x7b",
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        max_position_embeddings=32768,
    ),
    "mixtral-8x22b": _mixtral(
        "mixtral-8x22b",
        vocab_size=32768,
        hidden_size=6144,
        intermediate_size=16384,
        num_layers=56,
        num_heads=48,
        max_position_embeddings=65536,
    ),
    "tiny-qwen3-moe": _qwen3_moe(
        "tiny-qwen3-moe",
        vocab_size=512,
        hidden_size=128,
        intermediate_size=384,
        moe_intermediate_size=64,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        num_local_experts=16,
        num_experts_per_tok=4,
        max_position_embeddings=4096,
    ),
    "qwen3-30b-a3b": _qwen3_moe(
        "qwen3-30b-a3b",
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_layers=48,
        num_heads=32,
        num_kv_heads=4,
        head_dim=128,
        num_local_experts=128,
        max_position_embeddings=40960,
    ),
    "tiny-deepseek-v2": _deepseek_v2(
        "tiny-deepseek-v2",
        MlaSpec(
            q_lora_rank=48, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32
        ),
        vocab_size=512,
        hidden_size=128,
        intermediate_size=384,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=2 * 64,
        num_layers=4,
        num_heads=4,
        num_local_experts=16,
        num_experts_per_tok=4,
        expert_groups=4,
        topk_groups=2,
        routed_scaling_factor=1.5,
        max_position_embeddings=4096,
        rope=RopeSpec(theta=10000.0),
    ),
    "deepseek-v2-lite": _deepseek_v2(
        "deepseek-v2-lite",
        MlaSpec(
            q_lora_rank=0,
            kv_lora_rank=512,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
        ),
        vocab_size=102400,
        hidden_size=2048,
        intermediate_size=10944,
        moe_intermediate_size=1408,
        shared_expert_intermediate_size=2 * 1408,
        num_layers=27,
        num_heads=16,
        num_local_experts=64,
        num_experts_per_tok=6,
        max_position_embeddings=163840,
        rope=RopeSpec(
            theta=10000.0,
            rope_type="yarn",
            factor=40.0,
            original_max_position=4096,
            beta_fast=32.0,
            beta_slow=1.0,
            mscale=0.707,
            mscale_all_dim=0.707,
        ),
    ),
}


def parameters(spec: ModelSpec) -> list[tuple[str, int]]:
    """Each parameter of a model of `spec` and its element count, built on the meta device
    (no memory)."""
    with torch.device("meta"):
        net = CausalLM(spec)
    return [(name, p.numel()) for name, p in net.named_parameters()]


def parameter_count(spec: ModelSpec, experts: bool = True) -> int:
    """The parameters of a model of `spec`; `experts=False` leaves out the MoE experts,
    which Cold-Weights keeps in host memory."""
    return sum(n for name, n in parameters(spec) if experts or ".experts." not in name)


def preset_spec(name: str) -> ModelSpec:
    """The preset `name`; a ModelLoadError that says what was meant when there is none."""
    if name in PRESETS:
        return PRESETS[name]
    path_error = bad_model_path(name)
    if path_error is not None:
        raise path_error
    names = [DEFAULT_MODEL, *PRESETS]
    close = difflib.get_close_matches(name, names, n=1)
    hint = f"did you mean '{close[0]}'? " if close else ""
    raise ModelLoadError(
        f"model {name!r} is neither a checkpoint folder, a GGUF file nor a preset ({hint}"
        f"hybridgen models lists them: {', '.join(names)})"
    )


@torch.inference_mode()
def build_synthetic(
    spec: ModelSpec,
    device: torch.device,
    seed: int = 0,
    host_experts: Format | None = None,
    alloc: Alloc | None = None,
    host_from: int | None = None,
    host_format: WeightFormat = "native",
) -> CausalLM:
    """Seeded random weights, drawn on `device`; the same seed gives the same model.

    `host_experts`: MoE experts go straight into host ExpertStores in that format, in tensors
    from `alloc` (default: pinned on CUDA), each expert matrix drawn on `device` and converted
    on its own, so no full-precision copy of them is ever made (mixtral-8x22b's would be
    270 GB). The draws are the same, in the same order, as for experts on the device: native
    host experts are the same model. `host_from`: decoder layers from it on keep their
    projections in host memory, in `host_format`, drawn the same way (models/host_load.py)."""
    if host_from is not None:
        model = empty_split_model(spec, device, host_from, torch.device("meta"))
    else:
        model = empty_model(spec, device, torch.device("meta") if host_experts else None)
    gen = torch.Generator(device=device).manual_seed(seed)
    if host_experts is not None:
        alloc = alloc or host_alloc(device.type == "cuda")
        for block in moe_blocks(model):
            block.store = _empty_store(spec, host_experts, alloc)
    progress = Progress(
        "synthetic_weights", spec.num_layers, unit="layers", label="drawing weights"
    )
    for name, param in list(model.named_parameters()):
        if name.endswith(("layernorm", "_norm")) or name == "norm":  # q_norm, k_norm too
            param.fill_(1.0)
        elif param.is_meta and host_from is not None:  # a host layer's projection
            w = torch.empty(param.shape, dtype=spec.dtype, device=device)
            keep_on_host(model, name, w.normal_(0.0, STD, generator=gen), host_format)
        elif param.is_meta:  # layers.L.mlp.experts.E.{gate_up,down}_proj.weight, to the store
            _, layer, _, _, expert, proj, _ = name.split(".")
            w = torch.empty(param.shape, dtype=spec.dtype, device=device)
            w.normal_(0.0, STD, generator=gen)
            packed = PackedMatrices.pack(w[None], host_experts)  # type: ignore[arg-type]
            moe = model.layers[int(layer)].mlp
            assert isinstance(moe, SparseMoeBlock) and moe.store is not None
            store = moe.store
            stack = store.gate_up if proj == "gate_up_proj" else store.down
            stack.copy_(int(expert), packed, 0, non_blocking=False)
        else:
            param.normal_(0.0, STD, generator=gen)
        if name.startswith("layers."):  # parameters come layer by layer
            progress.update(int(name.split(".")[1]))
    progress.update(spec.num_layers)
    if host_experts is not None:  # the meta expert modules go: the stores hold the weights
        for block in moe_blocks(model):
            block.experts = nn.ModuleList()
    return model


def _empty_store(spec: ModelSpec, fmt: Format, alloc: Alloc) -> ExpertStore:
    """One layer's experts in `fmt`, in tensors from `alloc`, unfilled."""
    h, i, e = spec.hidden_size, spec.expert_size, spec.num_local_experts
    return ExpertStore(
        PackedMatrices.allocate(fmt, e, 2 * i, h, spec.dtype, alloc),
        PackedMatrices.allocate(fmt, e, h, i, spec.dtype, alloc),
    )
