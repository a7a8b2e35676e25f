"""The batched sampler: greedy, seeded draws, filters, penalties and logprobs."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from hybridgen.sampling.params import SamplingParams
from hybridgen.sampling.sampler import Sampler, SamplingBatch, apply_penalties, first_argmax
from tests.sampling_helpers import V, chi_square, draws, sample

# ---------------------------------------------------------------------------------------------
# Greedy


def test_greedy_equals_argmax_with_ties_and_low_precision() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, V)
    logits[2, 5] = logits[2, 9] = logits[2].max() + 1  # tie: lowest index wins
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, top_k=1)] * 3
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = logits.to(dtype)
        out = sample(x, params)
        assert torch.equal(out.token_ids, x.float().argmax(dim=-1))
        assert out.token_ids.dtype == torch.int64
    assert sample(logits, params).token_ids[2] == 5


def test_mixed_greedy_and_random_rows() -> None:
    torch.manual_seed(1)
    logits = torch.randn(4, V)
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.3),
        SamplingParams(temperature=0),
        SamplingParams(top_p=0.8),
    ]
    out = sample(logits, params, seeds=[7, 8, 9, 10], steps=[1, 2, 3, 4])
    assert out.token_ids[0] == logits[0].argmax() and out.token_ids[2] == logits[2].argmax()
    for row in (1, 3):
        alone = sample(logits[row : row + 1], [params[row]], seeds=[7 + row], steps=[1 + row])
        assert alone.token_ids[0] == out.token_ids[row]


# ---------------------------------------------------------------------------------------------
# Reproducibility


@pytest.mark.parametrize(
    "target",
    [
        SamplingParams(temperature=1.0, top_k=20, top_p=0.95, seed=42),
        SamplingParams(temperature=1.0, seed=42),  # no filter, beside rows that filter
        SamplingParams(temperature=0.8, top_k=6, seed=42),
    ],
)
def test_same_seed_and_step_same_token_across_batches(target: SamplingParams) -> None:
    torch.manual_seed(2)
    others = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.5, min_p=0.1, repetition_penalty=1.3),
        SamplingParams(temperature=2.0, presence_penalty=1.0, frequency_penalty=0.5),
        SamplingParams(top_k=3, logprobs=5),
    ]
    for step in range(8):
        row = torch.randn(V)
        alone = sample(row[None], [target], seeds=[42], steps=[step]).token_ids[0]
        for position in range(5):
            params = [*others[:position], target, *others[position:]]
            logits = torch.randn(5, V)
            logits[position] = row
            seeds = [1000 + i for i in range(5)]
            seeds[position] = 42
            steps = [(step * 7 + i) % 11 for i in range(5)]
            steps[position] = step
            ids = [[i, i + 1] for i in range(5)]
            out = sample(logits, params, seeds, steps, prompt_ids=ids, output_ids=ids)
            assert out.token_ids[position] == alone


def test_different_seeds_give_different_sequences() -> None:
    torch.manual_seed(3)
    logits = torch.randn(1, V) * 0.5  # flat enough that most tokens are plausible
    params = [SamplingParams(temperature=1.0)]
    sequences = set()
    for seed in range(8):
        seq = tuple(
            int(sample(logits, params, seeds=[seed], steps=[step]).token_ids[0])
            for step in range(24)
        )
        assert len(set(seq)) > 5  # the step changes the draw too
        sequences.add(seq)
    assert len(sequences) == 8


# ---------------------------------------------------------------------------------------------
# Distributions


def test_seeded_draws_follow_softmax_over_temperature() -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, -3.0])
    temperature = 0.7
    n = 40000
    tokens = draws(logits, SamplingParams(temperature=temperature), n)
    counts = torch.bincount(tokens, minlength=8).double()
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    # 7 degrees of freedom: P(chi2 > 40) ~ 1e-6, so a biased noise source fails this.
    assert chi_square(counts, probs) < 40
    # One seed over many steps is an equally valid stream.
    steps = list(range(n))
    by_step = sample(
        logits.expand(n, -1).contiguous(),
        [SamplingParams(temperature=temperature)] * n,
        seeds=[77] * n,
        steps=steps,
    ).token_ids
    assert chi_square(torch.bincount(by_step, minlength=8).double(), probs) < 40


def test_rows_without_top_k_are_not_filtered_by_other_rows() -> None:
    # Alternate a top-3 row and an unfiltered row: the unfiltered rows must follow the full
    # softmax even though the batch takes the top-k path.
    logits = torch.tensor([1.0, 0.8, 0.6, 0.4, 0.2, 0.0, -0.2, -0.4])
    n = 8000
    params = [SamplingParams(top_k=3), SamplingParams()] * (n // 2)
    tokens = sample(logits.expand(n, -1).contiguous(), params).token_ids
    assert set(tokens[0::2].tolist()) == {0, 1, 2}
    counts = torch.bincount(tokens[1::2], minlength=8).double()
    assert chi_square(counts, torch.softmax(logits.double(), -1)) < 40


def test_top_k_never_leaves_the_top_k() -> None:
    torch.manual_seed(4)
    logits = torch.randn(V) * 0.3
    allowed = set(logits.topk(5).indices.tolist())
    tokens = draws(logits, SamplingParams(temperature=1.5, top_k=5), 5000)
    assert set(tokens.tolist()) == allowed
    # Distribution among the survivors is the renormalised softmax.
    probs = torch.full((V,), -math.inf)
    probs[list(allowed)] = logits[list(allowed)] / 1.5
    counts = torch.bincount(tokens, minlength=V).double()
    assert chi_square(counts, torch.softmax(probs.double(), -1)) < 35


# Probabilities 0.4 / 0.3 / 0.2 / 0.1 scattered over positions so the sort matters.
_NUCLEUS_POS = [7, 2, 11, 0]


def _nucleus_logits() -> torch.Tensor:
    logits = torch.full((16,), -math.inf)
    logits[_NUCLEUS_POS] = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
    return logits


@pytest.mark.parametrize(
    ("top_p", "top_k", "kept"),
    [
        (0.39, 0, 1),  # the first token alone reaches 0.39
        (0.41, 0, 2),  # 0.4 < 0.41, so a second token is needed
        (0.69, 0, 2),  # 0.7 >= 0.69: minimal nucleus stops at two
        (0.71, 0, 3),
        (0.95, 0, 4),
        (1.0, 0, 4),
        (0.8, 2, 2),  # after top-2 renormalisation: 4/7, 3/7
        (0.5, 2, 1),  # 4/7 >= 0.5 already
        (0.6, 3, 2),  # top-3 renormalised: 4/9 < 0.6 <= 7/9
    ],
)
def test_top_p_keeps_minimal_nucleus(top_p: float, top_k: int, kept: int) -> None:
    params = SamplingParams(temperature=1.0, top_p=top_p, top_k=top_k)
    tokens = draws(_nucleus_logits(), params, 3000)
    assert set(tokens.tolist()) == set(_NUCLEUS_POS[:kept])


def test_top_k_rows_beside_top_p_rows() -> None:
    # The batch takes the sort path for everyone; the top-k-only row must still be cut at k.
    n = 4000
    params = [SamplingParams(top_k=2), SamplingParams(top_p=0.2), SamplingParams()] * (n // 4)
    params += [SamplingParams(top_k=3, top_p=0.75)] * (n - len(params))
    tokens = sample(_nucleus_logits().expand(n, -1).contiguous(), params).token_ids
    m = 3 * (n // 4)
    assert set(tokens[0:m:3].tolist()) == set(_NUCLEUS_POS[:2])
    assert set(tokens[1:m:3].tolist()) == set(_NUCLEUS_POS[:1])
    assert set(tokens[2:m:3].tolist()) == set(_NUCLEUS_POS)
    assert set(tokens[m:].tolist()) == set(_NUCLEUS_POS[:2])  # 4/9 < 0.75 <= 7/9


def test_ties_at_the_cut_are_kept() -> None:
    # Probabilities 0.4, 0.3, 0.3: the nucleus for 0.5 needs one 0.3 token, and both tied ones
    # stay (as both tied k-th tokens stay under top-k).
    logits = torch.tensor([0.4, 0.3, 0.3, 0.0]).log()
    for params in (SamplingParams(top_p=0.5), SamplingParams(top_k=2)):
        assert set(draws(logits, params, 2000).tolist()) == {0, 1, 2}


@pytest.mark.parametrize(
    ("min_p", "temperature"), [(0.35, 1.0), (0.19, 1.0), (0.55, 1.0), (0.35, 2.0), (0.2, 0.5)]
)
def test_min_p_threshold_after_temperature(min_p: float, temperature: float) -> None:
    base = torch.tensor([0.5, 0.25, 0.15, 0.1]).log()
    logits = torch.full((12,), -math.inf)
    positions = [3, 9, 0, 5]
    logits[positions] = base
    probs = torch.softmax(base / temperature, dim=-1)
    expected = {p for p, q in zip(positions, probs, strict=True) if q >= min_p * probs.max()}
    params = SamplingParams(temperature=temperature, min_p=min_p)
    assert set(draws(logits, params, 3000).tolist()) == expected


# ---------------------------------------------------------------------------------------------
# Penalties


def test_repetition_penalty_matches_transformers() -> None:
    transformers = pytest.importorskip("transformers")
    processor_cls = transformers.RepetitionPenaltyLogitsProcessor
    torch.manual_seed(5)
    logits = torch.randn(3, V) * 3
    prompts = [[1, 2, 3, 3], [4, 30, 31], [0]]
    outputs = [[5, 1], [], [6, 7, 6]]
    penalties = [1.3, 0.7, 2.0]
    params = [SamplingParams(repetition_penalty=p) for p in penalties]
    batch = SamplingBatch.build(params, [0, 1, 2], [0, 0, 0], prompts, outputs, V, "cpu")
    ours = apply_penalties(logits, batch)
    for row in range(3):
        input_ids = torch.tensor([prompts[row] + outputs[row]])
        expected = processor_cls(penalty=penalties[row])(input_ids, logits[row : row + 1].clone())
        assert torch.allclose(ours[row], expected[0], rtol=1e-6, atol=0)
    # Greedy uses the penalised logits.
    greedy = [SamplingParams(temperature=0, repetition_penalty=p) for p in penalties]
    out = sample(logits, greedy, prompt_ids=prompts, output_ids=outputs)
    assert torch.equal(out.token_ids, ours.argmax(dim=-1))


def test_presence_and_frequency_penalties_match_hand_reference() -> None:
    torch.manual_seed(6)
    logits = torch.randn(3, V)
    prompts = [[9, 9, 9], [1], [2]]
    outputs = [[1, 2, 2, 2, 5], [3, 3], []]
    params = [
        SamplingParams(presence_penalty=0.5, frequency_penalty=0.25),
        SamplingParams(presence_penalty=-1.0, frequency_penalty=2.0, repetition_penalty=1.5),
        SamplingParams(presence_penalty=2.0),
    ]
    batch = SamplingBatch.build(params, [0, 1, 2], [0, 0, 0], prompts, outputs, V, "cpu")
    ours = apply_penalties(logits, batch)
    expected = logits.clone()
    for row, p in enumerate(params):
        for token in set(prompts[row] + outputs[row]):  # repetition: prompt + output, once
            if p.repetition_penalty != 1.0:
                value = expected[row, token]
                pen = p.repetition_penalty
                expected[row, token] = value * pen if value < 0 else value / pen
        for token, count in Counter(outputs[row]).items():  # OpenAI: output only
            expected[row, token] -= p.presence_penalty + p.frequency_penalty * count
    assert torch.allclose(ours, expected, rtol=0, atol=1e-6)
    assert ours[0, 9] == logits[0, 9]  # prompt tokens are not presence-penalised


def test_penalty_ids_are_required_and_out_of_range_ids_are_ignored() -> None:
    params = [SamplingParams(frequency_penalty=1.0), SamplingParams()]
    with pytest.raises(ValueError, match="output_ids"):
        SamplingBatch.build(params, [0, 1], [0, 0], None, None, V, "cpu")
    batch = SamplingBatch.build(params, [0, 1], [0, 0], None, [[V + 3, -1, 4], [4]], V, "cpu")
    assert batch.output_counts is not None
    assert batch.output_counts.sum() == 1 and batch.output_counts[0, 4] == 1


# ---------------------------------------------------------------------------------------------
# Logprobs, fast paths, no host synchronisation


def test_logprobs_are_raw_log_softmax() -> None:
    torch.manual_seed(7)
    logits = torch.randn(4, V, dtype=torch.bfloat16) * 2
    params = [
        SamplingParams(temperature=0.5, logprobs=3, repetition_penalty=2.0),
        SamplingParams(temperature=0, logprobs=0),
        SamplingParams(top_k=4, logprobs=5),
        SamplingParams(),
    ]
    ids = [[0, 1, 2]] * 4
    out = sample(logits, params, prompt_ids=ids, output_ids=ids)
    raw = torch.log_softmax(logits.float(), dim=-1)
    assert out.logprobs is not None and out.logprobs.dtype == torch.float32
    assert torch.equal(out.logprobs, raw.gather(1, out.token_ids[:, None]).squeeze(1))
    assert out.top_logprobs is not None
    top_ids, top_values = out.top_logprobs
    assert top_ids.shape == (4, 5) and top_values.shape == (4, 5)
    assert torch.equal(top_values, raw.topk(5, dim=-1).values)
    assert torch.equal(raw.gather(1, top_ids), top_values)


def test_logprobs_absent_or_sampled_only() -> None:
    logits = torch.randn(2, V)
    out = sample(logits, [SamplingParams(), SamplingParams(temperature=0)])
    assert out.logprobs is None and out.top_logprobs is None
    out = sample(logits, [SamplingParams(logprobs=0), SamplingParams()])
    assert out.logprobs is not None and out.top_logprobs is None


def test_fast_path_flags() -> None:
    params = [SamplingParams(temperature=0, top_p=0.5, min_p=0.2)] * 2
    greedy = SamplingBatch.build(params, [0, 1], [0, 0], None, None, V, "cpu")
    assert greedy.all_greedy and not greedy.use_top_p and not greedy.use_min_p
    assert greedy.max_top_k == 0 and greedy.max_logprobs is None
    assert greedy.seen_mask is None and greedy.output_counts is None
    plain = SamplingBatch.build([SamplingParams(top_k=V)], [0], [0], None, None, V, "cpu")
    assert not plain.all_greedy and plain.max_top_k == 0 and not plain.use_top_p


def test_sampler_never_reads_device_values() -> None:
    # Meta tensors have no data: any .item() / .tolist() / data-dependent shape would raise.
    params = [
        SamplingParams(temperature=0),
        SamplingParams(top_k=5, top_p=0.9, min_p=0.1, repetition_penalty=1.2, logprobs=3),
        SamplingParams(top_k=3, presence_penalty=0.5, frequency_penalty=0.3),
    ]
    ids = [[1, 2], [3, 4, 4], [5]]
    batch = SamplingBatch.build(params, [1, 2, 3], [0, 1, 2], ids, ids, V, "meta")
    out = Sampler()(torch.empty(3, V, device="meta", dtype=torch.bfloat16), batch)
    assert out.token_ids.shape == (3,) and out.token_ids.dtype == torch.int64
    assert out.top_logprobs is not None and out.top_logprobs[0].shape == (3, 3)


def test_rejects_mismatched_shapes() -> None:
    batch = SamplingBatch.build([SamplingParams()], [0], [0], None, None, V, "cpu")
    with pytest.raises(ValueError, match="logits shape"):
        Sampler()(torch.randn(2, V), batch)
    with pytest.raises(ValueError, match="seeds"):
        SamplingBatch.build([SamplingParams()], [0, 1], [0], None, None, V, "cpu")


@pytest.mark.parametrize("chunks", [2, 8, 64, 512])
def test_first_argmax_chunked_equals_argmax(chunks: int) -> None:
    """The two-stage argmax (CUDA's path for wide rows) keeps argmax's first-index tie rule,
    including NaN (the max) and rows of -inf; small integer logits make ties common."""
    gen = torch.Generator().manual_seed(chunks)
    for trial in range(50):
        x = torch.randint(-3, 3, (5, 1024), generator=gen).float()
        if trial % 5 == 0:
            x[1, 700], x[1, 90] = math.nan, math.nan
        x[2] = -math.inf
        x[3, 1023] = 9.0  # the max in the last chunk
        assert torch.equal(first_argmax(x, chunks), x.argmax(dim=-1)), trial
