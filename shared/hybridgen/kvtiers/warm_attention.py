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

Blocks wholly outside the window are never read. The visible blocks of all sequences, one
after the other, are cut into pieces of `step` blocks; a piece gives one partial per sequence
in it, and the partials of a sequence are merged by lse at the end (exact, as above)::

    flat blocks:  | seq 0 ........ | seq 1 .. | seq 2 ............... |
    pieces:       |  piece 0   |  piece 1   |  piece 2   |  piece 3    |

A piece gathers its records out of shm with index_select (a copy, so a slot recycled later
cannot change them), decodes them to fp32 (lossless and int8 straight from the record fields
into head-major [Hkv, tokens, D], which the matmuls read fastest), and attends. With N =
torch.get_num_threads() > 1, pieces and the merge run on a pool of N threads with one
intra-op thread each: a piece's ops are too small to split well over N threads, N pieces at
once are not (torch releases the GIL inside ops), and the caller forks no OpenMP team whose
idle threads would spin on the cores the workers need.
"""

from __future__ import annotations

import bisect
import math
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch import Tensor

from hybridgen.kvtiers.warm_pool import WarmPool

PIECE_BYTES = 8 * 2**20
"""Most decoded fp32 K+V per piece when `batch_blocks` is not given (64 blocks of llama3-8b's
shape). Measured on 2 cores, 512 blocks: 16, 32, 64 and 512 blocks per piece took 17.1,
13.7, 12.5 and 20.2 ms on one thread (each piece costs ~0.2 ms of Python and small ops; one
piece of all 64 MiB misses the caches). Per-thread scratch is 1.5x this (`_Scratch`)."""
MIN_PIECE_BYTES = 2**20
"""Fewest decoded bytes per piece when there are fewer blocks than threads * PIECE_BYTES:
below ~8 blocks, another thread gains less than a piece's overhead costs."""


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
    "CPU attention time". Pass one instance to many calls to sum over layers and steps.

    The pieces of a call run in parallel, so decode_s + attn_s is the call's wall time, split
    in proportion to the thread time spent decoding and attending."""

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


_IN_PLACE = {
    "lossless": (("k", ""), ("v", "")),
    "int8": (("k_codes", "k_scale"), ("v_codes", "v_scale")),
}
"""Codecs decoded here, from the record fields (values, and scales of `group` channels)."""


class _Layer:
    """One layer of the pool's slot area, as the records and as the codec's fields.

    Invariant: the views alias shm, so a _Layer lives only within one call (the pool may be
    closed after it returns)."""

    def __init__(self, pool: WarmPool, layer: int) -> None:
        self.codec = pool.codec
        self.records = torch.from_numpy(pool.slot_area())[:, layer]  # [capacity, record_bytes]
        self.fields: dict[str, Tensor] = {}  # name -> [capacity, *field shape] strided view
        if self.codec.name in _IN_PLACE:
            layout = self.codec.layout  # type: ignore[attr-defined]
            for f, at in zip(layout.fields, layout.offsets, strict=True):
                view = self.records[:, at : at + f.nbytes].view(f.dtype)
                self.fields[f.name] = view.unflatten(1, f.shape)


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


def _head_partial(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """q: [Hkv, G, D] (pre-scaled), k, v: [Hkv, L, D] fp32, any strides, L >= 1 -> out [Hq, D],
    lse [Hq]. Head-major k and v are the fastest here: each head's keys are one dense matrix."""
    scores = torch.matmul(q, k.transpose(1, 2))  # [Hkv, G, L]
    peak = scores.amax(-1, keepdim=True)  # finite: L >= 1 and finite inputs
    probs = scores.sub_(peak).exp_()  # (softmax + logsumexp cost ~2x more per call)
    total = probs.sum(-1, keepdim=True)  # [Hkv, G, 1], >= 1
    out = torch.matmul(probs, v).div_(total)  # [Hkv, G, D]
    return out.flatten(0, 1), (peak + total.log()).flatten()


def dense_partial(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """q: [Hkv, G, D] (pre-scaled), k, v: [L, Hkv, D] fp32, L >= 1 -> out [Hq, D], lse [Hq];
    plain torch, so it also runs on the GPU (the Warm tier's gpu mode)."""
    return _head_partial(q, k.transpose(0, 1), v.transpose(0, 1))


class _Scratch(threading.local):
    """Per-thread buffers, reused by every piece the thread runs. Fresh multi-MiB tensors
    may go back to the OS on free and page-fault on every piece, as glibc's thresholds decide
    (measured: 28.6 instead of 14.0 ms for 512 blocks on one thread). They grow to the
    largest piece seen: 12 MiB per thread at PIECE_BYTES for bf16 lossless."""

    def __init__(self) -> None:
        self.buffers: dict[str, Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        numel = math.prod(shape)
        buf = self.buffers.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype:
            # A normal tensor: one made under inference_mode could not be written outside it.
            with torch.inference_mode(False):
                buf = self.buffers[name] = torch.empty(numel, dtype=dtype)
        return buf[:numel].view(shape)


_SCRATCH = _Scratch()


def _decode(layer: _Layer, slots: Sequence[int]) -> tuple[Tensor, Tensor]:
    """Copy `slots`' records out of shm and decode them -> k, v [Hkv, n*S, D] fp32."""
    n, codec, index = len(slots), layer.codec, torch.tensor(list(slots))
    if codec.name not in _IN_PLACE:
        records = _SCRATCH.get("records", (n, layer.records.shape[1]), torch.uint8)
        torch.index_select(layer.records, 0, index, out=records)
        k, v = codec.decode_blocks(records, torch.float32)  # [n, S, Hkv, D]
        return k.flatten(0, 1).transpose(0, 1), v.flatten(0, 1).transpose(0, 1)
    # Gathered field by field and decoded into head-major fp32 (the layout _head_partial reads
    # fastest) by the codec's own math, so the result is the same to the bit.
    s, hkv, dim = codec.spec.shape
    out = _SCRATCH.get("decoded", (2, hkv, n, s, dim), torch.float32)
    for dst, (name, scale_name) in zip(out, _IN_PLACE[codec.name], strict=True):
        area = layer.fields[name]
        raw = _SCRATCH.get(name, (n, *area.shape[1:]), area.dtype)
        torch.index_select(area, 0, index, out=raw)  # [n, S, Hkv, D]
        dst.copy_(raw.permute(2, 0, 1, 3))  # -> [Hkv, n, S, D]
        if scale_name:  # int8: code.float() * scale, per group of channels
            scale = layer.fields[scale_name].index_select(0, index)  # [n, S, Hkv, D/g]
            dst.unflatten(-1, (scale.shape[-1], -1)).mul_(scale.permute(2, 0, 1, 3)[..., None])
    return out[0].flatten(1, 2), out[1].flatten(1, 2)


_Partial = tuple[int, Tensor, Tensor]
"""(sequence, out [Hq, D], lse [Hq]) over some of the sequence's keys."""


def _attend(
    layer: _Layer, qs: Tensor, slots: Sequence[int], lo_tok: int, runs: Sequence[_Run]
) -> tuple[list[_Partial], float, float]:
    """The partials over one piece: `slots`, whose first token is flat token `lo_tok`, and
    the parts of `runs` inside it. Returns them with the decode and attention seconds."""
    t0 = time.perf_counter()
    k, v = _decode(layer, slots)  # [Hkv, n*S, D]
    t1 = time.perf_counter()
    hi_tok, parts = lo_tok + k.shape[1], []
    for run in runs:  # in token order, from the first that ends inside this piece
        if run.lo >= hi_tok:
            break
        # Never empty (the run ends past lo_tok); it drops a partial last block's padding.
        lo, hi = max(run.lo, lo_tok) - lo_tok, min(run.hi, hi_tok) - lo_tok
        parts.append((run.seq, *_head_partial(qs[run.seq], k[:, lo:hi], v[:, lo:hi])))
    return parts, t1 - t0, time.perf_counter() - t1


def _merge(parts: Sequence[_Partial], batch: int, hq: int, dim: int) -> tuple[Tensor, Tensor]:
    """Partials of B sequences -> out [B, Hq, D], lse [B, Hq].

    Weighs each partial by e^(lse - max lse of its sequence); the largest weight is 1, so the
    total is >= 1 where a sequence has partials, and 0 (out 0, lse -inf) where it has none."""
    if not parts:
        return torch.zeros(batch, hq, dim), torch.full((batch, hq), -math.inf)
    seqs = torch.tensor([p[0] for p in parts])  # [P]
    outs = torch.stack([p[1] for p in parts])  # [P, Hq, D]
    lses = torch.stack([p[2] for p in parts])  # [P, Hq]
    rows = seqs[:, None].expand(-1, hq)
    peak = torch.full((batch, hq), -math.inf).scatter_reduce_(0, rows, lses, "amax")
    weight = torch.exp(lses - peak[seqs])  # [P, Hq]
    total = torch.zeros(batch, hq).index_add_(0, seqs, weight)
    out = torch.zeros(batch, hq, dim).index_add_(0, seqs, outs * weight[..., None])
    return out.div_(total.clamp(min=1.0)[..., None]), peak + total.log()


_EXECUTOR: tuple[int, ThreadPoolExecutor] | None = None
"""The shared worker pool and its size; rebuilt when torch.get_num_threads() changes."""
_EXECUTOR_LOCK = threading.Lock()


def _one_intra_op_thread() -> None:
    # torch.set_num_threads sets this thread's OpenMP/MKL count and the default of threads
    # that start later. A thread takes that default at its first torch call, so make that
    # call first, or the caller putting the default back would undo the 1 set here.
    torch.get_num_threads()
    torch.set_num_threads(1)


def _executor(threads: int) -> ThreadPoolExecutor:
    """The shared pool of `threads` workers, each limited to one intra-op thread."""
    global _EXECUTOR
    with _EXECUTOR_LOCK:
        if _EXECUTOR is None or _EXECUTOR[0] != threads:
            if _EXECUTOR is not None:
                _EXECUTOR[1].shutdown(wait=False)
            pool = ThreadPoolExecutor(threads, "warm-attn", _one_intra_op_thread)
            barrier = threading.Barrier(threads)  # every worker started and set up ...
            list(pool.map(lambda _: barrier.wait(), range(threads)))
            torch.set_num_threads(threads)  # ... before the default goes back
            _EXECUTOR = (threads, pool)
        return _EXECUTOR[1]


def _step(total_blocks: int, threads: int, per_block: int) -> int:
    """Blocks per piece: enough pieces for every thread, each within the cache budget."""
    most = max(1, PIECE_BYTES // per_block)
    least = max(1, MIN_PIECE_BYTES // per_block)
    return min(most, max(least, -(-total_blocks // threads)))


def _attend_all(
    pool: WarmPool, layer: int, qs: Tensor, slots: list[int], runs: list[_Run], step: int
) -> tuple[Tensor, Tensor, float, float]:
    """Every piece of `step` blocks, merged -> out [B, Hq, D], lse [B, Hq], and the decode and
    attention seconds summed over pieces.

    With more than one thread, all of it runs on the worker pool, the merge too: an op that
    forks OpenMP threads in the caller leaves them spinning for ~30 ms afterwards (measured),
    on the cores the workers need."""
    bs = pool.codec.spec.block_size
    # src aliases shm, so it must be gone when the call returns (the pool may close then).
    src = _Layer(pool, layer)
    ends = [run.hi for run in runs]  # ascending: runs are in flat token order

    def piece(c0: int) -> tuple[list[_Partial], float, float]:
        first = bisect.bisect_right(ends, c0 * bs)  # the first run that ends inside it
        return _attend(src, qs, slots[c0 : c0 + step], c0 * bs, runs[first:])

    starts = range(0, len(slots), step)
    batch, hkv, group, dim = qs.shape
    threads = torch.get_num_threads()
    if threads == 1:
        done = [piece(c0) for c0 in starts]
        out, lse = _merge([p for ps, _, _ in done for p in ps], batch, hkv * group, dim)
    else:
        workers = _executor(threads)
        done = list(workers.map(piece, starts))
        parts = [p for ps, _, _ in done for p in ps]
        out, lse = workers.submit(_merge, parts, batch, hkv * group, dim).result()
    return out, lse, sum(d[1] for d in done), sum(d[2] for d in done)


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
    < query_pos - sliding_window + 1 are excluded (paged_decode_attention's rule);
    batch_blocks: blocks per piece (default: sized by PIECE_BYTES and the thread count).
    Returns out [B, Hq, D] and lse [B, Hq] (natural log), both fp32 on the CPU; a sequence
    with no visible warm key gets out 0 and lse -inf, which the merge ignores.
    """
    t_call = time.perf_counter()
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
    slots, runs = _plan(spans, bs, sliding_window)
    per_block = 2 * math.prod(spec.shape) * 4  # decoded fp32 K and V
    step = batch_blocks or _step(len(slots), torch.get_num_threads(), per_block)
    # qs: [B, Hkv, G, D]; scaling q once costs Hq*D multiplies instead of Hq*L.
    qs = (q.detach().to("cpu", torch.float32) * scale).view(batch, hkv, hq // hkv, dim)
    out, lse, decode_s, attn_s = _attend_all(pool, layer, qs, slots, runs, step)
    stats = stats if stats is not None else WarmAttnStats()
    wall = time.perf_counter() - t_call
    share = decode_s / (decode_s + attn_s) if slots else 0.0
    stats.decode_s += wall * share
    stats.attn_s += wall * (1 - share)
    stats.calls += 1
    stats.blocks += len(slots)
    stats.bytes_decoded += len(slots) * pool.record_bytes
    stats.keys += sum(run.hi - run.lo for run in runs)
    return out, lse
