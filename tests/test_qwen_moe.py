"""Qwen2-MoE and Qwen3-MoE against HF transformers on tiny random checkpoints (CPU, fp32):
greedy tokens through the engine with the experts in host memory and a small device cache,
the MoE block alone on random hidden states, and what their configs may say.

qwen2_moe: qkv bias, 8 experts top-2 left as softmax probabilities (norm_topk_prob false), a
shared expert of 96 behind a sigmoid gate. qwen3_moe: q/k RMSNorm per head, head_dim 32 (not
hidden / heads = 16), 8 experts top-2 renormalised, no shared expert.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from hybridgen.config.engine import EngineConfig
from hybridgen.engine.engine import Engine
from hybridgen.engine.moe_graphs import MoeDecodeGraphs
from hybridgen.models.errors import ModelLoadError
from hybridgen.models.loader import copy_weights, load_model, model_spec, to_hf_state_dict
from hybridgen.models.moe import SparseMoeBlock
from hybridgen.models.presets import parameter_count, preset_spec
from hybridgen.models.spec import parse_config
from hybridgen.sampling.params import SamplingParams
from tests.hf_reference import hf_greedy, hf_model, sample_prompts

KINDS = ("qwen2_moe", "qwen3_moe")
NEW_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
SLOTS = 4
"""Device cache slots: a quarter of the 16 (layer, expert) pairs of the tiny models."""
TOKENS = 96
# Layers 0 and 2 dense: 0 by mlp_only_layers, 2 because decoder_sparse_step 2 skips it.
DENSE = {"num_hidden_layers": 4, "mlp_only_layers": [0], "decoder_sparse_step": 2}


def _cold(path: Path, **kw: Any) -> Engine:
    config = EngineConfig(
        model=str(path), device="cpu", expert_cache_slots=SLOTS, expert_cpu_max_tokens=1, **kw
    )
    return Engine(config)


def _blocks(path: Path) -> list[tuple[SparseMoeBlock, Any]]:
    """(our MoE block, HF's) of every MoE layer, both fp32."""
    ours = load_model(str(path), torch.device("cpu"), torch.float32).model
    pairs = []
    for mine, theirs in zip(ours.layers, hf_model(path).model.layers, strict=True):
        if isinstance(mine.mlp, SparseMoeBlock):
            pairs.append((mine.mlp, theirs.mlp))
    return pairs


def _hidden(seed: int, hidden_size: int) -> torch.Tensor:
    return torch.randn(TOKENS, hidden_size, generator=torch.Generator().manual_seed(seed))


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_cold_weights_greedy_matches_hf(checkpoint, kind: str) -> None:  # type: ignore[no-untyped-def]
    """Three prompts batched, the experts in host memory (native) and 4 device slots: prefill
    fetches experts, decode computes uncached ones on the CPU; HF's greedy tokens."""
    path = checkpoint(kind)
    prompts = sample_prompts(path, 3, [7, 29, 83])
    engine = _cold(path)
    got = [c.token_ids for c in engine.generate(prompts, GREEDY)]
    assert got == hf_greedy(path, prompts, NEW_TOKENS)
    stats = engine.moe_stats()
    assert stats["cpu_experts"] > 0 and stats["cache_misses"] > 0 and stats["cache_hits"] > 0
    spec = engine.spec
    assert engine.experts is not None
    assert engine.experts[0].expert_bytes == 3 * spec.hidden_size * spec.expert_size * 4
    blocks = [m for m in engine.loaded.model.modules() if isinstance(m, SparseMoeBlock)]
    assert all(b.store is not None and len(b.experts) == 0 for b in blocks)
    # Qwen2-MoE's shared expert is dense: it stays on the device, beside the router.
    shared = [b.shared_expert for b in blocks if b.shared_expert is not None]
    assert len(shared) == (len(blocks) if kind == "qwen2_moe" else 0)
    assert all(p.device.type == "cpu" and not p.is_meta for s in shared for p in s.parameters())


@pytest.mark.slow
def test_dense_layers_of_a_moe_model_match_hf(checkpoint) -> None:  # type: ignore[no-untyped-def]
    """mlp_only_layers and decoder_sparse_step: layers 0 and 2 have a dense MLP of
    intermediate_size, 1 and 3 route experts; eagerly and through the piecewise decode."""
    path = checkpoint("qwen2_moe", **DENSE)
    spec = parse_config(path / "config.json")
    assert spec.dense_layers == (0, 2) and spec.moe_layer_count == 2
    prompts = sample_prompts(path, 3, [7, 29, 83])
    expected = hf_greedy(path, prompts, NEW_TOKENS)
    engine = _cold(path)
    assert [c.token_ids for c in engine.generate(prompts, GREEDY)] == expected
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
    assert [b is None for b in graphs.blocks] == [True, False, True, False]
    runner.graphs = graphs
    assert [c.token_ids for c in engine.generate(prompts, GREEDY)] == expected
    engine.release()


@pytest.mark.slow
def test_piecewise_decode_with_a_shared_expert_matches_hf(checkpoint) -> None:  # type: ignore[no-untyped-def]
    """The shared expert runs inside each layer's piece and the host adds it to the routed
    experts' sum; without it the tokens would not be HF's."""
    path = checkpoint("qwen2_moe")
    prompts = sample_prompts(path, 3, [7, 29, 83])
    engine = _cold(path)
    runner = engine.runner
    runner.graphs = MoeDecodeGraphs(
        engine.loaded.model,
        runner.kv_caches,
        runner.rope,
        4,
        runner.max_blocks,
        engine.device,
        graphed=False,
    )
    got = [c.token_ids for c in engine.generate(prompts, GREEDY)]
    engine.release()
    assert got == hf_greedy(path, prompts, NEW_TOKENS)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("tokens", [1, TOKENS])
def test_moe_block_matches_hf(checkpoint, kind: str, tokens: int) -> None:  # type: ignore[no-untyped-def]
    for layer, (ours, theirs) in enumerate(_blocks(checkpoint(kind))):
        x = _hidden(10 + layer, ours.gate.in_features)[:tokens]
        with torch.no_grad():
            expected = theirs(x[None])[0]
            got = ours(x)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        ids, _ = ours.route(_hidden(layer, ours.gate.in_features))
        assert ids.unique().numel() == ours.num_experts  # every expert is exercised


@pytest.mark.parametrize("kind", KINDS)
def test_moe_block_is_hfs_to_the_bit_in_bf16(checkpoint, kind: str) -> None:  # type: ignore[no-untyped-def]
    """In bf16, Qwen's top-k weights scale the experts' outputs in the model dtype, as HF casts
    them (router_weights_in_model_dtype): the block is HF's to the bit. Left fp32, Qwen3-MoE's
    misses it."""
    from transformers import AutoModelForCausalLM

    path = checkpoint(kind)
    ours = load_model(str(path), torch.device("cpu"), torch.bfloat16).model.layers[0].mlp
    theirs = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).model
    assert isinstance(ours, SparseMoeBlock)
    assert ours.cast_weights
    for tokens in (1, TOKENS):
        x = _hidden(tokens, ours.gate.in_features)[:tokens].bfloat16()
        with torch.no_grad():
            assert torch.equal(ours(x), theirs.layers[0].mlp(x[None])[0])
    if kind == "qwen3_moe":
        ours.cast_weights = False
        x = _hidden(0, ours.gate.in_features).bfloat16()
        with torch.no_grad():
            assert not torch.equal(ours(x), theirs.layers[0].mlp(x[None])[0])


@pytest.mark.parametrize("kind", KINDS)
def test_the_wrong_renormalisation_is_caught(checkpoint, kind: str) -> None:  # type: ignore[no-untyped-def]
    """norm_topk_prob decides the block's output: flipped, it misses HF by far more than the
    tolerance (qwen2_moe keeps the probabilities, qwen3_moe divides by their sum)."""
    ours, theirs = _blocks(checkpoint(kind))[0]
    assert ours.norm_topk == (kind == "qwen3_moe")
    ours.norm_topk = not ours.norm_topk
    x = _hidden(0, ours.gate.in_features)
    with torch.no_grad():
        assert (ours(x) - theirs(x[None])[0]).abs().max() > 1e-2


def test_spec_reads_the_qwen_moe_configs(checkpoint) -> None:  # type: ignore[no-untyped-def]
    q2 = parse_config(checkpoint("qwen2_moe") / "config.json")
    assert (q2.family, q2.num_local_experts, q2.num_experts_per_tok) == ("qwen2_moe", 8, 2)
    assert (q2.moe_intermediate_size, q2.shared_expert_intermediate_size) == (32, 96)
    assert (q2.norm_topk_prob, q2.attention_bias, q2.qk_norm) == (False, True, False)
    assert (q2.sliding_window, q2.dense_layers, q2.router_weights_in_model_dtype) == (0, (), True)
    q3 = parse_config(checkpoint("qwen3_moe") / "config.json")
    assert (q3.family, q3.head_dim, q3.expert_size) == ("qwen3_moe", 32, 32)
    assert (q3.norm_topk_prob, q3.attention_bias, q3.qk_norm) == (True, False, True)
    assert q3.shared_expert_intermediate_size == 0
    for path in (
        checkpoint("qwen2_moe"),
        checkpoint("qwen3_moe"),
        checkpoint("qwen2_moe", **DENSE),
    ):
        spec = parse_config(path / "config.json")
        assert spec.num_parameters() == sum(p.numel() for p in hf_model(path).parameters())


def test_transformers5_spellings_load(checkpoint, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """transformers 5 writes num_local_experts where hub configs say num_experts, and holds
    the experts stacked in memory: both load into the same weights."""
    path = checkpoint("qwen3_moe")
    config = json.loads((path / "config.json").read_text())
    renamed = tmp_path / "config.json"
    renamed.write_text(
        json.dumps(
            {k: v for k, v in config.items() if k != "num_experts"} | {"num_local_experts": 8}
        )
    )
    assert parse_config(renamed).num_local_experts == 8
    for kind in KINDS:
        path = checkpoint(kind)
        loaded = load_model(str(path), torch.device("cpu"), torch.float32).model
        fresh = load_model(str(path), torch.device("cpu"), torch.float32).model
        with torch.no_grad():
            for p in fresh.parameters():
                p.zero_()
        copy_weights(fresh, hf_model(path).state_dict().items(), "hf state dict")
        pairs = zip(loaded.named_parameters(), fresh.named_parameters(), strict=True)
        for (name, a), (_, b) in pairs:
            assert torch.equal(a, b), name
        # ... and our weights go back out under the names the checkpoint has.
        with safe_open(path / "model.safetensors", framework="pt") as f:
            assert set(to_hf_state_dict(loaded)) == set(f.keys())


@pytest.mark.parametrize(
    ("kind", "patch", "match"),
    [
        ("qwen2_moe", {"decoder_sparse_step": 0}, "decoder_sparse_step"),
        ("qwen2_moe", {"mlp_only_layers": [2]}, r"mlp_only_layers.*\[0, 2\)"),
        ("qwen2_moe", {"mlp_only_layers": [0, 1]}, "leave no MoE layer"),
        ("qwen2_moe", {"use_sliding_window": True}, "use_sliding_window"),
        ("qwen2_moe", {"shared_expert_intermediate_size": None}, "shared_expert_intermediate_size"),
        ("qwen2_moe", {"num_experts_per_tok": 9}, "num_experts_per_tok=9.*num_experts=8"),
        ("qwen3_moe", {"attention_bias": True}, "attention_bias"),
        ("qwen3_moe", {"moe_intermediate_size": None}, "moe_intermediate_size"),
    ],
)
def test_bad_qwen_moe_config_names_the_key(  # type: ignore[no-untyped-def]
    checkpoint, tmp_path: Path, kind: str, patch: dict[str, Any], match: str
) -> None:
    config = json.loads((checkpoint(kind) / "config.json").read_text()) | patch
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    with pytest.raises(ModelLoadError, match=match):
        parse_config(bad)


def test_qwen3_30b_a3b_preset_has_the_published_sizes() -> None:
    """30.5B parameters, 3.3B of them active a token (8 of 128 experts in each of 48 layers)."""
    spec = preset_spec("qwen3-30b-a3b")
    assert spec.synthetic and (spec.num_local_experts, spec.num_experts_per_tok) == (128, 8)
    assert spec.num_parameters() / 1e9 == pytest.approx(30.5, rel=0.01)
    experts = spec.num_layers * 128 * 3 * spec.hidden_size * spec.moe_intermediate_size
    active = spec.num_parameters() - experts + experts * 8 / 128
    assert active / 1e9 == pytest.approx(3.3, rel=0.02)


@pytest.mark.slow
def test_tiny_qwen3_moe_preset_with_host_experts_is_the_same_model() -> None:
    """The preset's experts drawn straight into host memory (native) are the weights the
    resident build draws: the same greedy tokens, through the CPU and the device cache; its
    q/k norms are drawn as norms (1), not as weights."""
    prompts = [[256, *range(40, 70)], [256, *range(300, 311)], [256, 65, 66]]
    spec = preset_spec("tiny-qwen3-moe")
    assert parameter_count(spec) == spec.num_parameters()
    resident = Engine(EngineConfig(model="tiny-qwen3-moe", device="cpu"))
    norms = [layer.self_attn.q_norm for layer in resident.loaded.model.layers]
    assert all(torch.equal(n, torch.ones_like(n)) for n in norms)
    expected = [c.token_ids for c in resident.generate(prompts, GREEDY)]
    cold = _cold(Path("tiny-qwen3-moe"))
    assert [c.token_ids for c in cold.generate(prompts, GREEDY)] == expected
    stats = cold.moe_stats()
    assert stats["cpu_experts"] > 0 and stats["gpu_experts"] > 0
    for fmt in ("int8", "int4"):
        quantized = _cold(Path("tiny-qwen3-moe"), expert_format=fmt)
        assert all(len(c.token_ids) == NEW_TOKENS for c in quantized.generate(prompts, GREEDY))


@pytest.mark.parametrize("options", [{}, DENSE])
@pytest.mark.parametrize("kind", KINDS)
def test_benchmark_baseline_config_has_the_checkpoints_shape(  # type: ignore[no-untyped-def]
    checkpoint, kind: str, options: dict[str, Any]
) -> None:
    """The accelerate baseline's transformers config (B4c) builds the very tensors of the
    checkpoint's model: experts, shared expert, dense layers, q/k norms."""
    from transformers import AutoModelForCausalLM

    from hybridgen.benchmarks.hf_baseline import hf_config

    path = checkpoint(kind, **options)
    with torch.device("meta"):
        built = AutoModelForCausalLM.from_config(hf_config(parse_config(path / "config.json")))
    shapes = {k: v.shape for k, v in built.state_dict().items()}
    assert shapes == {k: v.shape for k, v in hf_model(path).state_dict().items()}


@pytest.mark.slow
def test_moe_bench_runs_qwen3_moe_beside_accelerate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """B4c's harness at toy scale: tiny-qwen3-moe with int4 experts in host memory, and HF's
    Qwen3-MoE of the same shape under accelerate."""
    from hybridgen.benchmarks import moe_bench

    monkeypatch.setattr(moe_bench.hlog, "configure", lambda: None)
    result = moe_bench.main(
        [
            *("--model=tiny-qwen3-moe", "--device=cpu", "--budget-mb=82", "--prompt-len=32"),
            *("--new-tokens=8", "--baseline-new-tokens=3", "--cases=uniform,accelerate"),
            *("--in-process", f"--out={tmp_path / 'moe.json'}"),
        ]
    )
    uniform, baseline = result["cases"]["uniform"], result["cases"]["accelerate"]
    assert "error" not in uniform and "error" not in baseline, result["cases"]
    assert uniform["experts_total"] == 4 * 16 and uniform["decode_tok_s"] > 0
    assert baseline["shape"] == "same" and baseline["decode_tok_s"] > 0


def test_b4c_served_config_is_qwen3_30b_a3b_in_12_gb() -> None:
    """bench/served/b4c.yaml (bench/run_h200_served.sh b4c) says what issue 25's B4c is."""
    from hybridgen.config.file import load_config

    root = Path(__file__).resolve().parents[1]
    config = load_config(root / "bench/served/b4c.yaml").engine_config("cuda")
    assert (config.model, config.gpu_memory_mb) == ("qwen3-30b-a3b", 12288)
    assert (config.expert_format, config.expert_cache_slots) == ("int4", "auto")
    assert config.expert_cpu_max_tokens is None  # the latency model places the misses


def test_b4c_diagnostic_twin_differs_only_in_the_cpu_daemons_experts() -> None:
    """bench/served/b4c_gpu_experts.yaml (run_h200_served.sh b4c_ab) is B4c with no expert
    on the CPU: cold_weights.cpu_max_tokens 0, everything else as b4c.yaml."""
    from dataclasses import replace

    from hybridgen.config.file import load_config

    root = Path(__file__).resolve().parents[1]
    b4c = load_config(root / "bench/served/b4c.yaml").engine_config("cuda")
    twin = load_config(root / "bench/served/b4c_gpu_experts.yaml").engine_config("cuda")
    assert twin.expert_cpu_max_tokens == 0
    assert replace(twin, expert_cpu_max_tokens=None) == b4c


@pytest.mark.slow
@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_qwen3moe_gguf_matches_transformers_on_the_same_weights(tmp_path: Path, qtype: str) -> None:
    """A qwen3moe GGUF (stacked experts, attn_q_norm / attn_k_norm) written from the tiny
    checkpoint gives the greedy tokens of transformers' Qwen3MoeForCausalLM holding the weights
    the file holds (each matrix through the same quantization), with the experts in host
    memory too. transformers' own GGUF reader takes no expert_feed_forward_length (it would
    build experts of its default 768), so the checkpoint is the reference, as for Mixtral."""
    from transformers import AutoModelForCausalLM

    from tests.gguf_files import roundtrip
    from tests.test_gguf import _checkpoint, _prompts, tiny_gguf

    path = tiny_gguf(tmp_path, "qwen3_moe", qtype)
    spec = model_spec(str(path))
    assert (spec.family, spec.num_local_experts, spec.expert_size) == ("qwen3_moe", 8, 32)
    assert spec.qk_norm and spec.norm_topk_prob and spec.router_weights_in_model_dtype
    src = _checkpoint(str(tmp_path.parent), "qwen3_moe", None)
    ref = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    with torch.no_grad():
        for param in ref.parameters():
            if param.ndim >= 2:
                param.copy_(roundtrip(param.detach(), qtype).reshape(param.shape))
    prompts = _prompts(path)
    expected = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = ref.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=NEW_TOKENS,
            eos_token_id=None,
            pad_token_id=0,
        )
        expected.append(out[0, len(prompt) :].tolist())
    cold = _cold(path)
    assert [c.token_ids for c in cold.generate(prompts, GREEDY)] == expected
    assert cold.moe_stats()["cpu_experts"] > 0


@pytest.mark.parametrize("bench", ["b4a", "b4c"])
def test_q4_twins_differ_only_in_the_dense_weights_format(bench: str) -> None:
    """bench/served/{b4a,b4c}_q4.yaml (run_h200_served.sh b4a_q4 / b4c_q4) are B4a / B4c with
    weights.format int4, everything else as the benchmark's own config."""
    from dataclasses import replace

    from hybridgen.config.file import load_config

    root = Path(__file__).resolve().parents[1]
    base = load_config(root / f"bench/served/{bench}.yaml").engine_config("cuda")
    twin = load_config(root / f"bench/served/{bench}_q4.yaml").engine_config("cuda")
    assert (base.weights_format, twin.weights_format) == ("native", "int4")
    assert replace(twin, weights_format="native") == base
    assert f"{bench}_q4" in (root / "bench/run_h200_served.sh").read_text()
