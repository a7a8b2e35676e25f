"""Self-speculative decoding over the Warm tier (kvtiers/warm_drafts.py): drafts attending
Hot alone, checked over Hot and Warm in one step. The tokens must be exactly plain decoding's
(HF's, greedy; the same seeded samples), whatever the drafts are, and Warm must be read once
per round instead of once per token."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from hybridgen.config.engine import ConfigError, EngineConfig
from hybridgen.engine.scheduler import ScheduledBatch
from hybridgen.engine.sequence import Sequence
from hybridgen.kvtiers.warm_drafts import STACKED_HEADS, WarmDrafts
from hybridgen.kvtiers.warm_tier import WarmTier
from hybridgen.models.presets import PRESETS
from hybridgen.sampling.params import SamplingParams
from tests.engine_helpers import small_engine
from tests.hf_reference import hf_greedy, sample_prompts

NEW_TOKENS = 40
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
TIGHT = {"num_kv_blocks": 16, "warm_pool_mb": 2, "max_num_seqs": 2, "warm_split": 0.5}
"""Hot holds 128 tokens: prompts of 150 and 97 and their 80 new tokens live mostly in Warm.
(This tiny random model's tokens depend on every key: drafts that see a smaller share of
them are rarely confirmed.)"""


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["cpu", "gpu", "split"])
def test_drafts_keep_hf_greedy_tokens(checkpoint, mode: str) -> None:  # type: ignore[no-untyped-def]
    """Two sequences mostly in lossless Warm, 4 drafts a round: HF's greedy tokens in every
    attn_warm mode; drafts were confirmed (some rounds gave several tokens) and, for this
    model, some were not (the rejection path ran)."""
    path = checkpoint("llama3")
    prompts = sample_prompts(path, 2, [150, 97])
    expected = hf_greedy(path, prompts, NEW_TOKENS)
    engine = small_engine(path, attn_warm=mode, warm_draft_tokens=4, **TIGHT)
    assert [c.token_ids for c in engine.generate(prompts, GREEDY)] == expected
    st = engine.drafts.stats
    assert st.rounds > 0 and 0 < st.accepted < st.drafted
    assert engine.warm.stats.warm_keys > engine.warm.stats.hot_keys  # type: ignore[union-attr]
    engine.release()


@pytest.mark.slow
def test_wrong_drafts_cost_speed_not_tokens(checkpoint, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Every draft replaced by a wrong token: not one is accepted, each round yields the one
    token its check step computes exactly, and the tokens are still HF's."""
    path = checkpoint("llama3")
    prompts = sample_prompts(path, 1, [150])
    expected = hf_greedy(path, prompts, NEW_TOKENS)
    engine = small_engine(path, attn_warm="gpu", warm_draft_tokens=3, **TIGHT)
    runner, vocab = engine.runner, engine.spec.vocab_size
    real = runner.execute_decode

    def wrong(sched, steps, hot_only=False):  # type: ignore[no-untyped-def]
        out = real(sched, steps, hot_only)
        if hot_only:
            for step in out:
                for s in step:
                    s.token_id = (s.token_id + 1) % vocab
        return out

    monkeypatch.setattr(runner, "execute_decode", wrong)
    assert [c.token_ids for c in engine.generate(prompts, GREEDY)] == expected
    st = engine.drafts.stats
    assert st.accepted == 0 and st.rounds >= NEW_TOKENS - 4
    engine.release()


@pytest.mark.slow
def test_seeded_samples_are_plain_decodings(checkpoint) -> None:  # type: ignore[no-untyped-def]
    """Sampling at temperature 0.9 with a seed: row j of a check step draws the noise of plain
    decoding's j-th step, so the tokens are those of the same engine without drafts."""
    path = checkpoint("llama3")
    prompts = sample_prompts(path, 2, [150, 97])
    sampled = {"temperature": 0.9, "top_p": 0.95, "max_tokens": NEW_TOKENS, "logprobs": 2}
    params = [SamplingParams(seed=7 + i, ignore_eos=True, **sampled) for i in range(2)]
    runs = []
    for drafts in (0, 4):
        engine = small_engine(path, attn_warm="gpu", warm_draft_tokens=drafts, **TIGHT)
        runs.append(engine.generate(prompts, params))
        accepted = engine.drafts.stats.accepted
        engine.release()
    assert [c.token_ids for c in runs[1]] == [c.token_ids for c in runs[0]]
    for a, b in zip(runs[0], runs[1], strict=True):
        assert b.logprobs == pytest.approx(a.logprobs, abs=1e-4)
    assert accepted > 0


@pytest.mark.slow
def test_a_round_reads_warm_once(checkpoint) -> None:  # type: ignore[no-untyped-def]
    """attn_warm gpu: the Warm bytes read per generated token fall with drafts (one read per
    round of up to 5 tokens, not one per token)."""
    path = checkpoint("llama3")
    prompts = sample_prompts(path, 1, [150])
    per_token = []
    for drafts in (0, 4):
        engine = small_engine(path, attn_warm="gpu", warm_draft_tokens=drafts, **TIGHT)
        engine.generate(prompts, GREEDY)
        per_token.append(engine.warm.stats.h2d_bytes / NEW_TOKENS)  # type: ignore[union-attr]
        rounds = engine.drafts.stats.rounds
        engine.release()
    assert per_token[1] < per_token[0] * rounds / (NEW_TOKENS - 8)


@pytest.mark.parametrize("mode", ["cpu", "gpu"])
def test_stacked_rows_match_one_row_each(mode: str) -> None:
    """WarmContext with r rows per sequence (their queries stacked onto the kv heads) gives
    each row what attending alone gives, on fresh random K/V and queries."""
    spec = dataclasses.replace(PRESETS["tiny-llama"], dtype=torch.float32)
    cpu, size, rows = torch.device("cpu"), 8, 3
    tier = WarmTier(spec, size, "lossless", 4, mode, None, cpu)
    shape = (5, size, spec.num_kv_heads, spec.head_dim)
    kv = [(torch.randn(shape), torch.randn(shape)) for _ in range(spec.num_layers)]
    slots = [tier.store(kv, [0, 1, 2]), tier.store(kv, [3, 4])]
    q = torch.randn(2 * rows, spec.num_heads, spec.head_dim)
    stacked = tier.context(slots, [40, 30], rows)
    alone = tier.context([s for s in slots for _ in range(rows)], [40] * rows + [30] * rows)
    assert stacked is not None and alone is not None
    for layer in range(spec.num_layers):
        out, lse = stacked.decode_partial(layer, q, 0.3)
        ref_out, ref_lse = alone.decode_partial(layer, q, 0.3)
        torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
    tier.close()


def test_draft_tokens_range() -> None:
    with pytest.raises(ConfigError, match=r"warm_draft_tokens=17 is out of range: allowed 0\.\.16"):
        EngineConfig(model="tiny-llama", warm_draft_tokens=17)


@pytest.mark.parametrize(("heads", "kv_heads", "drafts"), [(32, 8, 16), (64, 8, 15), (64, 2, 3)])
def test_drafts_fit_the_stacked_head_tile(heads: int, kv_heads: int, drafts: int) -> None:
    """k + 1 rows of G query heads each stack onto a kv head: k is cut so that (k + 1) G stays
    within STACKED_HEADS (128) for models with many query heads per kv head."""
    spec = SimpleNamespace(num_heads=heads, num_kv_heads=kv_heads)
    runner = SimpleNamespace(spec=spec)
    got = WarmDrafts(16, runner, None, 1024).tokens  # type: ignore[arg-type]
    assert got == drafts and (got + 1) * heads // kv_heads <= STACKED_HEADS


def test_no_drafts_beside_a_one_token_prompt_chunk() -> None:
    """A prompt's last-but-some token scheduled alone counts as a 1-token row like a decode,
    but it is not decoding: a batch holding one drafts nothing (and reserves nothing)."""
    spec = SimpleNamespace(num_heads=4, num_kv_heads=2)
    drafts = WarmDrafts(4, SimpleNamespace(spec=spec), None, 1024)  # type: ignore[arg-type]
    params = SamplingParams(temperature=0.0, max_tokens=8)
    decoding = Sequence("d", 40, list(range(41)), params, 0, 0)
    decoding.num_computed_tokens, decoding.warm_slots = 40, [0, 1]
    chunk = Sequence("p", 40, list(range(40)), params, 0, 1)
    chunk.num_computed_tokens = 30  # 10 prompt tokens left, 1 of them this step
    assert drafts.length(ScheduledBatch([decoding, chunk], [1, 1])) == 0
