"""Batched, reproducible token sampler.

Pipeline per row (the HF / vLLM order):

1. logits -> float32.
2. Penalties: repetition (HF style, over prompt + output tokens), then presence / frequency
   (OpenAI style, over output tokens only).
3. Greedy rows (temperature 0 or top_k 1) take the argmax of the penalised logits, lowest index
   on ties; the temperature is not applied to them.
4. Other rows: divide by the temperature, mask with top-k, then top-p (on the top-k-renormalised
   distribution), then min-p (tokens tied with the last one kept by top-k or top-p are kept
   too, as HF's top-k does), and draw with the Gumbel-max trick: argmax(logits / T + G) where
   G is standard Gumbel noise from `noise.gumbel_noise`, a pure function of (seed, step, vocab
   index). A row's token therefore depends only on its own logits, seed and step: never on the
   batch's size, order or other rows, and no generator state is carried between steps.

Logprobs are taken from the model's raw distribution, log_softmax of the float32 logits before
penalties and temperature (vLLM's default "raw_logprobs" mode), so they describe the model
rather than the sampling policy.

Every decision about which code path to run is made on the host in `SamplingBatch.build`; the
sampler itself never reads a device value back (no .item(), .tolist(), .cpu() or data-dependent
shapes), so it never waits for the device. This is tested by running it on the meta device.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from hybridgen.runtime.upload import upload
from hybridgen.sampling.noise import gumbel_noise, row_keys
from hybridgen.sampling.params import MAX_SEED, SamplingParams

MIN_TEMPERATURE = 1e-5
"""Positive temperatures below this are computed as this (vLLM's sampling epsilon).

Keeps logits / T finite for any |logit| < 3e33; at such temperatures any logit gap above ~1e-4
already makes the draw deterministic, so only near-exact ties can tell the difference.
"""


def _to_device(array: np.ndarray, device: torch.device) -> Tensor:
    """One host-to-device copy that does not wait for the device (runtime/upload.py)."""
    return upload(torch.from_numpy(array), device)


def _token_table(
    ids_per_row: Sequence[Sequence[Sequence[int]]], vocab_size: int, device: torch.device
) -> Tensor:
    """Count how often each token occurs in each row's id lists, on the device."""
    # -> [B, V] float32. ids_per_row[b] is a tuple of id lists for row b (e.g. prompt, output).
    batch_size = len(ids_per_row)
    lengths = [sum(len(ids) for ids in lists) for lists in ids_per_row]
    total = sum(lengths)
    flat = chain(lengths, chain.from_iterable(chain.from_iterable(ids_per_row)))
    packed = _to_device(np.fromiter(flat, dtype=np.int64, count=batch_size + total), device)
    lengths_d, ids = packed[:batch_size], packed[batch_size:]
    # output_size is known on the host, so repeat_interleave needs no device->host sync.
    rows = torch.repeat_interleave(
        torch.arange(batch_size, device=device), lengths_d, output_size=total
    )
    # Ids outside [0, V) go to a spare column that is cut off, never into another row.
    width = vocab_size + 1
    ids = torch.where((ids >= 0) & (ids < vocab_size), ids, vocab_size)
    counts = torch.zeros(batch_size * width, dtype=torch.float32, device=device)
    # Sums of 1.0 are exact below 2**24, so atomic accumulation order cannot change the result.
    counts.index_add_(0, rows * width + ids, torch.ones(total, device=device))
    return counts.view(batch_size, width)[:, :vocab_size]


def _host_row(p: SamplingParams, vocab_size: int) -> tuple[bool, int, float, float, float]:
    """(is_greedy, top_k, top_p, log_min_p, temperature) in the batch's "off" conventions."""
    if p.is_greedy:
        # A greedy row's filters and temperature are unused; storing them as "off" keeps the
        # batch's fast paths open.
        return True, vocab_size, math.inf, -math.inf, 1.0
    top_k = p.top_k if 0 < p.top_k < vocab_size else vocab_size
    top_p = p.top_p if p.top_p < 1 else math.inf
    log_min_p = math.log(p.min_p) if p.min_p > 0 else -math.inf
    return False, top_k, top_p, log_min_p, max(p.temperature, MIN_TEMPERATURE)


@dataclass(frozen=True)
class SamplingBatch:
    """Per-row sampling tensors for one step, built once on the target device."""

    temperature: Tensor
    """[B] float32; max(T, MIN_TEMPERATURE) for random rows, 1.0 for greedy rows (unused)."""
    is_greedy: Tensor
    """[B] bool; the row takes the argmax."""
    top_k: Tensor
    """[B] int64 in [1, V]; V when the filter is off for the row."""
    top_p: Tensor
    """[B] float32; +inf when off, so the nucleus test never removes a token."""
    log_min_p: Tensor
    """[B] float32 log(min_p); -inf when off."""
    seeds: Tensor
    """[B] int64 resolved per-request seeds."""
    steps: Tensor
    """[B] int64 index of the token being sampled (tokens generated so far)."""
    repetition_penalty: Tensor
    """[B] float32 HF-style repetition penalty (1: none)."""
    presence_penalty: Tensor
    """[B] float32 OpenAI presence penalty (0: none)."""
    frequency_penalty: Tensor
    """[B] float32 OpenAI frequency penalty (0: none)."""
    seen_mask: Tensor | None = field(repr=False)
    """[B, V] bool: token occurs in prompt or output; only rows with a repetition penalty."""
    output_counts: Tensor | None = field(repr=False)
    """[B, V] float32 occurrences in the output; only rows with presence/frequency penalties."""
    vocab_size: int
    """V, the logits' last dimension."""
    all_greedy: bool
    """Every row is greedy: the sampler is a single argmax (after penalties)."""
    any_greedy: bool
    """Some row is greedy: random and greedy results are merged per row."""
    max_top_k: int
    """Largest active top-k over random rows; 0 when no row uses top-k."""
    use_top_p: bool
    """Some random row has top_p < 1."""
    use_min_p: bool
    """Some random row has min_p > 0."""
    use_repetition_penalty: bool
    """Some row has repetition_penalty != 1 (seen_mask is set)."""
    use_presence_frequency: bool
    """Some row has a presence or frequency penalty (output_counts is set)."""
    max_logprobs: int | None
    """None: no row wants logprobs; else the largest top-N asked for (0: sampled token only)."""

    @property
    def batch_size(self) -> int:
        """Number of rows B."""
        return self.temperature.shape[0]

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        seeds: Sequence[int],
        steps: Sequence[int],
        prompt_ids: Sequence[Sequence[int]] | None,
        output_ids: Sequence[Sequence[int]] | None,
        vocab_size: int,
        device: torch.device | str,
    ) -> SamplingBatch:
        """Pack host-side per-request state into device tensors (one H2D copy per dtype)."""
        device = torch.device(device)
        n = len(params)
        if len(seeds) != n or len(steps) != n:
            raise ValueError(f"{n} params but {len(seeds)} seeds and {len(steps)} steps")
        if any(not 0 <= s <= MAX_SEED for s in seeds):
            raise ValueError(f"seeds must lie in [0, {MAX_SEED}]")
        if any(t < 0 for t in steps):
            raise ValueError("steps must be >= 0")

        columns = list(zip(*(_host_row(p, vocab_size) for p in params), strict=True))
        greedy, top_k, top_p, log_min_p, temperature = columns or [()] * 5
        floats = np.array(
            [
                temperature,
                top_p,
                log_min_p,
                [p.repetition_penalty for p in params],
                [p.presence_penalty for p in params],
                [p.frequency_penalty for p in params],
            ],
            dtype=np.float32,
        ).reshape(6, n)
        ints = np.array([top_k, seeds, steps, greedy], dtype=np.int64).reshape(4, n)
        f, i = _to_device(floats, device), _to_device(ints, device)

        use_rep = any(p.repetition_penalty != 1.0 for p in params)
        use_pf = any(p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in params)
        seen_mask = output_counts = None
        if use_rep or use_pf:
            seen_mask, output_counts = _penalty_tables(
                params, prompt_ids, output_ids, use_rep, use_pf, vocab_size, device
            )
        wanted = [p.logprobs for p in params if p.logprobs is not None]
        active_k = [k for k in top_k if k < vocab_size]
        return cls(
            temperature=f[0],
            is_greedy=i[3].bool(),
            top_k=i[0],
            top_p=f[1],
            log_min_p=f[2],
            seeds=i[1],
            steps=i[2],
            repetition_penalty=f[3],
            presence_penalty=f[4],
            frequency_penalty=f[5],
            seen_mask=seen_mask,
            output_counts=output_counts,
            vocab_size=vocab_size,
            all_greedy=all(greedy),
            any_greedy=any(greedy),
            max_top_k=max(active_k, default=0),
            use_top_p=any(p < 1 for p in top_p),
            use_min_p=any(lp > -math.inf for lp in log_min_p),
            use_repetition_penalty=use_rep,
            use_presence_frequency=use_pf,
            max_logprobs=max(wanted, default=None),
        )


def _penalty_tables(
    params: Sequence[SamplingParams],
    prompt_ids: Sequence[Sequence[int]] | None,
    output_ids: Sequence[Sequence[int]] | None,
    use_rep: bool,
    use_pf: bool,
    vocab_size: int,
    device: torch.device,
) -> tuple[Tensor | None, Tensor | None]:
    """Build seen_mask / output_counts, reading ids only for rows that use the penalty."""
    n = len(params)
    if output_ids is None or len(output_ids) != n:
        raise ValueError("output_ids (one list per row) is required when a penalty is used")
    seen_mask = output_counts = None
    if use_rep:
        if prompt_ids is None or len(prompt_ids) != n:
            raise ValueError("prompt_ids (one list per row) is required for repetition_penalty")
        seen_ids = [
            (prompt_ids[b], output_ids[b]) if params[b].repetition_penalty != 1.0 else ()
            for b in range(n)
        ]
        seen_mask = _token_table(seen_ids, vocab_size, device) > 0
    if use_pf:
        out_ids = [
            (output_ids[b],)
            if params[b].presence_penalty != 0.0 or params[b].frequency_penalty != 0.0
            else ()
            for b in range(n)
        ]
        output_counts = _token_table(out_ids, vocab_size, device)
    return seen_mask, output_counts


@dataclass(frozen=True)
class SamplerOutput:
    """Result of one sampling step."""

    token_ids: Tensor
    """[B] int64 sampled token per row."""
    logprobs: Tensor | None
    """[B] float32 raw-model logprob of the sampled token; None when no row asked."""
    top_logprobs: tuple[Tensor, Tensor] | None
    """([B, K] int64 ids, [B, K] float32 raw logprobs), K = batch.max_logprobs, best first;
    None when K == 0 or no row asked. Rows that asked for fewer slice their own prefix."""


def apply_penalties(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """Repetition then presence/frequency penalties; returns a new tensor when any apply."""
    # logits: [B, V] float32, not modified. Rows without a penalty see factors 1 / 0, which
    # leave their values bit-identical (x / 1, x * 1, x - 0 are exact).
    if batch.use_repetition_penalty:
        assert batch.seen_mask is not None
        pen = batch.repetition_penalty[:, None]
        # HF: shrink positive logits by division and push negative ones down by multiplication.
        penalised = torch.where(logits < 0, logits * pen, logits / pen)
        logits = torch.where(batch.seen_mask, penalised, logits)
    if batch.use_presence_frequency:
        assert batch.output_counts is not None
        counts = batch.output_counts
        present = (counts > 0).to(torch.float32)
        delta = counts * batch.frequency_penalty[:, None]
        delta.addcmul_(present, batch.presence_penalty[:, None])
        logits = logits - delta
    return logits


def _top_k_(scaled: Tensor, batch: SamplingBatch) -> None:
    """In place: mask tokens strictly below each row's k-th largest value (HF tie rule)."""
    # scaled: [B, V]; top-k without top-p needs only the largest max_top_k values, not a sort.
    k_max = batch.max_top_k
    values = scaled.topk(k_max, dim=-1).values  # [B, k_max], descending
    index = (batch.top_k.clamp(max=k_max) - 1)[:, None]
    threshold = values.gather(1, index)  # [B, 1]
    # Rows whose filter is off hold top_k = V > k_max.
    threshold.masked_fill_((batch.top_k > k_max)[:, None], -math.inf)
    scaled.masked_fill_(scaled < threshold, -math.inf)


def _top_k_top_p_(scaled: Tensor, batch: SamplingBatch) -> None:
    """In place: top-k then top-p (minimal nucleus with mass >= top_p), via one sort."""
    # scaled: [B, V]. Both filters keep a prefix of the descending order, so each reduces to a
    # per-row threshold value; masking by value avoids scattering the sorted row back (a slow
    # random-access pass) and keeps tokens tied with the last kept one, as HF's top-k does.
    sorted_vals = scaled.sort(dim=-1, descending=True).values  # [B, V]
    if batch.max_top_k > 0:
        position = torch.arange(scaled.shape[-1], device=scaled.device)
        sorted_vals.masked_fill_(position[None, :] >= batch.top_k[:, None], -math.inf)
    probs = sorted_vals.softmax(dim=-1)  # top-k renormalised
    # Mass strictly before each token; shifting (not cum - p) keeps the first token's exact 0.
    mass_before = F.pad(probs.cumsum(dim=-1)[:, :-1], (1, 0))
    # Keep a token iff the tokens before it have not reached top_p: the minimal nucleus. The
    # first token always stays (0 < top_p); top_p = +inf (off) keeps all V.
    kept = (mass_before < batch.top_p[:, None]).sum(dim=-1, keepdim=True)  # [B, 1] >= 1
    kept = torch.minimum(kept, batch.top_k[:, None])
    threshold = sorted_vals.gather(1, kept - 1)  # [B, 1] smallest kept value
    scaled.masked_fill_(scaled < threshold, -math.inf)


def _min_p_(scaled: Tensor, batch: SamplingBatch) -> None:
    """In place: drop p_i < min_p * p_max, i.e. scaled_i < max + log(min_p)."""
    # Earlier filters never remove the row maximum, so the max of the filtered row is the same.
    row_max = scaled.amax(dim=-1, keepdim=True)  # [B, 1]
    scaled.masked_fill_(scaled < row_max + batch.log_min_p[:, None], -math.inf)


def _sample_random(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """Seeded Gumbel-max draw for every row; greedy rows are merged in by the caller."""
    # logits: [B, V] float32 penalised -> [B] int64
    scaled = logits / batch.temperature[:, None]  # fresh tensor: the filters work in place
    if batch.use_top_p:
        _top_k_top_p_(scaled, batch)
    elif batch.max_top_k > 0:
        _top_k_(scaled, batch)
    if batch.use_min_p:
        _min_p_(scaled, batch)
    # argmax(scaled + Gumbel) ~ softmax(scaled); masked tokens stay at -inf.
    noise = gumbel_noise(row_keys(batch.seeds, batch.steps), scaled.shape[-1])
    return noise.add_(scaled).argmax(dim=-1)


def first_argmax(x: Tensor, chunks: int | None = None) -> Tensor:
    """x.argmax(-1) for [B, V]: the first index of the row maximum (a NaN counts as the max).

    On CUDA a wide row is reduced in two stages, each chunk's first max and then the first
    chunk holding the largest: one block per row reduces 128K logits in ~27 us on the H200,
    while chunks spread the row over the SMs. Both stages keep the first occurrence, so the
    result is the same index as argmax. `chunks` forces the split (tests); it must divide V.
    """
    rows, width = x.shape
    if chunks is None:
        fits = [c for c in (128, 64, 32) if width % c == 0]
        chunks = fits[0] if x.is_cuda and width >= 8192 and fits else 1
    if chunks == 1:
        return x.argmax(dim=-1)
    vals, idx = x.view(rows, chunks, width // chunks).max(dim=-1)
    best = vals.argmax(dim=-1, keepdim=True)  # [B, 1] the first chunk with the max
    return (best * (width // chunks) + idx.gather(1, best)).squeeze(1)


class Sampler:
    """Turns a step's logits into tokens (and optional logprobs) for a SamplingBatch."""

    def __call__(self, logits: Tensor, batch: SamplingBatch) -> SamplerOutput:
        """Sample one token per row of logits: [B, V] in any float dtype."""
        if logits.dim() != 2 or tuple(logits.shape) != (batch.batch_size, batch.vocab_size):
            raise ValueError(
                f"logits shape {tuple(logits.shape)} != ({batch.batch_size}, {batch.vocab_size})"
            )
        x = logits.to(torch.float32)  # may alias the caller's tensor: no in-place ops on x
        raw_logprobs = None
        if batch.max_logprobs is not None:
            raw_logprobs = torch.log_softmax(x, dim=-1)  # before penalties / temperature
        x = apply_penalties(x, batch)
        if batch.all_greedy:
            token_ids = first_argmax(x)
        else:
            token_ids = _sample_random(x, batch)
            if batch.any_greedy:
                token_ids = torch.where(batch.is_greedy, first_argmax(x), token_ids)
        return _with_logprobs(token_ids, raw_logprobs, batch)


def _with_logprobs(
    token_ids: Tensor, raw_logprobs: Tensor | None, batch: SamplingBatch
) -> SamplerOutput:
    """Attach the sampled token's raw logprob and the top-K raw logprobs."""
    if raw_logprobs is None:
        return SamplerOutput(token_ids=token_ids, logprobs=None, top_logprobs=None)
    sampled = raw_logprobs.gather(1, token_ids[:, None]).squeeze(1)  # [B]
    top = None
    if batch.max_logprobs:
        values, ids = raw_logprobs.topk(batch.max_logprobs, dim=-1)  # [B, K] each
        top = (ids, values)
    return SamplerOutput(token_ids=token_ids, logprobs=sampled, top_logprobs=top)
