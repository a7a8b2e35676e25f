"""The engine against HF transformers on the same tiny checkpoints (CPU, fp32, greedy)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridgen.config.engine import EngineConfig
from hybridgen.engine.engine import Engine
from hybridgen.sampling.params import SamplingParams
from tests.conftest import KINDS
from tests.hf_reference import hf_greedy, sample_prompts

NEW_TOKENS = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def make_engine(path: Path, **options: object) -> Engine:
    return Engine(EngineConfig(model=str(path), device="cpu", **options))  # type: ignore[arg-type]


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_concurrent_greedy_matches_hf(checkpoint, kind: str) -> None:  # type: ignore[no-untyped-def]
    """Three prompts of different lengths, run together, give HF's greedy tokens."""
    path = checkpoint(kind)
    prompts = sample_prompts(path, 3, [7, 29, 83])
    expected = hf_greedy(path, prompts, NEW_TOKENS)
    got = make_engine(path).generate(prompts, GREEDY)
    assert [c.token_ids for c in got] == expected


@pytest.mark.slow
def test_request_joining_midway_matches_hf(checkpoint) -> None:  # type: ignore[no-untyped-def]
    path = checkpoint("llama3")
    first, second = sample_prompts(path, 2, [40, 13])
    expected = hf_greedy(path, [first, second], NEW_TOKENS)
    engine = make_engine(path)
    engine.add_request("a", first, GREEDY)
    tokens: dict[str, list[int]] = {"a": [], "b": []}
    while len(tokens["a"]) < 10:  # a is decoding when b arrives
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    assert 10 <= len(tokens["a"]) < NEW_TOKENS
    engine.add_request("b", second, GREEDY)
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    assert [tokens["a"], tokens["b"]] == expected


@pytest.mark.slow
def test_chunked_prefill_and_preemption_match_hf(checkpoint) -> None:  # type: ignore[no-untyped-def]
    """A tiny token budget chunks every prompt; a tiny KV pool forces preemption."""
    path = checkpoint("mistral")  # sliding window 16: chunks cross the window edge
    prompts = sample_prompts(path, 4, [50, 21, 66, 9])
    expected = hf_greedy(path, prompts, NEW_TOKENS)
    engine = make_engine(
        path,
        max_num_batched_tokens=16,
        max_num_seqs=4,
        block_size=8,
        num_kv_blocks=24,
        max_model_len=128,
    )
    got = engine.generate(prompts, GREEDY)
    assert [c.token_ids for c in got] == expected
    assert engine.stats.preemptions > 0, "24 blocks cannot hold four ~100-token sequences"
    assert engine.stats.max_step_tokens <= 16
    assert engine.pool.num_free == engine.pool.num_blocks


@pytest.mark.slow
def test_batch_invariance(checkpoint) -> None:  # type: ignore[no-untyped-def]
    path = checkpoint("qwen2")
    prompts = sample_prompts(path, 6, [12, 57, 33, 5, 71, 20])
    engine = make_engine(path)
    alone = engine.generate([prompts[0]], GREEDY)[0].token_ids
    batched = engine.generate(prompts, GREEDY)[0].token_ids
    assert alone == batched


@pytest.mark.slow
def test_seeded_sampling_is_reproducible(checkpoint) -> None:  # type: ignore[no-untyped-def]
    path = checkpoint("llama3")
    prompt = sample_prompts(path, 1, 20)[0]
    engine = make_engine(path)

    def sample(seed: int, company: int = 0) -> list[int]:
        params = SamplingParams(
            temperature=1.0, top_p=0.95, seed=seed, max_tokens=24, ignore_eos=True
        )
        others = sample_prompts(path, company, 15) if company else []
        return engine.generate([prompt, *others], params)[0].token_ids

    first = sample(1234)
    assert sample(1234) == first
    assert sample(1234, company=3) == first, "batch composition must not change a seeded draw"
    assert sample(4321) != first


def test_sharded_bf16_checkpoint_loads(checkpoint) -> None:  # type: ignore[no-untyped-def]
    import torch

    path = checkpoint("llama3", max_shard_size="100KB", dtype=torch.bfloat16)
    shards = list(path.glob("model-*.safetensors"))
    assert len(shards) > 1 and (path / "model.safetensors.index.json").exists()
    engine = make_engine(path, dtype="float32")
    prompt = sample_prompts(path, 1, 16)[0]
    # bf16 weights upcast to fp32 run the same model as HF loading the same bf16 checkpoint.
    expected = hf_greedy(path, [prompt], 8)[0]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    assert engine.generate([prompt], params)[0].token_ids == expected


@pytest.mark.slow
def test_second_turn_reuses_the_prefix_and_matches_hf(checkpoint) -> None:  # type: ignore[no-untyped-def]
    """A chat's second turn (first prompt + its answer + new tokens) computes only the new
    tokens: the prefix cache serves every full block of the first turn, and the tokens are
    still HF's. The same engine without prefix reuse computes everything."""
    path = checkpoint("llama3")
    first, extra = sample_prompts(path, 2, [70, 12])
    engine = make_engine(path, block_size=8)
    turn1 = engine.generate([first], GREEDY)[0].token_ids
    second = first + turn1 + extra
    expected = hf_greedy(path, [second], NEW_TOKENS)
    before = engine.scheduler.prefix_hit_tokens
    assert engine.generate([second], GREEDY)[0].token_ids == expected[0]
    # Turn 1's KV covers first + turn1[:-1] (the last sampled token was never fed back).
    assert engine.scheduler.prefix_hit_tokens - before == (len(first) + NEW_TOKENS - 1) // 8 * 8
    cold = make_engine(path, block_size=8, prefix_reuse=False)
    cold.generate([first], GREEDY)
    assert cold.generate([second], GREEDY)[0].token_ids == expected[0]
    assert cold.scheduler.prefix_hit_tokens == 0


@pytest.mark.slow
def test_preempted_sequence_resumes_from_its_cached_blocks(checkpoint) -> None:  # type: ignore[no-untyped-def]
    """Preemption keeps the victim's computed blocks cached; when nothing else needed them,
    its readmission takes them back instead of recomputing (and matches HF)."""
    path = checkpoint("llama3")
    prompts = sample_prompts(path, 2, [40, 33])
    expected = hf_greedy(path, prompts, NEW_TOKENS)
    engine = make_engine(path, block_size=8, num_kv_blocks=12, max_num_seqs=2)
    got = engine.generate(prompts, GREEDY)
    assert [c.token_ids for c in got] == expected
    assert engine.stats.preemptions > 0
    assert engine.scheduler.prefix_hit_tokens == 0  # first admissions shared nothing
    assert engine.scheduler.resumed_tokens > 0
