"""attn_warm, mode (a): decode attention over Warm-KV blocks on the CPU, as an (out, lse) partial.

A decoding sequence's keys are split in two tiers: the oldest blocks sit compressed in the
Warm pool (host shm), the rest in the GPU's Hot-KV cache. The GPU computes its partial over
the hot keys, this module the partial over the warm keys, and the two are merged by
log-sum-exp in fp32 (`merge_attention_partials`). The merge is exact because a partial is
the softmax over a disjoint subset of the keys, and its lse is that subset's normalizer::

    out = (e^lse_w * out_w + e^lse_h * out_h) / (e^lse_w + e^lse_h)

Warm keys of one sequence, in token order (S = block_size)::

    slots:     |  slots[0]  |  slots[1]  | ... |  slots[n-1]   |
    positions:  start ...                          ... end - 1     end = start + (n-1)*S + last_len
    window:          ^ query_pos - sliding_window + 1 (older keys are not visible)

Blocks wholly outside the window are never read. The rest are gathered (a copy out of shm,
so a slot recycled later cannot change them), decoded to fp32 by the pool's codec, and
attended in batches of at most `batch_blocks` blocks, so memory stays bounded for any number
of warm blocks; a sequence cut across batches gets one partial per batch, merged by lse.
Everything is batched over heads (GQA groups as matmul rows); the Python loop is per
sequence and batch only.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from hybridgen.kernels.reference import merge_attention_partials
from hybridgen.kvcodec.warm_pool import WarmPool

DECODE_BATCH_BYTES = 4 * 2**20
"""Decoded fp32 K+V per batch when `batch_blocks` is not given: small enough to stay in the
CPU's cache between the decode and the attention that reads it (measured best at 2-8 MiB)."""


@dataclass(frozen=True)
class WarmSpan:
    """The warm keys one decode query attends: whole slots in token order, the last partial."""

    slots: Sequence[int]
    """Warm slot ids in token order; empty: the sequence has no warm keys."""
    start: int
    """Absolute position of the first token of slots[0]."""
    last_len: int
    """Valid tokens in slots[-1], 1..block_size (ignored when `slots` is empty)."""
    query_pos: int
    """Absolute position of the query token (seq_len - 1); every warm key is before it."""

    def end(self, block_size: int) -> int:
        """One past the position of the last warm key."""
        if not self.slots:
            return self.start
        return self.start + (len(self.slots) - 1) * block_size + self.last_len


@dataclass
class WarmAttnStats:
    """Accumulated cost of warm attention: the engine's "Warm Decompress Latency" and
    "CPU attention time". Pass one instance to many calls to sum over layers and steps."""

    decode_s: float = 0.0
    """Seconds gathering records out of shm and decoding them to fp32."""
    attn_s: float = 0.0
    """Seconds of attention math (scores, softmax, values, merges)."""
    blocks: int = 0
    """Blocks (records) decoded."""
    bytes_decoded: int = 0
    """Compressed record bytes read from the pool."""
    keys: int = 0
    """Keys attended, summed over sequences."""
    calls: int = 0
    """Calls that added to these stats."""


@dataclass(frozen=True)
class _Run:
    """One sequence's visible warm keys in the flat list of blocks to decode."""

    seq: int
    lo: int
    """Visible keys, as token indices into the flat list's tokens: [lo, hi)."""
    hi: int


def _plan(
    spans: Sequence[WarmSpan], block_size: int, sliding_window: int
) -> tuple[list[int], list[_Run]]:
    """The slots to decode (window-pruned, token order per sequence) and each sequence's keys."""
    slots: list[int] = []
    runs: list[_Run] = []
    for b, span in enumerate(spans):
        _check_span(b, span, block_size)
        end = span.end(block_size)
        lo = span.start
        if sliding_window > 0:
            lo = max(lo, span.query_pos - sliding_window + 1)
        if lo >= end:
            continue
        skip = (lo - span.start) // block_size  # blocks wholly before the window
        base = (len(slots) - skip) * block_size - span.start  # token index of position 0
        runs.append(_Run(b, base + lo, base + end))
        slots.extend(span.slots[skip:])
    return slots, runs


def _check_span(b: int, span: WarmSpan, block_size: int) -> None:
    if not span.slots:
        return
    if not 1 <= span.last_len <= block_size or span.start < 0:
        raise ValueError(
            f"warm span {b}: last_len={span.last_len} must be in 1..{block_size} (block_size) "
            f"and start={span.start} >= 0"
        )
    if span.query_pos < span.end(block_size) - 1:
        raise ValueError(
            f"warm span {b}: query_pos={span.query_pos} is before its last warm key at "
            f"{span.end(block_size) - 1}; warm keys must precede the query"
        )


def _gather(pool: WarmPool, layer: int, slots: Sequence[int]) -> Tensor:
    """Copy layer `layer` of `slots` out of shm -> records [N, record_bytes] uint8."""
    rows = [pool.record_view(s)[layer] for s in slots]
    return torch.from_numpy(np.stack(rows))


def dense_partial(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """q: [Hkv, G, D] (pre-scaled), k, v: [L, Hkv, D] fp32, L >= 1 -> out [Hq, D], lse [Hq];
    plain torch, so it also runs on the GPU (the Warm tier's gpu mode)."""
    scores = torch.matmul(q, k.permute(1, 2, 0))  # [Hkv, G, L]; BLAS reads the strided k
    peak = scores.amax(-1, keepdim=True)  # finite: L >= 1 and finite inputs
    probs = scores.sub_(peak).exp_()
    total = probs.sum(-1, keepdim=True)  # [Hkv, G, 1], >= 1
    out = torch.matmul(probs, v.transpose(0, 1)).div_(total)  # [Hkv, G, D]
    lse = (peak + total.log()).flatten()
    return out.flatten(0, 1), lse


def _attend_chunk(
    qs: Tensor,
    k: Tensor,
    v: Tensor,
    runs: Sequence[_Run],
    lo_tok: int,
    out: Tensor,
    lse: Tensor,
    seen: list[bool],
) -> int:
    """Fold the partials over one decoded chunk (k, v: [N*S, Hkv, D], flat tokens from
    lo_tok) into out [B, Hq, D] / lse [B, Hq]. Returns the keys attended."""
    hi_tok, keys = lo_tok + k.shape[0], 0
    for run in runs:
        lo, hi = max(run.lo, lo_tok), min(run.hi, hi_tok)
        if lo >= hi:
            continue
        b = run.seq
        o, s = dense_partial(qs[b], k[lo - lo_tok : hi - lo_tok], v[lo - lo_tok : hi - lo_tok])
        if seen[b]:
            o, s = merge_attention_partials(out[b : b + 1], lse[b : b + 1], o[None], s[None])
        out[b], lse[b], seen[b] = o.reshape(out.shape[1:]), s.reshape(lse.shape[1:]), True
        keys += hi - lo
    return keys


def warm_decode_attention(
    pool: WarmPool,
    layer: int,
    q: Tensor,
    spans: Sequence[WarmSpan],
    scale: float,
    sliding_window: int = 0,
    *,
    batch_blocks: int | None = None,
    stats: WarmAttnStats | None = None,
) -> tuple[Tensor, Tensor]:
    """Partial decode attention of `q` over the warm keys of each sequence, for `layer`.

    q: [B, Hq, D] (any float dtype; one query token per sequence), Hq a multiple of the pool's
    num_kv_heads; spans: B `WarmSpan`s; sliding_window: 0 for none, else keys at positions
    < query_pos - sliding_window + 1 are excluded (paged_decode_attention's rule).
    Returns out [B, Hq, D] and lse [B, Hq] (natural log), both fp32 on the CPU; a sequence
    with no visible warm key gets out 0 and lse -inf, which the merge ignores.
    """
    spec = pool.codec.spec
    batch, hq, dim = q.shape
    hkv, bs = spec.num_kv_heads, spec.block_size
    if len(spans) != batch or dim != spec.head_dim or hq % hkv:
        raise ValueError(
            f"q is {list(q.shape)} with {len(spans)} spans; expected [B, Hq, {spec.head_dim}] "
            f"with B spans and Hq a multiple of num_kv_heads={hkv}"
        )
    if not 0 <= layer < pool.num_layers:
        raise ValueError(f"layer={layer} outside [0, {pool.num_layers}) of the Warm pool")
    per_block = 2 * math.prod(spec.shape) * 4  # decoded fp32 K and V
    step = batch_blocks or max(1, DECODE_BATCH_BYTES // per_block)
    stats = stats if stats is not None else WarmAttnStats()
    stats.calls += 1

    # qs: [B, Hkv, G, D]; scaling q once costs Hq*D multiplies instead of Hq*L.
    qs = (q.detach().to("cpu", torch.float32) * scale).view(batch, hkv, hq // hkv, dim)
    out = torch.zeros(batch, hq, dim, dtype=torch.float32)
    lse = torch.full((batch, hq), float("-inf"), dtype=torch.float32)
    seen = [False] * batch  # rows of out/lse that hold a partial already
    slots, runs = _plan(spans, bs, sliding_window)
    for c0 in range(0, len(slots), step):
        chunk = slots[c0 : c0 + step]
        t0 = time.perf_counter()
        records = _gather(pool, layer, chunk)
        k, v = pool.codec.decode_blocks(records, torch.float32)  # [N, S, Hkv, D]
        k, v = k.flatten(0, 1), v.flatten(0, 1)  # [N*S, Hkv, D]
        t1 = time.perf_counter()
        stats.keys += _attend_chunk(qs, k, v, runs, c0 * bs, out, lse, seen)
        stats.decode_s += t1 - t0
        stats.attn_s += time.perf_counter() - t1
        stats.blocks += len(chunk)
        stats.bytes_decoded += records.numel()
    return out, lse
