"""weights.gpu_layers: decoder layers in host memory, computed on the CPU or streamed
(models/host_layers.py), against HF transformers' greedy tokens (CPU, fp32)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from hybridgen.config.engine import ConfigError, EngineConfig
from hybridgen.config.file import parse_config
from hybridgen.engine.engine import Engine
from hybridgen.engine.memory import (
    RESIDENT_SLACK,
    graph_batch_size,
    plan_engine_memory,
    weights_bytes,
)
from hybridgen.models.host_layers import HostEmbedding
from hybridgen.models.loader import load_model
from hybridgen.sampling.params import SamplingParams
from tests.hf_reference import hf_greedy, sample_prompts

NEW_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
CPU = torch.device("cpu")


def make_engine(path: Path, **options: object) -> Engine:
    return Engine(EngineConfig(model=str(path), device="cpu", **options))  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", ["llama3", "qwen2"])
@pytest.mark.parametrize(
    ("gpu_layers", "compute"),
    [(1, "cpu"), (1, "stream"), (0, "stream"), (1, "split"), (0, "split")],
)
def test_host_layers_give_hf_greedy_tokens(
    checkpoint, kind: str, gpu_layers: int, compute: str
) -> None:  # type: ignore[no-untyped-def]
    """Layers past gpu_layers in host memory, all computed by the CPU, all streamed through
    the staging slots, or each projection's rows split between the two, give HF's greedy
    tokens; the counters show which path ran."""
    path = checkpoint(kind, num_hidden_layers=3)
    prompts = sample_prompts(path, 2, [9, 23])
    expected = hf_greedy(path, prompts, NEW_TOKENS)
    engine = make_engine(path, gpu_layers=gpu_layers, host_layer_compute=compute)
    host = engine.host_layers
    assert host is not None and host.host_layers == 3 - gpu_layers
    if compute == "split":
        # The calibrated share follows this machine's load (0.003 on a busy CI machine: no
        # CPU rows at all), which tests/test_host_split.py covers: here a fixed half, so
        # both sides compute every host layer.
        host.place(0.5)
    got = engine.generate(prompts, GREEDY)
    assert [c.token_ids for c in got] == expected
    s = host.stats
    if compute == "cpu":
        assert s.cpu_layers >= NEW_TOKENS * host.host_layers and s.streamed_layers == 0
        assert s.weight_bytes_h2d == 0 and s.activation_bytes > 0 and s.cpu_seconds > 0
    elif compute == "stream":  # every host layer's weights copied into staging every pass
        assert s.streamed_layers >= NEW_TOKENS * host.host_layers and s.cpu_layers == 0
        assert s.weight_bytes_h2d == s.streamed_layers * host.layer_bytes
        assert s.activation_bytes == 0
    else:  # both sides on every host layer: the device's rows only crossed
        assert s.split_layers >= NEW_TOKENS * host.host_layers and s.cpu_layers == 0
        assert 0 < host.fraction < 1 and s.activation_bytes > 0 and s.cpu_seconds > 0
        assert 0 < s.weight_bytes_h2d < s.split_layers * host.layer_bytes
    assert host.placement()["host_bytes_per_token"] > 0


def test_auto_computes_on_the_cpu_without_a_device(checkpoint) -> None:  # type: ignore[no-untyped-def]
    """On a CPU-only engine a stream would only copy: auto takes the CPU path."""
    engine = make_engine(checkpoint("llama3", num_hidden_layers=3), gpu_layers=2)
    engine.generate([[1, 2, 3]], replace(GREEDY, max_tokens=2))
    host = engine.host_layers
    assert host is not None and host.compute == "auto"
    assert host.stats.cpu_layers > 0 and host.stats.streamed_layers == 0


def test_auto_streams_steps_above_the_crossover(checkpoint) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine(checkpoint("llama3", num_hidden_layers=3), gpu_layers=1)
    host = engine.host_layers
    assert host is not None and host.compute == "auto"
    host.cpu_max_tokens = 8
    assert [host.choose(t) for t in (1, 8, 9, 512)] == ["host", "host", "stream", "stream"]
    for compute, want in (("cpu", "host"), ("split", "host"), ("stream", "stream")):
        host.compute = compute  # type: ignore[assignment]
        assert host.choose(512 if compute != "stream" else 1) == want


def test_memory_plan_counts_resident_layers_only(checkpoint) -> None:  # type: ignore[no-untyped-def]
    """The plan's weights drop by every host layer but the two staging slots."""
    path = checkpoint("llama3", num_hidden_layers=3)
    whole = make_engine(path)
    split = make_engine(path, gpu_layers=0)
    host = split.host_layers
    assert host is not None and host.layer_bytes > 0
    assert whole.plan.weights - split.plan.weights == (3 - 2) * host.layer_bytes
    assert weights_bytes(split.loaded.model) == split.plan.weights


@pytest.mark.parametrize(("room", "resident"), [(1.5, 1), (1.005, 0)])
def test_gpu_layers_auto_keeps_what_the_budget_holds(checkpoint, room, resident) -> None:  # type: ignore[no-untyped-def]
    """auto: with a fixed KV pool that leaves room for `room` layers beyond the staging slots,
    `resident` layers stay: one layer fits in 1.5, not in 1.005 (auto counts a resident layer
    RESIDENT_SLACK larger, for what the allocator holds beyond its bytes)."""
    assert RESIDENT_SLACK > 0.005
    path = checkpoint("llama3", num_hidden_layers=3, intermediate_size=2048)  # block << layer
    loaded = load_model(str(path), CPU)
    lb = sum(
        p.numel() * p.element_size()
        for name, p in loaded.model.layers[0].named_parameters()
        if "layernorm" not in name
    )
    config = EngineConfig(model=str(path), device="cpu", gpu_memory_mb=256, max_model_len=64)
    plan, _ = plan_engine_memory(config, loaded.model, CPU, offloaded=lb)  # all but staging
    spare = int(room * lb) // plan.block_bytes + 1  # blocks worth `room` layers
    blocks = plan.num_blocks - spare
    engine = Engine(replace(config, num_kv_blocks=blocks, gpu_layers="auto"), loaded)
    assert engine.host_layers is not None and engine.host_layers.gpu_layers == resident
    assert engine.plan.num_blocks == blocks


def test_gpu_layers_out_of_range_names_the_key(checkpoint) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError, match=r"weights\.gpu_layers=4 is out of range: allowed 0\.\.3"):
        make_engine(checkpoint("llama3", num_hidden_layers=3), gpu_layers=4)
    with pytest.raises(ConfigError, match=r"weights\.gpu_layers=-1 is out of range: allowed >= 0"):
        parse_config({"weights": {"gpu_layers": -1}})
    with pytest.raises(ConfigError, match=r"weights\.host_layer_compute"):
        parse_config({"weights": {"host_layer_compute": "gpu"}})
    config = parse_config({"weights": {"gpu_layers": 2, "host_layer_compute": "stream"}})
    engine_config = config.engine_config("cpu")
    assert (engine_config.gpu_layers, engine_config.host_layer_compute) == (2, "stream")


def test_host_layers_turn_decode_graphs_off(checkpoint) -> None:  # type: ignore[no-untyped-def]
    """CPU twin of the CUDA test below: no decode graph captures host layers."""
    path = checkpoint("llama3", num_hidden_layers=3)
    config = EngineConfig(model=str(path), device="cpu", max_graph_batch=8)
    loaded = load_model(str(path), CPU)
    assert graph_batch_size(config, loaded.model) == 8
    engine = Engine(replace(config, gpu_layers=1), loaded)
    assert graph_batch_size(config, engine.loaded.model) == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_host_layers_decode_eager_on_cuda(checkpoint) -> None:  # type: ignore[no-untyped-def]
    path = checkpoint("llama3", num_hidden_layers=3)
    prompts = sample_prompts(path, 2, [9, 23])
    expected = hf_greedy(path, prompts, NEW_TOKENS)
    for compute in ("cpu", "stream", "split", "auto"):
        engine = Engine(
            EngineConfig(
                model=str(path),
                device="cuda",
                dtype="float32",
                gpu_layers=1,
                host_layer_compute=compute,  # type: ignore[arg-type]
            )
        )
        try:  # released before the next: with no budget each engine's KV fills the device
            assert engine.runner.graphs is None
            assert [c.token_ids for c in engine.generate(prompts, GREEDY)] == expected
            host = engine.host_layers
            assert host is not None
            if compute in ("split", "auto"):  # auto on CUDA splits decode at the timed share
                assert 0 < host.fraction < 1 and host.stats.split_layers > 0
            if compute == "auto":
                assert host.cpu_max_tokens is not None and host.cpu_max_tokens >= 1
        finally:
            engine.release()


def test_auto_streams_prefill_and_computes_decode_on_the_cpu(checkpoint) -> None:  # type: ignore[no-untyped-def]
    """One run with both paths: auto with the crossover at one token (as the latency model
    sets it on CUDA) streams the prefills and computes the decodes on the CPU, exactly."""
    path = checkpoint("qwen2", num_hidden_layers=3)
    prompts = sample_prompts(path, 2, [9, 23])
    expected = hf_greedy(path, prompts, NEW_TOKENS)
    engine = make_engine(path, gpu_layers=1, decode_steps=1, max_num_seqs=1)
    host = engine.host_layers
    assert host is not None
    host.cpu_max_tokens = 1
    assert [c.token_ids for c in engine.generate(prompts, GREEDY)] == expected
    assert host.stats.streamed_layers == 2 * host.host_layers  # one prefill per prompt
    assert host.stats.cpu_layers == 2 * (NEW_TOKENS - 1) * host.host_layers


@pytest.mark.parametrize(
    ("compute", "grouped"), [("cpu", False), ("split", False), ("stream", True)]
)
def test_steps_that_wait_on_the_cpu_decode_one_at_a_time(checkpoint, compute, grouped) -> None:  # type: ignore[no-untyped-def]
    """A decode step whose host layers have a CPU share waits for the host at every
    projection, so decode_steps does not group it (a group would hand its first token over
    only after its second step: B7's gaps and measured step doubled on the H200); a streamed
    step has no such wait and keeps the group. Tokens stay HF's either way."""
    path = checkpoint("llama3", num_hidden_layers=3)
    prompts = sample_prompts(path, 1, [9])
    expected = hf_greedy(path, prompts, NEW_TOKENS)
    engine = make_engine(path, gpu_layers=1, host_layer_compute=compute, decode_steps=4)
    groups: list[int] = []
    run = engine.runner.decode_steps

    def counted(sched, steps, hot_only=False):  # type: ignore[no-untyped-def]
        groups.append(steps)
        return run(sched, steps, hot_only)

    engine.runner.decode_steps = counted  # type: ignore[method-assign]
    assert [c.token_ids for c in engine.generate(prompts, GREEDY)] == expected
    assert bool(groups) == grouped and all(g == 4 for g in groups[:-1])


def test_untied_embedding_table_moves_to_host_memory(checkpoint) -> None:  # type: ignore[no-untyped-def]
    """Beside host layers an untied embedding table lives in host memory too (its bytes go
    to resident layers): the plan's weights drop by it, and the tokens stay HF's."""
    path = checkpoint("mistral", num_hidden_layers=3)
    prompts = sample_prompts(path, 2, [9, 23])
    expected = hf_greedy(path, prompts, NEW_TOKENS)
    whole = make_engine(path)
    engine = make_engine(path, gpu_layers=2, host_layer_compute="split")
    assert isinstance(engine.loaded.model.embed_tokens, HostEmbedding)
    host = engine.host_layers
    assert host is not None
    table = engine.loaded.model.embed_tokens.weight
    table_bytes = table.numel() * table.element_size()
    assert whole.plan.weights - engine.plan.weights == table_bytes + (1 - 2) * host.layer_bytes
    assert [c.token_ids for c in engine.generate(prompts, GREEDY)] == expected
