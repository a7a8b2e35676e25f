"""Hot blocks moving to Warm and back: an int8 / int4 Hot cache's blocks as they are (no
second quantization), sequences that each fit Hot taking turns there (time slicing), and the
Warm copies a loaded sequence keeps, which give way when Warm is short."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hybridgen.engine.block_pool import BlockPool
from hybridgen.engine.sequence import Sequence
from hybridgen.kvtiers.warm_offload import WarmOffload
from hybridgen.kvtiers.warm_pool import HEADER_SIZE, slot_bytes_for
from hybridgen.kvtiers.warm_tier import WarmTier, warm_codec_for
from hybridgen.models.presets import PRESETS
from hybridgen.sampling.params import SamplingParams
from tests.engine_helpers import reference_tokens, small_engine
from tests.hf_reference import sample_prompts

NEW_TOKENS = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["cpu", "gpu", "split"])
@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_a_quantized_hot_cache_spills_its_blocks_as_they_are(  # type: ignore[no-untyped-def]
    checkpoint, codec: str, mode: str
) -> None:
    """An int8 / int4 Hot cache of 6 blocks beside a Warm tier of its codec: its blocks move
    to Warm byte for byte (no second quantization), so the greedy tokens are those of the
    same Hot codec with no budget, in every attn_warm mode, with most keys read from Warm."""
    path = checkpoint("llama3")
    prompts = sample_prompts(path, 2, [150, 97])
    expected = reference_tokens(path, prompts, codec, NEW_TOKENS)
    engine = small_engine(
        path,
        hot_codec=codec,
        warm_codec=codec,
        num_kv_blocks=6,
        max_num_seqs=2,
        warm_pool_mb=2,
        attn_warm=mode,
        warm_split=0.5,
    )
    assert [c.token_ids for c in engine.generate(prompts, GREEDY)] == expected
    st = engine.warm.stats  # type: ignore[union-attr]
    assert st.spilled_blocks >= (150 + 97 + 2 * NEW_TOKENS) // 8 - 6 - 2
    assert st.warm_keys > 3 * st.hot_keys
    assert (st.cpu.calls > 0) == (mode != "gpu")
    engine.release()


@pytest.mark.slow
@pytest.mark.parametrize("hot", ["native", "int4"])
def test_sequences_that_fit_hot_one_at_a_time_take_turns(checkpoint, hot: str) -> None:  # type: ignore[no-untyped-def]
    """Time slicing: Hot holds 12 blocks (96 tokens); three sequences of 50-61 prompt tokens
    and 32 new ones each fit it alone, not two at once. With hot_turn_tokens 8 they take
    turns: every one has produced a token before the first finishes, and each swaps to Warm
    between turns with its loaded copy kept, so no block crosses to Warm twice. Tokens are
    those of the run with no budget (HF's with native Hot)."""
    path = checkpoint("llama3")
    prompts = sample_prompts(path, 3, [60, 50, 61])
    expected = reference_tokens(path, prompts, hot, NEW_TOKENS)
    engine = small_engine(
        path,
        num_kv_blocks=12,
        warm_pool_mb=2,
        hot_codec=hot,
        warm_codec="lossless" if hot == "native" else hot,
        hot_turn_tokens=8,
        spill_policy="always",  # the mechanism: turns whenever the next one does not fit
    )
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, GREEDY)
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(3)}
    started_before_a_finish = None
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            if out.finished and started_before_a_finish is None:
                started_before_a_finish = all(tokens.values())
    assert [tokens[f"r{i}"] for i in range(3)] == expected
    assert started_before_a_finish
    st = engine.warm.stats  # type: ignore[union-attr]
    assert engine.scheduler.turns_ended >= 6 and st.spilled_blocks == 0
    full_blocks = sum((len(p) + NEW_TOKENS) // 8 for p in prompts)
    assert 0 < st.d2h_bytes <= full_blocks * engine.warm.pool.slot_bytes  # type: ignore[union-attr]
    assert st.loaded_blocks >= engine.scheduler.turns_ended
    engine.release()


def test_copies_give_way_when_warm_is_short() -> None:
    """A sequence loaded back into Hot keeps its Warm slots as copies, but they only save a
    later store: when Warm has no other room for a swap out, the copies of other sequences
    are dropped, and the swap succeeds instead of falling back to recomputing."""
    spec = dataclasses.replace(PRESETS["tiny-llama"], dtype=torch.float32)
    size, cpu = 16, torch.device("cpu")
    slot = slot_bytes_for(warm_codec_for(spec, "lossless", size, "native"), spec.num_layers)
    tier = WarmTier(spec, size, "lossless", (HEADER_SIZE + 6 * slot) / 2**20, "gpu", None, cpu)
    assert tier.pool.capacity == 6
    shape = (12, size, spec.num_kv_heads, spec.head_dim)
    kv = [(torch.randn(shape), torch.randn(shape)) for _ in range(spec.num_layers)]
    pool = BlockPool(12, size)
    offload = WarmOffload(tier, pool, kv, prefix_reuse=False)

    def seq(name: str, blocks: int) -> Sequence:
        s = Sequence(name, blocks * size, [1] * (blocks * size + 1), GREEDY, 0, 0)
        s.block_ids, s.num_computed_tokens = pool.allocate(blocks), blocks * size
        return s

    a, b = seq("a", 4), seq("b", 3)
    assert offload.swap_out(a) and len(a.warm_slots) == 4  # 2 slots left
    assert offload.load(a) and len(a.warm_copy) == 4 and tier.pool.num_free == 2
    assert offload.swap_out(b)  # 3 blocks: a's copies make way
    assert a.warm_copy == [] and len(b.warm_slots) == 3 and tier.pool.num_free == 3
    offload.release(a)
    offload.release(b)
    assert tier.pool.num_free == 6
    tier.close()
