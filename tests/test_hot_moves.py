"""Hot blocks moving to Warm and back: an int8 / int4 Hot cache's blocks as they are (no
second quantization), and sequences that each fit Hot taking turns there (time slicing)."""

from __future__ import annotations

import pytest

from hybridgen.sampling.params import SamplingParams
from tests.engine_helpers import small_engine
from tests.hf_reference import hf_greedy, sample_prompts

NEW_TOKENS = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


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
    unbudgeted = small_engine(path, hot_codec=codec)
    expected = [c.token_ids for c in unbudgeted.generate(prompts, GREEDY)]
    unbudgeted.release()
    engine = small_engine(
        path, hot_codec=codec, warm_codec=codec, num_kv_blocks=6, max_num_seqs=2,
        warm_pool_mb=2, attn_warm=mode, warm_split=0.5,
    )  # fmt: skip
    assert [c.token_ids for c in engine.generate(prompts, GREEDY)] == expected
    st = engine.warm.stats  # type: ignore[union-attr]
    assert st.spilled_blocks >= (150 + 97 + 2 * NEW_TOKENS) // 8 - 6 - 2
    assert st.warm_keys > 3 * st.hot_keys
    assert (st.cpu.calls > 0) == (mode != "gpu")
    engine.release()


@pytest.mark.parametrize("hot", ["native", "int4"])
def test_sequences_that_fit_hot_one_at_a_time_take_turns(checkpoint, hot: str) -> None:  # type: ignore[no-untyped-def]
    """Time slicing: Hot holds 12 blocks (96 tokens); three sequences of 50-61 prompt tokens
    and 32 new ones each fit it alone, not two at once. With hot_turn_tokens 8 they take
    turns: every one has produced a token before the first finishes, and each swaps to Warm
    between turns with its loaded copy kept, so no block crosses to Warm twice. Tokens are
    those of the run with no budget (HF's with native Hot)."""
    path = checkpoint("llama3")
    prompts = sample_prompts(path, 3, [60, 50, 61])
    if hot == "native":
        expected = hf_greedy(path, prompts, NEW_TOKENS)
    else:
        unbudgeted = small_engine(path, hot_codec=hot).generate(prompts, GREEDY)
        expected = [c.token_ids for c in unbudgeted]
    engine = small_engine(
        path, num_kv_blocks=12, warm_pool_mb=2, hot_codec=hot,
        warm_codec="lossless" if hot == "native" else hot, hot_turn_tokens=8,
    )  # fmt: skip
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
