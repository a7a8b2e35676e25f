"""Warm attention (attn_warm mode a): the CPU's partial over Warm-KV blocks, merged by lse with
the Hot partial of `reference.paged_decode_attention`, must equal exact attention over all keys.

Each sequence's keys are split at `warm_end`: [start, warm_end) go to Warm slots (the last one
partial, its padding NaN for the exact codecs so that reading it poisons the result), and
[warm_end, T) to a paged Hot cache with shuffled block ids. The ground truth is float64
attention over [start, T) within the window. Slots hold L = 2 layers with different data and
the tests read layer 1, so a wrong layer shows.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch
from torch import Tensor

from hybridgen.kernels.reference import merge_attention_partials, paged_decode_attention
from hybridgen.kvtiers.codec import get_codec
from hybridgen.kvtiers.warm_attention import (
    WarmAttnStats,
    WarmSpan,
    _decode,
    _Layer,
    warm_decode_attention,
)
from hybridgen.kvtiers.warm_pool import WarmPool

S, HKV, D, L = 16, 2, 64, 2  # block_size, num_kv_heads, head_dim, layers per slot
LAYER = 1
SCALE = 1 / math.sqrt(D)


@dataclass
class Case:
    """A batch of decoding sequences with their keys in both tiers."""

    pool: WarmPool
    q: Tensor  # [B, Hq, D] fp32
    k: list[Tensor]  # per sequence [T, Hkv, D], positions 0..T-1 (model dtype)
    v: list[Tensor]
    spans: list[WarmSpan]
    warm_end: list[int]

    def hot(self, window: int) -> tuple[Tensor, Tensor]:
        """reference.paged_decode_attention over each sequence's Hot keys [warm_end, T)."""
        tables: list[list[int]] = []
        lens: list[int] = []
        k_blocks: list[Tensor] = []
        v_blocks: list[Tensor] = []
        for k, v, end in zip(self.k, self.v, self.warm_end, strict=True):
            n = k.shape[0] - end
            pad = -n % S
            kb = torch.cat((k[end:], k.new_zeros(pad, HKV, D))).view(-1, S, HKV, D)
            vb = torch.cat((v[end:], v.new_zeros(pad, HKV, D))).view(-1, S, HKV, D)
            tables.append(list(range(len(k_blocks), len(k_blocks) + kb.shape[0])))
            lens.append(n)
            k_blocks.extend(kb)
            v_blocks.extend(vb)
        # Shuffle the physical blocks so that the block table matters.
        perm = torch.randperm(len(k_blocks), generator=torch.Generator().manual_seed(0))
        k_cache = torch.stack(k_blocks)[perm] if k_blocks else torch.zeros(1, S, HKV, D)
        v_cache = torch.stack(v_blocks)[perm] if v_blocks else torch.zeros(1, S, HKV, D)
        where = torch.argsort(perm).tolist()
        width = max(1, *(len(t) for t in tables))
        table = torch.tensor([[where[i] for i in t] + [0] * (width - len(t)) for t in tables])
        out, lse = paged_decode_attention(
            self.q, k_cache, v_cache, table, torch.tensor(lens), SCALE, window, return_lse=True
        )
        return out, lse

    def exact(self, window: int, lo_at: str = "start") -> tuple[Tensor, Tensor]:
        """float64 attention over keys [start, T) (or only the warm ones) within the window."""
        outs, lses = [], []
        for b, (k, v, span) in enumerate(zip(self.k, self.v, self.spans, strict=True)):
            hi = span.query_pos + 1 if lo_at == "start" else span.end(S)
            lo = span.start if window <= 0 else max(span.start, span.query_pos - window + 1)
            o, s = float64_attention(self.q[b], k[lo:hi], v[lo:hi])
            outs.append(o)
            lses.append(s)
        return torch.stack(outs), torch.stack(lses)

    def warm(
        self, window: int = 0, batch_blocks: int | None = None, stats: WarmAttnStats | None = None
    ) -> tuple[Tensor, Tensor]:
        return warm_decode_attention(
            self.pool,
            LAYER,
            self.q,
            self.spans,
            SCALE,
            window,
            batch_blocks=batch_blocks,
            stats=stats,
        )


def float64_attention(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """q: [Hq, D], k, v: [n, Hkv, D] -> out [Hq, D], lse [Hq]; n = 0 gives 0 and -inf."""
    hq = q.shape[0]
    if k.shape[0] == 0:
        return torch.zeros(hq, D, dtype=torch.float64), torch.full((hq,), -math.inf).double()
    kh = k.double().repeat_interleave(hq // HKV, dim=1)  # [n, Hq, D]
    vh = v.double().repeat_interleave(hq // HKV, dim=1)
    scores = torch.einsum("hd,nhd->hn", q.double(), kh) * SCALE
    lse = torch.logsumexp(scores, -1)
    return torch.einsum("hn,nhd->hd", torch.exp(scores - lse[:, None]), vh), lse


def randn_kv(n: int, g: torch.Generator, outliers: bool) -> Tensor:
    """[n, Hkv, D]; with outliers, 4 channels per head are 10-20x larger, as in real keys."""
    x = torch.randn(n, HKV, D, generator=g)
    if outliers:
        for h in range(HKV):
            channels = torch.randperm(D, generator=g)[:4]
            x[:, h, channels] *= 10 + 10 * torch.rand(4, generator=g)
    return x


@pytest.fixture
def pools(instance: str) -> Iterator[list[WarmPool]]:
    """Pools made by a test; closed (and unlinked, by `instance`) afterwards."""
    made: list[WarmPool] = []
    yield made
    for p in made:
        p.close()


def build(
    pools: list[WarmPool],
    instance: str,
    seqs: list[tuple[int, int, int]],
    codec: str = "lossless",
    hq: int = 4 * HKV,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> Case:
    """seqs: (start, warm_end, T) per sequence: warm keys [start, warm_end), hot [warm_end, T)."""
    g = torch.Generator().manual_seed(seed)
    exact_codec = codec in ("lossless", "lz4")
    n_slots = sum(-(-(end - start) // S) for start, end, _ in seqs)
    pool = WarmPool.create(instance, get_codec(codec, S, HKV, D, dtype), L, max(1, n_slots))
    pools.append(pool)
    ks, vs, spans = [], [], []
    for start, end, total in seqs:
        k = randn_kv(total, g, outliers=not exact_codec).to(dtype)
        v = randn_kv(total, g, outliers=False).to(dtype)
        n = end - start
        slots = pool.alloc(-(-n // S))
        for i, slot in enumerate(slots):
            kl = randn_kv(L * S, g, outliers=False).view(L, S, HKV, D).to(dtype)
            vl = randn_kv(L * S, g, outliers=False).view(L, S, HKV, D).to(dtype)
            if exact_codec:
                kl[LAYER], vl[LAYER] = math.nan, math.nan
            lo, hi = start + i * S, min(start + (i + 1) * S, end)
            kl[LAYER, : hi - lo], vl[LAYER, : hi - lo] = k[lo:hi], v[lo:hi]
            pool.store(slot, kl, vl)
        last_len = n - (len(slots) - 1) * S if slots else 0
        spans.append(WarmSpan(slots, start, last_len, total - 1))
        ks.append(k)
        vs.append(v)
    q = torch.randn(len(seqs), hq, D, generator=g)
    return Case(pool, q, ks, vs, spans, [end for _, end, _ in seqs])


def merged_error(c: Case, window: int = 0, batch_blocks: int | None = None) -> tuple[float, float]:
    """Max abs error of the merged (warm + hot) out and lse against float64 exact."""
    out_w, lse_w = c.warm(window, batch_blocks)
    out_h, lse_h = c.hot(window)
    out, lse = merge_attention_partials(out_h, lse_h, out_w, lse_w)
    ex_out, ex_lse = c.exact(window)
    return (out.double() - ex_out).abs().max().item(), (lse.double() - ex_lse).abs().max().item()


# (start, warm_end, T): a partial last warm block, a full one, no hot keys, no warm keys.
MIXED = [(0, 37, 60), (0, 48, 53), (0, 21, 21), (0, 0, 19), (0, 80, 81)]


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("hq", (HKV, 4 * HKV))
def test_merge_with_hot_partial_is_exact_attention(
    pools: list[WarmPool], instance: str, hq: int, dtype: torch.dtype
) -> None:
    c = build(pools, instance, MIXED, hq=hq, dtype=dtype)
    err_out, err_lse = merged_error(c)
    assert err_out < 2e-6 and err_lse < 2e-6, (err_out, err_lse)


def test_warm_partial_alone_is_exact_and_empty_rows_are_zero(
    pools: list[WarmPool], instance: str
) -> None:
    c = build(pools, instance, MIXED)
    stats = WarmAttnStats()
    out, lse = c.warm(stats=stats)
    ex_out, ex_lse = c.exact(0, lo_at="warm")
    assert out.dtype == lse.dtype == torch.float32 and out.shape == c.q.shape
    assert torch.allclose(out.double(), ex_out, atol=2e-6, rtol=0)
    assert torch.allclose(lse.double(), ex_lse, atol=2e-6, rtol=0)
    assert torch.equal(out[3], torch.zeros(4 * HKV, D)) and bool(torch.isneginf(lse[3]).all())
    # The merge weighs the tiers by lse; a slightly wrong one is visible.
    out_h, lse_h = c.hot(0)
    bad, _ = merge_attention_partials(out_h, lse_h, out, lse + 0.05)
    assert (bad.double() - c.exact(0)[0]).abs().max().item() > 1e-3
    blocks = sum(len(s.slots) for s in c.spans)
    assert (stats.blocks, stats.calls, stats.keys) == (blocks, 1, 37 + 48 + 21 + 80)
    assert stats.bytes_decoded == blocks * c.pool.record_bytes
    assert stats.decode_s > 0 and stats.attn_s > 0


@pytest.mark.parametrize("window", (1, 5, 17, 30, 64))
def test_sliding_window_matches_the_decode_kernel(
    pools: list[WarmPool], instance: str, window: int
) -> None:
    # Warm starting past position 0 (older keys dropped) and windows that start inside the
    # warm blocks, at a block edge, or wholly in the hot part.
    seqs = [(0, 37, 60), (16, 80, 85), (0, 64, 64), (32, 40, 47)]
    c = build(pools, instance, seqs)
    err_out, err_lse = merged_error(c, window)
    assert err_out < 2e-6 and err_lse < 2e-6, (err_out, err_lse)


def test_blocks_outside_the_window_are_not_read(pools: list[WarmPool], instance: str) -> None:
    c = build(pools, instance, [(0, 80, 85)])  # warm blocks hold 0-15, ..., 64-79
    stats = WarmAttnStats()
    c.warm(20, stats=stats)  # keys 65..84: only the last warm block is visible
    assert (stats.blocks, stats.keys) == (1, 15)
    c.warm(0, stats=stats)
    assert (stats.blocks, stats.keys, stats.calls) == (6, 95, 2)


@pytest.mark.parametrize("batch_blocks", (1, 2, 3))
def test_sequences_cut_across_decode_batches(
    pools: list[WarmPool], instance: str, batch_blocks: int
) -> None:
    c = build(pools, instance, [(0, 37, 60), (16, 80, 85), (0, 50, 51)])
    err_out, err_lse = merged_error(c, 30, batch_blocks=batch_blocks)
    assert err_out < 2e-6 and err_lse < 2e-6, (err_out, err_lse)
    err_out, err_lse = merged_error(c, 0, batch_blocks=batch_blocks)
    assert err_out < 2e-6 and err_lse < 2e-6, (err_out, err_lse)


def test_pieces_on_worker_threads_equal_one_thread_to_the_bit(
    pools: list[WarmPool], instance: str
) -> None:
    # Pieces of 2 blocks, some holding two sequences: on 3 threads they run on the worker pool,
    # each on one intra-op thread as the caller does on 1, so nothing may differ.
    c = build(pools, instance, [(0, 37, 60), (16, 80, 85), (0, 9, 9), (0, 128, 129)])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = c.warm(batch_blocks=2)
        torch.set_num_threads(3)
        stats = WarmAttnStats()
        t0 = time.perf_counter()
        many = c.warm(batch_blocks=2, stats=stats)
        wall = time.perf_counter() - t0
        # The workers' one intra-op thread is theirs alone: not the caller's, nor the default
        # of a thread started later.
        later: list[int] = []
        thread = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
        thread.start()
        thread.join()
        assert (torch.get_num_threads(), later) == (3, [3])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one[0], many[0]) and torch.equal(one[1], many[1])
    # The stats split the call's wall time between decoding and attention.
    assert 0 < stats.decode_s + stats.attn_s <= wall and stats.decode_s > 0


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("codec", ("lossless", "int8"))
def test_in_place_decode_is_the_codecs_to_the_bit(
    pools: list[WarmPool], instance: str, codec: str, dtype: torch.dtype
) -> None:
    # These codecs are decoded from the record fields here, not by the codec: same bits.
    c = build(pools, instance, [(0, 64, 64)], codec, dtype=dtype)
    slots = [*c.spans[0].slots][::-1]  # any order
    k, v = _decode(_Layer(c.pool, LAYER), slots)  # [Hkv, n*S, D]
    blocks = [c.pool.load(slot, torch.float32) for slot in slots]
    assert torch.equal(k, torch.cat([kl[LAYER] for kl, _ in blocks]).transpose(0, 1))
    assert torch.equal(v, torch.cat([vl[LAYER] for _, vl in blocks]).transpose(0, 1))


def decoded_keys(c: Case, b: int) -> tuple[Tensor, Tensor]:
    """Sequence b's warm keys as the pool's codec decodes them, one slot at a time."""
    blocks = [c.pool.load(slot, torch.float32) for slot in c.spans[b].slots]
    n = c.spans[b].end(S) - c.spans[b].start
    k = torch.cat([kl[LAYER] for kl, _ in blocks])[:n] if blocks else torch.zeros(0, HKV, D)
    v = torch.cat([vl[LAYER] for _, vl in blocks])[:n] if blocks else torch.zeros(0, HKV, D)
    return k, v


def rel_err(approx: Tensor, exact: Tensor) -> float:
    return ((approx.double() - exact).norm() / exact.norm()).item()


# Merged against exact attention, over seeds 0-4 (outlier key channels make the softmax peaky,
# so the lse follows the error of the top scores): int8 out rel err 0.014-0.037, lse abs err
# 0.09-0.20; int4 0.084-0.15 and 0.22-0.41. The out errors match test_kvcodec's codec-only
# measurement: this module adds none. lz4 is exact.
@pytest.mark.parametrize(
    ("codec", "bound_out", "bound_lse"),
    (("lz4", 1e-6, 2e-6), ("int8", 0.06, 0.35), ("int4", 0.25, 0.7)),
)
@pytest.mark.parametrize("seed", (0, 1))
def test_lossy_codecs_error_is_bounded(
    pools: list[WarmPool], instance: str, codec: str, bound_out: float, bound_lse: float, seed: int
) -> None:
    c = build(pools, instance, [(0, 96, 110), (0, 70, 90), (0, 128, 129)], codec, seed=seed)
    out_w, lse_w = c.warm()
    out_h, lse_h = c.hot(0)
    out, lse = merge_attention_partials(out_h, lse_h, out_w, lse_w)
    ex_out, ex_lse = c.exact(0)
    err_out, err_lse = rel_err(out, ex_out), (lse.double() - ex_lse).abs().max().item()
    print(f"\n{codec} seed {seed}: merged out rel err {err_out:.3f}, lse abs err {err_lse:.3f}")
    assert err_out < bound_out and err_lse < bound_lse
    # Against the keys the codec decodes, the partial is exact: all error is the codec's. With
    # outlier keys, scores and lse reach ~30 where an fp32 ulp is 2e-6 (measured up to 7e-6).
    for b in range(len(c.spans)):
        o, s = float64_attention(c.q[b], *decoded_keys(c, b))
        assert torch.allclose(out_w[b].double(), o, atol=3e-5, rtol=0)
        assert torch.allclose(lse_w[b].double(), s, atol=3e-5, rtol=0)


def test_bad_spans_and_shapes_say_what_is_wrong(pools: list[WarmPool], instance: str) -> None:
    c = build(pools, instance, [(0, 20, 30)])
    slots = c.spans[0].slots
    with pytest.raises(ValueError, match=r"last_len=0 must be in 1\.\.16"):
        warm_decode_attention(c.pool, LAYER, c.q, [WarmSpan(slots, 0, 0, 29)], SCALE)
    with pytest.raises(ValueError, match=r"query_pos=10 is before its last warm key at 19"):
        warm_decode_attention(c.pool, LAYER, c.q, [WarmSpan(slots, 0, 4, 10)], SCALE)
    with pytest.raises(ValueError, match=r"Hq a multiple of num_kv_heads=2"):
        warm_decode_attention(c.pool, LAYER, c.q[:, :3], c.spans, SCALE)
    with pytest.raises(ValueError, match=r"layer=2 outside \[0, 2\)"):
        warm_decode_attention(c.pool, 2, c.q, c.spans, SCALE)
