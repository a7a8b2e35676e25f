"""A step's routed experts as one table for the grouped device launch (Cold-Weights, int8 /
int4 at decode): models/moe.py's combine runs the experts that hit the device cache in one
launch per matrix (kernels/triton_grouped_experts.py) instead of one call per expert.

Every (token, expert) of the step has a row in the output table Y [T * k, H]: row t * k + j
is token t's j-th expert in ascending id, the order in which combine (and HF) adds them up.
The host builds, from the routing ids it reads back once per layer, one int32 table that goes
to the device in one copy:

    rows  [P]      each cache hit's token (row of x)
    slots [P]      its cache slot
    outs  [P]      its row of Y
    other [M]      the rows of Y of the other experts (misses, CPU), expert by expert
    widx  [T * k]  each row of Y's flat index into the routing weights [T, k]

`other` is None when every pair hits the cache in Y's order (then the launch's output is Y).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

import torch
from torch import Tensor

from hybridgen.experts.store import ExpertCache
from hybridgen.kernels import ops
from hybridgen.runtime.upload import upload


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


def step_table(
    ids: Tensor, hits: dict[int, int], others: list[int], device: torch.device
) -> StepTable:
    """ids [T, k] on the host (route()'s), hits {expert: cache slot}, others: the step's other
    experts in the order their outputs come -> the table on `device`."""
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
    packed = array("i", rows + slots + outs + other + widx)
    table = upload(torch.frombuffer(packed, dtype=torch.int32), device)
    p, m = len(outs), len(other)
    return StepTable(
        rows=table[:p],
        slots=table[p : 2 * p],
        outs=table[2 * p : 3 * p],
        other=table[3 * p : 3 * p + m] if m else None,
        widx=table[3 * p + m :],
        top_k=top_k,
    )


def launch_hits(x: Tensor, table: StepTable, cache: ExpertCache, group: int) -> Tensor | None:
    """The cache hits of `table` in one grouped launch -> their outputs [P, H] (None: none)."""
    if table.rows.shape[0] == 0:
        return None
    return ops.grouped_expert_swiglu(
        x, cache.gate_up.fmt, cache.gate_up.parts, cache.down.parts, table.rows, table.slots, group
    )


def finish_step(
    x: Tensor, table: StepTable, y: Tensor | None, other_ys: list[Tensor], weights: Tensor
) -> Tensor:
    """The hits' outputs `y` and the other experts' (in the table's order) in their rows of Y,
    every token's experts weighted and summed -> [T, H]."""
    tokens, top_k = weights.shape
    if table.other is not None:
        full = torch.empty(tokens * top_k, x.shape[1], dtype=x.dtype, device=x.device)
        if y is not None:
            full.index_copy_(0, table.outs.long(), y)
        full.index_copy_(0, table.other.long(), torch.cat(other_ys).to(x.dtype))
        y = full
    assert y is not None
    return ops.expert_weighted_sum(y, weights.contiguous(), table.widx, top_k)
