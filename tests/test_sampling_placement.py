"""placements.sample: picking tokens on the CPU from the GPU's top-k candidates gives the
device sampler's greedy tokens (and its seeded draws while top_k <= the candidate count)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridgen.config.engine import EngineConfig
from hybridgen.engine.engine import Engine
from hybridgen.sampling.candidates import Candidates, sample_candidates
from hybridgen.sampling.noise import gumbel_at, gumbel_noise, row_keys
from hybridgen.sampling.params import SamplingParams
from hybridgen.sampling.sampler import Sampler, SamplingBatch
from tests.hf_reference import sample_prompts


def test_noise_at_ids_is_the_full_noise() -> None:
    keys = row_keys(torch.tensor([5, 77, 2**40]), torch.tensor([0, 9, 123]))
    ids = torch.randint(0, 5001, (3, 64))
    assert torch.equal(gumbel_at(keys, ids), gumbel_noise(keys, 5001).gather(1, ids))


def _candidates(row: torch.Tensor, k: int, temperature: float) -> Candidates:
    vals, ids = row.topk(k)
    t = max(temperature, 1e-5)
    return Candidates(
        ids.int().numpy(), vals.numpy(), float(row.logsumexp(0)), float((row / t).logsumexp(0))
    )


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, top_k=20, seed=1),
        SamplingParams(temperature=1.3, top_k=40, top_p=0.9, seed=2),
        SamplingParams(temperature=0.6, top_k=64, min_p=0.05, seed=3),
    ],
)
def test_candidate_sampler_agrees_with_the_device_sampler(params: SamplingParams) -> None:
    gen = torch.Generator().manual_seed(0)
    for step in range(50):
        row = torch.randn(3000, generator=gen) * 3
        batch = SamplingBatch.build([params], [params.seed or 0], [step], None, None, 3000, "cpu")
        expected = int(Sampler()(row[None], batch).token_ids[0])
        token, logprob = sample_candidates(
            _candidates(row, 64, params.temperature), params, params.seed or 0, step
        )
        assert token == expected
        assert logprob == pytest.approx(float(torch.log_softmax(row, 0)[token]), abs=1e-5)


def test_greedy_ties_go_to_the_lowest_id() -> None:
    c = Candidates(np.array([9, 4, 7], np.int32), np.array([2.0, 2.0, 1.0], np.float32), 3.0, 3.0)
    assert sample_candidates(c, SamplingParams(temperature=0.0), 0, 0)[0] == 4


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama3", "qwen2"])
def test_engine_cpu_sampling_matches_device_sampling(checkpoint, kind: str) -> None:  # type: ignore[no-untyped-def]
    path = checkpoint(kind)
    prompts = sample_prompts(path, 3, [9, 40, 17])
    params = [
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=0),
        SamplingParams(temperature=0.9, top_k=16, seed=11, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
    ]
    runs = []
    for placement in ("gpu", "cpu"):
        engine = Engine(EngineConfig(model=str(path), device="cpu", sample_placement=placement))
        runs.append([(c.token_ids, c.logprobs) for c in engine.generate(prompts, params)])
    assert [r[0] for r in runs[0]] == [r[0] for r in runs[1]]
    assert np.allclose(runs[0][0][1], runs[1][0][1], atol=1e-5)


def test_deferred_sampling_waits_for_the_token() -> None:
    engine = Engine(EngineConfig(model="tiny-llama", device="cpu", sample_placement="cpu"))
    engine.add_request("r", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=3))
    (out,) = engine.step(defer_sampling=True)
    assert out.candidates is not None and out.new_token_ids == []
    assert engine.step(defer_sampling=True) == [], "no step while the token is awaited"
    token = int(out.candidates.ids[0])
    done = engine.accept_token("r", token, 0.0)
    assert done.new_token_ids == [token] and not done.finished
    with pytest.raises(ValueError, match="request_id"):
        engine.accept_token("r", token, 0.0)
