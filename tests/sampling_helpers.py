"""Helpers shared by the sampling tests: a small vocabulary, one-step sampling, statistics."""

from __future__ import annotations

import torch

from hybridgen.sampling.params import SamplingParams
from hybridgen.sampling.sampler import Sampler, SamplerOutput, SamplingBatch

V = 32
"""Vocabulary size of the small synthetic tests."""


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    seeds: list[int] | None = None,
    steps: list[int] | None = None,
    prompt_ids: list[list[int]] | None = None,
    output_ids: list[list[int]] | None = None,
) -> SamplerOutput:
    """Run the sampler on CPU for one step."""
    n = len(params)
    batch = SamplingBatch.build(
        params,
        seeds if seeds is not None else list(range(n)),
        steps if steps is not None else [0] * n,
        prompt_ids,
        output_ids,
        logits.shape[-1],
        "cpu",
    )
    return Sampler()(logits, batch)


def draws(logits_row: torch.Tensor, params: SamplingParams, n: int) -> torch.Tensor:
    """n seeded draws from one row of logits, one seed per draw (seeds 0..n-1)."""
    logits = logits_row.expand(n, -1).contiguous()
    return sample(logits, [params] * n, seeds=list(range(n))).token_ids


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's statistic of observed counts against expected probabilities (> 0 only)."""
    n = counts.sum()
    keep = probs > 0
    expected = probs[keep] * n
    return float(((counts[keep] - expected) ** 2 / expected).sum())
