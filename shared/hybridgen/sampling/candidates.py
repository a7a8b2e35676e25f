"""Sampling on the CPU from the top-K candidates the GPU sends (placements.sample: cpu).

The GPU computes each row's K largest logits (and the log-sum-exps that normalise them over
the whole vocabulary); the CPU picks the token. Greedy picks are identical to the device
sampler's argmax (ties go to the lowest id). Seeded draws use the device sampler's noise at
the candidates' ids, so they agree with it whenever the device's pick lies among the K
candidates, which top_k <= K guarantees.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from hybridgen.sampling.noise import gumbel_at, row_keys
from hybridgen.sampling.params import SamplingParams

MIN_TEMPERATURE = 1e-5
"""Same floor as the device sampler: logits / T stays finite."""


@dataclass(frozen=True)
class Candidates:
    """One row's top-K logits, most likely first."""

    ids: np.ndarray
    """[K] int32 token ids."""
    logits: np.ndarray
    """[K] float32 raw logits of those ids."""
    lse: float
    """log-sum-exp of the row's raw logits over the whole vocabulary (for logprobs)."""
    lse_t: float
    """log-sum-exp of the row's logits / temperature over the whole vocabulary (for top-p
    and min-p masses)."""


def sample_candidates(
    c: Candidates, params: SamplingParams, seed: int, step: int
) -> tuple[int, float]:
    """-> (token id, its raw logprob), the device sampler's rules applied to the candidates."""
    if params.is_greedy:
        best = c.logits.max()
        token = int(c.ids[c.logits == best].min())
        return token, float(best - c.lse)
    z = c.logits.astype(np.float64) / max(params.temperature, MIN_TEMPERATURE)
    keep = np.ones(len(z), dtype=bool)
    probs = np.exp(z - c.lse_t)
    if params.top_k > 0:
        # As on the device (and in HF), top-p then works on the distribution renormalised
        # over the top-k tokens.
        keep[params.top_k :] = False
        kept = z[: params.top_k]
        probs = np.exp(z - (kept.max() + np.log(np.exp(kept - kept.max()).sum())))
    if params.top_p < 1.0:
        before = np.cumsum(probs) - probs  # mass of the more likely candidates
        keep &= before < params.top_p
    if params.min_p > 0.0:
        keep &= probs >= params.min_p * probs[0]
    keys = row_keys(torch.tensor([seed]), torch.tensor([step]))
    noise = gumbel_at(keys, torch.from_numpy(c.ids.astype(np.int64))[None])[0].numpy()
    scores = np.where(keep, z.astype(np.float32) + noise, -np.inf)
    i = int(np.argmax(scores))
    return int(c.ids[i]), float(c.logits[i] - c.lse)
