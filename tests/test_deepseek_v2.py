"""DeepSeek-V2 against HF transformers on tiny random checkpoints (CPU, fp32): greedy tokens
through the engine, resident and with the experts in host memory and a small device cache;
MLA's pieces (the interleaved rope, the latent cache write, one cached tensor for K and V);
the MoE block with its grouped routing alone; what the configs may say; the presets.

The tiny checkpoint (tests/checkpoints.py "deepseek_v2"): 3 layers, the first dense
(first_k_dense_replace 1); MLA with a plain q_proj (V2-Lite's), kv_lora_rank 32, nope 16,
rope 8, v 24 (so v != nope, which a mixed-up kv_b_proj split would not survive); 8 routed
experts top-3 among the best 2 of 4 groups (group_limited_greedy), weights times 1.5, and
2 shared experts (one MLP of 64).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from hybridgen.config.engine import ConfigError, EngineConfig
from hybridgen.engine.engine import Engine
from hybridgen.engine.moe_graphs import MoeDecodeGraphs
from hybridgen.engine.startup import place_moe_gate
from hybridgen.kernels import reference
from hybridgen.models.deepseek_moe import DeepseekMoeBlock
from hybridgen.models.errors import ModelLoadError
from hybridgen.models.loader import load_model, to_hf_state_dict
from hybridgen.models.mla import rope_interleaved, write_latent
from hybridgen.models.presets import parameter_count, preset_spec
from hybridgen.models.rope import rope_tables
from hybridgen.models.spec import RopeSpec, parse_config
from hybridgen.sampling.params import SamplingParams
from tests.hf_reference import hf_greedy, hf_model, sample_prompts

NEW_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
SLOTS = 4
"""Device cache slots: a quarter of the 16 (layer, expert) pairs of the tiny checkpoint."""
Q_LORA = {"q_lora_rank": 24, "topk_method": "greedy"}
"""DeepSeek-V2's (not -Lite's) low-rank query, and plain top-k over all experts."""
YARN = {
    "rope_parameters": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 128,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
    }
}
"""V2-Lite's rope scaling (yarn with DeepSeek's mscale), at a toy context."""


def _cold(path: Path | str, **kw: Any) -> Engine:
    config = EngineConfig(
        model=str(path), device="cpu", expert_cache_slots=SLOTS, expert_cpu_max_tokens=1, **kw
    )
    return Engine(config)


@pytest.mark.slow
@pytest.mark.parametrize("options", [{}, Q_LORA, YARN], ids=["lite", "q_lora", "yarn"])
def test_greedy_matches_hf(checkpoint, options: dict[str, Any]) -> None:  # type: ignore[no-untyped-def]
    """Three prompts batched, resident and then with the experts in host memory (native) and
    4 device slots: HF's greedy tokens both ways."""
    path = checkpoint("deepseek_v2", **options)
    prompts = sample_prompts(path, 3, [7, 29, 83])
    expected = hf_greedy(path, prompts, NEW_TOKENS)
    resident = Engine(EngineConfig(model=str(path), device="cpu"))
    assert [c.token_ids for c in resident.generate(prompts, GREEDY)] == expected
    engine = _cold(path)
    assert [c.token_ids for c in engine.generate(prompts, GREEDY)] == expected
    stats = engine.moe_stats()
    assert stats["cpu_experts"] > 0 and stats["cache_misses"] > 0 and stats["cache_hits"] > 0
    blocks = [m for m in engine.loaded.model.modules() if isinstance(m, DeepseekMoeBlock)]
    assert len(blocks) == 2 and all(b.store is not None and len(b.experts) == 0 for b in blocks)
    # The shared experts are dense and ungated: they stay on the device, beside the router.
    assert all(b.shared_expert is not None and b.shared_expert_gate is None for b in blocks)


def test_rope_is_hfs_interleaved_rotation() -> None:
    """DeepSeek's rope turns adjacent channel pairs (HF: complex multiplication); with yarn
    the tables carry the attention factor. A NeoX (rotate-half) rotation misses it."""
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import apply_rotary_emb

    dim, positions = 8, torch.tensor([0, 3, 17, 100])
    rope = RopeSpec(10000.0, "yarn", 4.0, 128, mscale=0.707, mscale_all_dim=1.0)
    cos, sin = rope_tables(rope, dim, 512, 128)
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(4, 3, dim, generator=gen), torch.randn(4, 1, dim, generator=gen)
    # HF's freqs_cis from the same tables: angle and length (the yarn attention factor).
    c, s = cos[positions, : dim // 2], sin[positions, : dim // 2]
    freqs_cis = torch.polar(torch.hypot(c, s), torch.atan2(s, c))
    hf_q, hf_k = apply_rotary_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], freqs_cis[None])
    torch.testing.assert_close(rope_interleaved(q, positions, cos, sin), hf_q[0].transpose(0, 1))
    torch.testing.assert_close(rope_interleaved(k, positions, cos, sin), hf_k[0].transpose(0, 1))
    neox = q.clone()
    reference._rope(neox, k.clone(), positions, cos, sin)
    assert not torch.allclose(neox, hf_q[0].transpose(0, 1), atol=1e-3)


@pytest.mark.parametrize(
    "slots",
    [[5, -1, 0, 63, -1], [-1, -1], [12], [-1, 7]],
    ids=["mixed", "none", "one", "padding-first"],
)
def test_write_latent_writes_what_the_reference_writes(slots: list[int]) -> None:
    """The graph-safe latent write leaves the cache exactly as the reference's masked write:
    skipped rows change nothing, even when they are routed onto a written slot."""
    gen = torch.Generator().manual_seed(1)
    cache = torch.randn(4, 16, 1, 12, generator=gen)
    key = torch.randn(len(slots), 1, 12, generator=gen)
    expected = cache.clone()
    reference.write_kv_cache(key, key, expected, expected.clone(), torch.tensor(slots))
    write_latent(key, cache, torch.tensor(slots))
    assert torch.equal(cache, expected)


def test_write_latent_reads_no_value_back_to_the_host() -> None:
    """CUDA graphs capture the write only if it never reads a value back to the host (a
    0-d tensor index calls .item(): the H200's capture failed at 2082a57). Meta tensors have
    no values, so any such read raises here on the CPU."""
    meta = torch.device("meta")
    cache = torch.empty(4, 16, 1, 12, device=meta)
    key = torch.empty(5, 1, 12, device=meta)
    write_latent(key, cache, torch.empty(5, dtype=torch.int64, device=meta))


def test_moe_block_matches_hf(checkpoint) -> None:  # type: ignore[no-untyped-def]
    """Grouped top-k, the scaling factor and the shared experts: HF's block on random hidden
    states, 1 and 96 tokens. Without the group limit (or the scaling) it misses HF."""
    path = checkpoint("deepseek_v2")
    ours = load_model(str(path), torch.device("cpu"), torch.float32).model
    theirs = hf_model(path).model
    assert not isinstance(ours.layers[0].mlp, DeepseekMoeBlock)
    for layer in (1, 2):
        block, hf_block = ours.layers[layer].mlp, theirs.layers[layer].mlp
        assert isinstance(block, DeepseekMoeBlock)
        x = torch.randn(96, 64, generator=torch.Generator().manual_seed(layer))
        with torch.no_grad():
            for tokens in (1, 96):
                expected = hf_block(x[None, :tokens])[0]
                torch.testing.assert_close(block(x[:tokens]), expected, rtol=1e-5, atol=1e-5)
            ids, weights = block.route(x)
            assert ids.unique().numel() == 8 and weights.sum(-1).max() <= 1.5
            block.topk_groups = 4  # every group: plain top-k
            assert (block(x) - expected).abs().max() > 1e-3
            block.topk_groups, block.scaling = 2, 1.0
            assert (block(x) - expected).abs().max() > 1e-3


def test_spec_reads_the_deepseek_config(checkpoint) -> None:  # type: ignore[no-untyped-def]
    """The latent and rope key are the one cached head; parameters count HF's; our weights
    go back out under the checkpoint's names (plain q_proj and the low-rank query)."""
    spec = parse_config(checkpoint("deepseek_v2") / "config.json")
    assert spec.mla is not None and (spec.num_kv_heads, spec.head_dim) == (1, 32 + 8)
    assert (spec.mla.q_lora_rank, spec.rope_dim, spec.kv_copies) == (0, 8, 1)
    assert (spec.num_local_experts, spec.num_experts_per_tok, spec.expert_size) == (8, 3, 32)
    assert (spec.expert_groups, spec.topk_groups, spec.routed_scaling_factor) == (4, 2, 1.5)
    assert spec.shared_expert_intermediate_size == 64 and not spec.shared_expert_gated
    assert spec.dense_layers == (0,) and not spec.norm_topk_prob
    assert spec.kv_bytes_per_token(torch.float32) == 3 * 40 * 4
    for options in ({}, Q_LORA):
        path = checkpoint("deepseek_v2", **options)
        spec = parse_config(path / "config.json")
        assert spec.num_parameters() == sum(p.numel() for p in hf_model(path).parameters())
        assert parameter_count(spec) == spec.num_parameters()
        loaded = load_model(str(path), torch.device("cpu"), torch.float32).model
        with safe_open(path / "model.safetensors", framework="pt") as f:
            assert set(to_hf_state_dict(loaded)) == set(f.keys())


def test_hot_kv_holds_the_latent_once(checkpoint) -> None:  # type: ignore[no-untyped-def]
    """K and V of each layer are one tensor of [blocks, block_size, 1, 40]: the pool's bytes
    are the latent's, not twice them."""
    engine = Engine(EngineConfig(model=str(checkpoint("deepseek_v2")), device="cpu"))
    k, v = engine.runner.kv_caches[0]
    assert k.data_ptr() == v.data_ptr() and k.shape == v.shape and k.shape[2:] == (1, 40)
    per_token = engine.spec.kv_bytes_per_token()
    assert engine.runner.kv_bytes() == engine.plan.num_blocks * engine.config.block_size * per_token


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"hot_codec": "int8"}, "kv_cache.hot_codec='int8'"),
        ({"warm_pool_mb": 64.0}, "kv_cache.warm_pool_mb=64.0"),
    ],
)
def test_latent_kv_refuses_the_tiers_it_does_not_support(
    options: dict[str, Any], match: str
) -> None:
    with pytest.raises(ConfigError, match=match):
        Engine(EngineConfig(model="tiny-deepseek-v2", device="cpu", **options))


@pytest.mark.parametrize(
    ("patch", "match"),
    [
        ({"topk_method": "noaux_tc"}, "topk_method='noaux_tc'"),
        ({"norm_topk_prob": True}, "norm_topk_prob=true"),
        ({"moe_layer_freq": 2}, "moe_layer_freq=2"),
        ({"first_k_dense_replace": 3}, "first_k_dense_replace=3"),
        ({"n_group": 3}, "n_group=3 must divide n_routed_experts=8"),
        ({"topk_group": 5}, "topk_group=5 must be at most n_group"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok=9.*n_routed_experts=8"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_scaling.rope_type"),
        ({"attention_bias": True}, "attention_bias"),
        ({"kv_lora_rank": None}, "kv_lora_rank"),
        ({"qk_rope_head_dim": 7}, "qk_rope_head_dim'=7 must be even"),
        ({"q_lora_rank": -1}, "q_lora_rank"),
    ],
)
def test_bad_deepseek_config_names_the_key(  # type: ignore[no-untyped-def]
    checkpoint, tmp_path: Path, patch: dict[str, Any], match: str
) -> None:
    config = json.loads((checkpoint("deepseek_v2") / "config.json").read_text()) | patch
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    with pytest.raises(ModelLoadError, match=match):
        parse_config(bad)


def test_deepseek_v2_lite_preset_has_the_published_sizes() -> None:
    """15.7B parameters, 2.4B of them active a token (6 of 64 experts in 26 of 27 layers,
    the embedding aside), and 576 cached values a token and layer."""
    spec = preset_spec("deepseek-v2-lite")
    assert spec.synthetic and spec.mla is not None and spec.rope.rope_type == "yarn"
    assert spec.num_parameters() / 1e9 == pytest.approx(15.7, rel=0.01)
    experts = spec.moe_layer_count * 64 * 3 * spec.hidden_size * spec.moe_intermediate_size
    active = spec.num_parameters() - experts * (1 - 6 / 64) - spec.vocab_size * spec.hidden_size
    assert active / 1e9 == pytest.approx(2.4, rel=0.03)
    assert spec.kv_bytes_per_token() == 27 * 576 * 2  # bf16; as MHA: 27 * 16 * 320 * 2


@pytest.mark.slow
def test_tiny_preset_with_host_experts_is_the_same_model() -> None:
    """The preset's experts drawn straight into host memory are the weights the resident
    build draws: the same greedy tokens, through the CPU and the device cache."""
    prompts = [[256, *range(40, 70)], [256, *range(300, 311)], [256, 65, 66]]
    resident = Engine(EngineConfig(model="tiny-deepseek-v2", device="cpu"))
    norms = [layer.self_attn.kv_a_layernorm for layer in resident.loaded.model.layers]
    assert all(torch.equal(n, torch.ones_like(n)) for n in norms)
    expected = [c.token_ids for c in resident.generate(prompts, GREEDY)]
    cold = _cold("tiny-deepseek-v2")
    assert [c.token_ids for c in cold.generate(prompts, GREEDY)] == expected
    stats = cold.moe_stats()
    assert stats["cpu_experts"] > 0 and stats["gpu_experts"] > 0
    quantized = _cold("tiny-deepseek-v2", expert_format="int8")
    assert all(len(c.token_ids) == NEW_TOKENS for c in quantized.generate(prompts, GREEDY))


@pytest.mark.slow
@pytest.mark.parametrize("gate", ["gpu", "cpu"])
def test_piecewise_decode_matches_hf(checkpoint, gate: str) -> None:  # type: ignore[no-untyped-def]
    """The pieces the CUDA graphs capture, run eagerly: MLA's latent write and attention
    inside each layer's piece, DeepSeek's grouped pick from fp32 logits in the piece or on
    the host (moe_gate), the ungated shared experts added by the host; HF's greedy tokens."""
    path = checkpoint("deepseek_v2")
    prompts = sample_prompts(path, 3, [7, 29, 83])
    engine = _cold(path)
    place_moe_gate(engine.loaded.model, gate)
    runner = engine.runner
    graphs = MoeDecodeGraphs(
        engine.loaded.model,
        runner.kv_caches,
        runner.rope,
        4,
        runner.max_blocks,
        engine.device,
        graphed=False,
    )
    assert [b is None for b in graphs.blocks] == [True, False, False]
    assert all(p is None or p.logits.dtype == torch.float32 for p in graphs.picks)
    runner.graphs = graphs
    got = [c.token_ids for c in engine.generate(prompts, GREEDY)]
    engine.release()
    assert got == hf_greedy(path, prompts, NEW_TOKENS)


@pytest.mark.parametrize("options", [{}, Q_LORA, YARN], ids=["lite", "q_lora", "yarn"])
def test_benchmark_baseline_config_has_the_checkpoints_shape(  # type: ignore[no-untyped-def]
    checkpoint, options: dict[str, Any]
) -> None:
    """The accelerate baseline's transformers config (moe_bench) builds the very tensors of
    the checkpoint's model, and the rope and softmax scale HF derives from it are the
    checkpoint's."""
    from transformers import AutoModelForCausalLM

    from hybridgen.benchmarks.hf_baseline import hf_config

    path = checkpoint("deepseek_v2", **options)
    config = hf_config(parse_config(path / "config.json"))
    with torch.device("meta"):
        built = AutoModelForCausalLM.from_config(config)
    shapes = {k: v.shape for k, v in built.state_dict().items()}
    reference_model = hf_model(path)
    assert shapes == {k: v.shape for k, v in reference_model.state_dict().items()}
    assert (
        built.model.layers[1].self_attn.scaling == reference_model.model.layers[1].self_attn.scaling
    )
    assert built.model.layers[1].mlp.gate.topk_method == reference_model.config.topk_method


def test_benchmark_baseline_of_deepseek_v2_lite_has_its_parameters() -> None:
    from transformers import AutoModelForCausalLM

    from hybridgen.benchmarks.hf_baseline import hf_config

    lite = preset_spec("deepseek-v2-lite")
    with torch.device("meta"):
        hf_lite = AutoModelForCausalLM.from_config(hf_config(lite))
    assert sum(p.numel() for p in hf_lite.parameters()) == lite.num_parameters()
