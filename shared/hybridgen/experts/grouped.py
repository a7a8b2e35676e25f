"""A step's routed experts as one table for the grouped device launches (Cold-Weights, int8 /
int4): models/moe.py's combine runs the experts that hit the device cache in one launch per
matrix instead of one call per expert: those of few rows (decode) in the grouped GEMV
(kernels/triton_grouped_experts.py), int4 ones of more (a prompt's step) in the grouped GEMM
(kernels/triton_grouped_gemm.py).

Every (token, expert) of the step has a row in the output table Y [T * k, H]: row t * k + j
is token t's j-th expert in ascending id, the order in which combine (and HF) adds them up.
The host builds, from the routing ids it reads back once per layer, one int32 table that goes
to the device in one copy:

    rows  [P]      each cache hit's token (row of x)
    slots [P]      its cache slot
    outs  [P]      its row of Y
    other [M]      the rows of Y of the other experts (misses, CPU), expert by expert
    widx  [T * k]  each row of Y's flat index into the routing weights [T, k]
    many_rows [G]  the tokens of the experts with more rows than the grouped GEMV takes
                   (a prompt's step), expert by expert in blocks of BLOCK_M, -1 padded
    many_outs [G]  their rows of Y (-1 for padding)
    many_slots [G / BLOCK_M]  each block's cache slot (kernels/triton_grouped_gemm.py)

`other` is None when every pair hits the cache in Y's order (then the launch's output is Y).
"""

from __future__ import annotations

from array import array
from collections.abc import Set
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import Tensor

from hybridgen.experts.format import GROUP
from hybridgen.experts.store import ExpertCache
from hybridgen.kernels import ops
from hybridgen.runtime.upload import upload, upload_into


@dataclass(frozen=True)
class StepTable:
    """One layer's step as the grouped launch reads it (slices of one device tensor)."""

    rows: Tensor
    slots: Tensor
    outs: Tensor
    other: Tensor | None
    """Rows of Y the other experts fill, in `others` order; None when there are none."""
    widx: Tensor
    top_k: int
    many_rows: Tensor | None = None
    """The many-row experts' GEMM layout (None: there are none)."""
    many_outs: Tensor | None = None
    many_slots: Tensor | None = None


class Packed(NamedTuple):
    """A step's table on the host: rows + slots + outs + other + widx + many_rows + many_outs
    + many_slots as int32, and the lengths that split it."""

    host: array
    pairs: int
    others: int
    positions: int = 0
    """Of the many-row experts' layout (a multiple of its BLOCK_M)."""
    blocks: int = 0


NUMPY_PAIRS = 256
"""From this many (token, expert) pairs pack_step groups them with numpy: a qwen3-30b-a3b
prompt step of 256 tokens (2,048 pairs) in 0.36 ms a layer against the loop's 0.75 on the
2-core machine, mixtral's 1,024 x 2 in 0.15 against 0.92. Below it the loop is as fast or
faster (a decode step of 8 pairs: 7 us against 45; they tie at 256 pairs of 8 experts a token)."""


def pack_step(
    ids: Tensor,
    hits: dict[int, int],
    others: list[int],
    many: dict[int, int] | None = None,
    block_m: int = 16,
) -> Packed:
    """ids [T, k] on the host (route()'s), hits {expert: cache slot} (the grouped GEMV's),
    others: the step's other experts in the order their outputs come, many {expert: cache
    slot} (the grouped GEMM's, laid out in blocks of block_m) -> the table on the host."""
    pack = _pack_arrays if ids.numel() >= NUMPY_PAIRS else _pack_loop
    return pack(ids, hits, others, many or {}, block_m)


def _pack_loop(
    ids: Tensor, hits: dict[int, int], others: list[int], many: dict[int, int], block_m: int
) -> Packed:
    """pack_step in Python loops (few pairs)."""
    top_k = ids.shape[1]
    flat: list[int] = []  # Y's rows' experts
    widx: list[int] = []
    for t, row in enumerate(ids.tolist()):
        for j in sorted(range(top_k), key=row.__getitem__):
            flat.append(row[j])
            widx.append(t * top_k + j)
    at: dict[int, list[int]] = {}  # each expert's rows of Y
    for r, e in enumerate(flat):
        at.setdefault(e, []).append(r)
    outs = sorted(r for e in hits for r in at[e])
    rows = [r // top_k for r in outs]
    slots = [hits[flat[r]] for r in outs]
    other = [r for e in others for r in at[e]]
    many_rows: list[int] = []
    many_outs: list[int] = []
    many_slots: list[int] = []
    for e, slot in sorted(many.items()):
        blocks = -(-len(at[e]) // block_m)
        pad = [-1] * (blocks * block_m - len(at[e]))
        many_rows += [r // top_k for r in at[e]] + pad
        many_outs += at[e] + pad
        many_slots += [slot] * blocks
    host = array("i", rows + slots + outs + other + widx + many_rows + many_outs + many_slots)
    return Packed(host, len(outs), len(other), len(many_rows), len(many_slots))


def _pack_arrays(
    ids: Tensor, hits: dict[int, int], others: list[int], many: dict[int, int], block_m: int
) -> Packed:
    """pack_step with numpy (many pairs): the same table as _pack_loop."""
    tokens, top_k = ids.shape
    routed = ids.numpy()
    order = np.argsort(routed, axis=1, kind="stable")  # each token's experts ascending
    flat = np.take_along_axis(routed, order, 1).ravel()
    widx = (order + np.arange(tokens)[:, None] * top_k).ravel()
    grouped = np.argsort(flat, kind="stable")  # rows of Y expert by expert, each ascending
    experts, starts, counts = np.unique(flat[grouped], return_index=True, return_counts=True)
    span = {int(e): (int(a), int(a + n)) for e, a, n in zip(experts, starts, counts, strict=True)}

    def at(e: int) -> np.ndarray:  # an expert's rows of Y
        lo, hi = span[e]
        return grouped[lo:hi]

    slot_of = np.full(int(max(flat.max(), *hits, 0)) + 1, -1, dtype=np.int64)
    for e, slot in hits.items():
        slot_of[e] = slot
    outs = np.flatnonzero(slot_of[flat] >= 0)
    parts = [outs // top_k, slot_of[flat[outs]], outs, *(at(e) for e in others), widx]
    many_rows: list[np.ndarray] = []
    many_outs: list[np.ndarray] = []
    many_slots: list[np.ndarray] = []
    for e, slot in sorted(many.items()):
        rows = at(e)
        blocks = -(-len(rows) // block_m)
        pad = np.full(blocks * block_m - len(rows), -1)
        many_rows += [rows // top_k, pad]
        many_outs += [rows, pad]
        many_slots.append(np.full(blocks, slot))
    host = np.concatenate([*parts, *many_rows, *many_outs, *many_slots]).astype(np.int32)
    other = sum(len(at(e)) for e in others)
    positions, blocks = sum(map(len, many_outs)), sum(map(len, many_slots))
    return Packed(array("i", host.tobytes()), len(outs), other, positions, blocks)


def step_table(packed: Packed, top_k: int, device: torch.device) -> StepTable:
    """pack_step's table on `device`, in one copy."""
    table = upload(torch.frombuffer(packed.host, dtype=torch.int32), device)
    return _slices(table, packed, top_k)


def _slices(table: Tensor, packed: Packed, top_k: int) -> StepTable:
    p, m, g = packed.pairs, packed.others, packed.positions
    end = table.shape[0] - 2 * g - packed.blocks  # where widx ends
    return StepTable(
        rows=table[:p],
        slots=table[p : 2 * p],
        outs=table[2 * p : 3 * p],
        other=table[3 * p : 3 * p + m] if m else None,
        widx=table[3 * p + m : end],
        top_k=top_k,
        many_rows=table[end : end + g] if g else None,
        many_outs=table[end + g : end + 2 * g] if g else None,
        many_slots=table[end + 2 * g :] if g else None,
    )


def launch_hits(
    x: Tensor, table: StepTable, cache: ExpertCache, group: int, pairs: slice = slice(None)
) -> Tensor | None:
    """The cache hits of `table` (its `pairs`) in one grouped launch -> their outputs [P, H]
    (None: none)."""
    rows, slots = table.rows[pairs], table.slots[pairs]
    if rows.shape[0] == 0:
        return None
    return ops.grouped_expert_swiglu(
        x, cache.gate_up.fmt, cache.gate_up.parts, cache.down.parts, rows, slots, group
    )


def copied_last(packed: Packed, copied: Set[int]) -> tuple[Packed, int]:
    """packed with the pairs of the slots in `copied` (misses being copied in) after the
    others, each part in its order -> (that table, the pairs before them). Its outs are then
    not in Y's order: finish_step(..., in_order=False)."""
    p = packed.pairs
    host = np.frombuffer(packed.host, dtype=np.int32).copy()
    late = np.isin(host[p : 2 * p], np.fromiter(copied, dtype=np.int32, count=len(copied)))
    order = np.argsort(late, kind="stable")
    for part in range(3):  # rows, slots, outs
        host[part * p : (part + 1) * p] = host[part * p : (part + 1) * p][order]
    return packed._replace(host=array("i", host.tobytes())), int(p - late.sum())


def launch_many(x: Tensor, table: StepTable, cache: ExpertCache, group: int) -> Tensor | None:
    """The many-row experts of `table` in one grouped GEMM launch per matrix, written into
    their rows of a new Y [T * k, H] (returned; the other rows unwritten), or None: none."""
    if table.many_rows is None:
        return None
    assert table.many_outs is not None and table.many_slots is not None
    full = torch.empty(table.widx.shape[0], x.shape[1], dtype=x.dtype, device=x.device)
    ops.grouped_expert_gemm_swiglu(
        x,
        cache.gate_up.parts,
        cache.down.parts,
        (table.many_rows, table.many_outs, table.many_slots),
        group,
        full,
    )
    return full


def finish_step(
    x: Tensor,
    table: StepTable,
    y: Tensor | None,
    other_ys: list[Tensor],
    weights: Tensor,
    full: Tensor | None = None,
    in_order: bool = True,
) -> Tensor:
    """The hits' outputs `y` and the other experts' (in the table's order) in their rows of Y
    (`full`: launch_many's Y, its many-row experts' rows written), every token's experts
    weighted and summed -> [T, H]. in_order: the hits' outs are Y's rows in order (pack_step's
    table, not copied_last's)."""
    tokens, top_k = weights.shape
    if table.other is not None or full is not None or not in_order:
        if full is None:
            full = torch.empty(tokens * top_k, x.shape[1], dtype=x.dtype, device=x.device)
        if y is not None:
            full.index_copy_(0, table.outs.long(), y)
        if table.other is not None:
            full.index_copy_(0, table.other.long(), torch.cat(other_ys).to(x.dtype))
        y = full
    assert y is not None
    return ops.expert_weighted_sum(y, weights.contiguous(), table.widx, top_k)


class HitLaunch:
    """The grouped launch and the weighted sum of a step whose pairs all hit the device cache,
    for one shape of x [T, H] and weights [T, k], from static buffers: captured in a CUDA
    graph when given a pool (replayed for every layer, whose experts are in the same cache
    tensors), else run eagerly through the same buffers. The host's part is then three copies
    and a replay where it launched some ten kernels and allocations: ~0.25 ms of host time a
    layer on an H100 at batch 1 (B4c, 33c5242), while the device waited after the layer's
    sync."""

    def __init__(self, cache: ExpertCache, x: Tensor, weights: Tensor, pool: Any | None) -> None:
        tokens, top_k = weights.shape
        self.cache, self.pairs, self.top_k = cache, tokens * top_k, top_k
        self.x = torch.zeros_like(x)
        self.weights = torch.zeros_like(weights)
        p = torch.arange(self.pairs, dtype=torch.int32)
        # Any valid table until the first copy: pair p on token p // k, slot p % capacity.
        self.table = torch.cat([p // top_k, p % cache.capacity, p, p]).to(cache.device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out = self._launch()  # outside the capture: Triton compiles its kernels
        if pool is not None:
            torch.cuda.synchronize(cache.device)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, pool=pool):
                self.out = self._launch()

    def _launch(self) -> Tensor:
        table = _slices(self.table, Packed(array("i"), self.pairs, 0), self.top_k)
        y = launch_hits(self.x, table, self.cache, GROUP)
        return finish_step(self.x, table, y, [], self.weights)

    def run(self, x: Tensor, packed: Packed, weights: Tensor) -> Tensor:
        """combine()'s output for x and weights, the step's table `packed` (every pair a hit)."""
        assert packed.pairs == self.pairs and packed.others == packed.positions == 0
        self.x.copy_(x)
        self.weights.copy_(weights)
        upload_into(self.table, torch.frombuffer(packed.host, dtype=torch.int32))
        if self.graph is None:
            return self._launch()
        self.graph.replay()
        return self.out.clone()  # the next layer's replay writes self.out again


class HitLaunches:
    """A cache's HitLaunch for each shape of step met (models/moe.py's combine uses them when
    every pair of a step hits), captured at first use; set by MoeDecodeGraphs, so only where
    CUDA graphs are on (`cuda_graphs`), and dropped when the cache is resized."""

    def __init__(self, cache: ExpertCache, pool: Any | None) -> None:
        self.cache, self.pool = cache, pool
        self._by_shape: dict[tuple[int, int, torch.dtype, torch.dtype], HitLaunch] = {}

    def run(self, x: Tensor, packed: Packed, weights: Tensor) -> Tensor:
        key = (x.shape[0], weights.shape[1], x.dtype, weights.dtype)
        launch = self._by_shape.get(key)
        if launch is None:
            launch = self._by_shape[key] = HitLaunch(self.cache, x, weights, self.pool)
        return launch.run(x, packed, weights)

    def __len__(self) -> int:
        return len(self._by_shape)
