"""Mixtral against HF transformers on a tiny random checkpoint (CPU, fp32): greedy tokens
through the engine, and the router and sparse MoE block alone on random hidden states."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from hybridgen.config.engine import EngineConfig
from hybridgen.engine.cuda_graphs import graph_sizes
from hybridgen.engine.engine import Engine
from hybridgen.engine.memory import graph_batch_size, workspace_bytes
from hybridgen.models.errors import ModelLoadError
from hybridgen.models.loader import copy_weights, load_model
from hybridgen.models.moe import SparseMoeBlock
from hybridgen.models.spec import parse_config
from hybridgen.sampling.params import SamplingParams
from tests.hf_reference import hf_greedy, hf_model, sample_prompts

NEW_TOKENS = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
TOKENS = 96  # random hidden states per block test: every expert gets some


def _blocks(path: Path) -> list[tuple[SparseMoeBlock, Any]]:
    """(our MoE block, HF's MixtralSparseMoeBlock) of every layer, both fp32."""
    ours = load_model(str(path), torch.device("cpu"), torch.float32).model
    hf = hf_model(path)
    pairs = []
    for mine, theirs in zip(ours.layers, hf.model.layers, strict=True):
        assert isinstance(mine.mlp, SparseMoeBlock)
        pairs.append((mine.mlp, getattr(theirs, "mlp", None) or theirs.block_sparse_moe))
    return pairs


def _hidden(seed: int, hidden_size: int) -> torch.Tensor:
    return torch.randn(TOKENS, hidden_size, generator=torch.Generator().manual_seed(seed))


@pytest.mark.slow
@pytest.mark.parametrize("shards", [None, "100KB"])
def test_concurrent_greedy_matches_hf(checkpoint, shards: str | None) -> None:  # type: ignore[no-untyped-def]
    """Three prompts of different lengths, batched through the engine, give HF's greedy tokens,
    from one safetensors file and from a sharded checkpoint with an index."""
    path = checkpoint("mixtral", **({"max_shard_size": shards} if shards else {}))
    assert (path / "model.safetensors.index.json").exists() == bool(shards)
    prompts = sample_prompts(path, 3, [7, 29, 83])
    expected = hf_greedy(path, prompts, NEW_TOKENS)
    engine = Engine(EngineConfig(model=str(path), device="cpu"))
    got = engine.generate(prompts, GREEDY)
    assert [c.token_ids for c in got] == expected


def test_spec_reads_the_experts(checkpoint) -> None:  # type: ignore[no-untyped-def]
    path = checkpoint("mixtral")
    spec = parse_config(path / "config.json")
    assert (spec.architecture, spec.family) == ("MixtralForCausalLM", "mixtral")
    assert (spec.num_local_experts, spec.num_experts_per_tok) == (4, 2)
    assert spec.num_parameters() == sum(p.numel() for p in hf_model(path).parameters())
    dense = parse_config(checkpoint("mistral") / "config.json")
    assert (dense.num_local_experts, dense.num_experts_per_tok) == (0, 0)


def test_router_matches_hf(checkpoint) -> None:  # type: ignore[no-untyped-def]
    for layer, (ours, theirs) in enumerate(_blocks(checkpoint("mixtral"))):
        x = _hidden(layer, ours.gate.in_features)
        ids, weights = ours.route(x)
        _, hf_weights, hf_ids = theirs.gate(x)
        assert torch.equal(ids, hf_ids)
        torch.testing.assert_close(weights, hf_weights, rtol=0, atol=1e-6)
        assert weights.dtype == torch.float32
        assert ids.unique().numel() == ours.num_experts  # the test exercises every expert


@pytest.mark.parametrize("tokens", [1, TOKENS])
def test_moe_block_matches_hf(checkpoint, tokens: int) -> None:  # type: ignore[no-untyped-def]
    for layer, (ours, theirs) in enumerate(_blocks(checkpoint("mixtral"))):
        x = _hidden(10 + layer, ours.gate.in_features)[:tokens]
        with torch.no_grad():
            expected = theirs(x[None])[0]
            got = ours(x)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_wrong_renormalisation_is_caught(checkpoint, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """The block comparison can fail: top-k weights left as raw softmax probabilities (no
    division by their sum) miss HF by far more than the tolerance."""
    ours, theirs = _blocks(checkpoint("mixtral"))[0]

    def unnormalised(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights, ids = torch.topk(torch.softmax(ours.gate(x).float(), -1), ours.top_k, -1)
        return ids, weights

    monkeypatch.setattr(ours, "route", unnormalised)
    x = _hidden(0, ours.gate.in_features)
    with torch.no_grad():
        assert (ours(x) - theirs(x[None])[0]).abs().max() > 1e-2


def test_transformers5_fused_expert_layout_loads(checkpoint) -> None:  # type: ignore[no-untyped-def]
    """transformers 5 holds the experts stacked (mlp.experts.gate_up_proj [E, 2I, H]); a state
    dict in that layout loads into the same weights as the per-expert safetensors."""
    path = checkpoint("mixtral")
    loaded = load_model(str(path), torch.device("cpu"), torch.float32).model
    fresh = load_model(str(path), torch.device("cpu"), torch.float32).model
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    copy_weights(fresh, hf_model(path).state_dict().items(), "hf state dict")
    for (name, a), (_, b) in zip(loaded.named_parameters(), fresh.named_parameters(), strict=True):
        assert torch.equal(a, b), name


def test_bad_expert_config_names_the_key(checkpoint, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    config = json.loads((checkpoint("mixtral") / "config.json").read_text())
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps(config | {"num_experts_per_tok": 5}))
    with pytest.raises(ModelLoadError, match="num_experts_per_tok=5"):
        parse_config(bad)
    bad.write_text(json.dumps({k: v for k, v in config.items() if k != "num_local_experts"}))
    with pytest.raises(ModelLoadError, match="num_local_experts"):
        parse_config(bad)


def test_moe_models_decode_from_piecewise_graphs_counted_in_the_plan(checkpoint) -> None:  # type: ignore[no-untyped-def]
    """MoE decode is captured too, piecewise (moe_graphs.py), and the memory plan counts what
    its pieces keep: each layer's MLP input, residual and router weights per captured size."""
    config = EngineConfig(max_num_seqs=8)
    spec = parse_config(checkpoint("mixtral") / "config.json")
    model = load_model(str(checkpoint("mixtral")), torch.device("cpu")).model
    assert graph_batch_size(config, model) == 8
    assert graph_batch_size(EngineConfig(max_num_seqs=8, cuda_graphs=False), model) == 0

    def workspace(graph_batch: int) -> int:
        return workspace_bytes(spec, spec.dtype, 64, 8, 512, graph_batch)

    dense = dataclasses.replace(spec, num_local_experts=0)
    kept = spec.num_layers * (2 * spec.hidden_size * spec.dtype.itemsize + 4 * 2)
    sizes = sum(graph_sizes(8))  # 1 + 2 + 4 + 8
    moe_graphs = workspace(8) - workspace(0)
    dense_graphs = workspace_bytes(dense, spec.dtype, 64, 8, 512, 8) - workspace_bytes(
        dense, spec.dtype, 64, 8, 512, 0
    )
    assert moe_graphs - dense_graphs == sizes * kept
