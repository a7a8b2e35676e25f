"""One engine step's view of the Warm tier: each sequence's Warm slots, and the attention
over them that the model asks for (decode partials, prefill prefixes). warm_tier.py has the
pool and the modes."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from hybridgen.kernels.reference import merge_attention_partials
from hybridgen.kvtiers.warm_attention import WarmSpan
from hybridgen.placement.tuner import SplitTiming
from hybridgen.runtime.upload import upload

if TYPE_CHECKING:
    from hybridgen.kvtiers.warm_tier import WarmTier


@dataclass(frozen=True)
class _DecodePlan:
    """One step's split of each decode row's Warm blocks (WarmContext._decode_plan)."""

    dev: list[int]
    """Rows with a device share, and that share (blocks, token order) of each."""
    shares: list[list[int]]
    dev_idx: Tensor
    table: tuple[Tensor, Tensor] | None
    """The shares as the in-place view's block table and key counts (None: no view)."""
    gpu_blocks: int
    rows: list[int]
    """Rows with a CPU share, and its spans."""
    spans: list[WarmSpan]
    rows_idx: Tensor
    cpu_blocks: int


@dataclass
class WarmContext:
    """One step's Warm keys, per sequence of the batch (in batch order)."""

    tier: WarmTier
    warm_slots: list[list[int]]
    positions: list[int]
    """Position of each sequence's last query token this step."""
    rows: int = 1
    """Decode rows of each sequence (consecutive): more than one checks drafted tokens, and
    its rows' queries are stacked onto its kv heads, so that its Warm keys are read once."""
    _plan: _DecodePlan | None = field(default=None, repr=False)
    """Built by the first layer's decode_partial, read by all the others."""
    _index: dict[int, Tensor] = field(default_factory=dict, repr=False)
    """In-place reads: each prefilling sequence's Warm slots on the device, built by its
    first layer and read by all the others."""

    def decode_partial(self, layer: int, q: Tensor, scale: float) -> tuple[Tensor, Tensor]:
        """Partial attention of the decode rows q [nd, Hq, D] over their Warm keys ->
        out [nd, Hq, D] fp32, lse [nd, Hq] fp32 on q's device (lse -inf: no Warm keys)."""
        if self.rows == 1:
            return self._partial(layer, q, scale)
        # [B * r, Hkv * G, D] -> [B, Hkv * r * G, D]: row j's heads of kv head h sit beside
        # the other rows' heads of h, and every kernel groups query heads by kv head.
        nd, hq, d = q.shape
        shape = (nd // self.rows, self.rows, self.tier.spec.num_kv_heads, -1, d)
        stacked = q.reshape(shape).transpose(1, 2).reshape(shape[0], -1, d)
        out, lse = self._partial(layer, stacked, scale)
        out = out.view(shape[0], shape[2], self.rows, -1, d).transpose(1, 2).reshape(nd, hq, d)
        lse = lse.view(shape[0], shape[2], self.rows, -1).transpose(1, 2).reshape(nd, hq)
        return out, lse

    def _partial(self, layer: int, q: Tensor, scale: float) -> tuple[Tensor, Tensor]:
        """decode_partial with one row per sequence."""
        tier, plan = self.tier, self._decode_plan(q.shape[0], q.device)
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:2], -math.inf, dtype=torch.float32, device=q.device)
        timing = tier.tuner.timing if tier.tuner is not None and tier.mode == "split" else None
        # The CPU's queries cross first: copied after the device's share is queued, the copy
        # would wait for that share to finish, and the two shares would run one after the
        # other instead of side by side.
        q_host = _to_host(q[plan.rows]) if plan.rows else None
        # The device's share next: its kernels run while the CPU works on its share below.
        if plan.dev:
            t0, start = time.perf_counter(), _event(q, timing)
            o, s = tier.device_partial(layer, q[plan.dev], plan.shares, scale, plan.table)
            if timing is not None:  # CUDA: read at the tuner's next update, never waited on
                if start is not None:
                    end = _event(q, timing)
                    timing.pending.append((start, end, plan.gpu_blocks))  # type: ignore[arg-type]
                else:
                    timing.gpu_s += time.perf_counter() - t0
                    timing.gpu_blocks += plan.gpu_blocks
            out[plan.dev_idx], lse[plan.dev_idx] = o, s
        if q_host is not None:
            before, t0 = tier.stats.cpu.decode_s, time.perf_counter()
            o, s = tier.cpu_partial(layer, q_host, plan.spans, scale)
            if timing is not None:
                timing.cpu_s += time.perf_counter() - t0
                timing.cpu_blocks += plan.cpu_blocks
            tier.stats.record_decompress(tier.stats.cpu.decode_s - before)
            idx = plan.rows_idx
            o, s = o.to(q.device), s.to(q.device)
            out[idx], lse[idx] = merge_attention_partials(out[idx], lse[idx], o, s)
        return out, lse

    def _decode_plan(self, nd: int, device: torch.device) -> _DecodePlan:
        """How this step's decode rows split their Warm blocks between the device and the CPU:
        the same for every layer (placements change only between steps), so built once."""
        if self._plan is not None:
            return self._plan
        tier = self.tier
        cuts = [tier.cpu_blocks(len(slots)) for slots in self.warm_slots[:nd]]
        dev = [i for i in range(nd) if len(self.warm_slots[i]) > cuts[i]]
        shares = [list(self.warm_slots[i][cuts[i] :]) for i in dev]
        rows = [i for i in range(nd) if cuts[i]]
        bs = tier.block_size
        self._plan = _DecodePlan(
            dev=dev,
            shares=shares,
            dev_idx=upload(torch.tensor(dev, dtype=torch.int64), device),
            table=tier.view.block_table(shares) if tier.view is not None and dev else None,
            gpu_blocks=sum(map(len, shares)),
            rows=rows,
            spans=[WarmSpan(self.warm_slots[i][: cuts[i]], 0, bs, self.positions[i]) for i in rows],
            rows_idx=upload(torch.tensor(rows, dtype=torch.int64), device),
            cpu_blocks=sum(cuts[i] for i in rows),
        )
        return self._plan

    def prefix(self, layer: int, seq: int, dtype: torch.dtype) -> tuple[Tensor, Tensor] | None:
        """Sequence `seq`'s Warm keys at `layer`, decoded on the device (for its prefill)."""
        slots, view = self.warm_slots[seq], self.tier.view
        if not slots:
            return None
        if view is not None and seq not in self._index:
            self._index[seq] = view.slot_index(slots)
        return self.tier.dense(slots, layer, dtype, self._index.get(seq))


def _to_host(q: Tensor) -> Tensor:
    """The CPU share's queries in host memory (waits for the kernels that made them)."""
    return q.to("cpu")


def _event(q: Tensor, timing: SplitTiming | None) -> torch.cuda.Event | None:
    """A recorded CUDA event when a split is being timed on CUDA, else None."""
    if timing is None or not q.is_cuda:
        return None
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event
