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

from hybridgen.cpu_daemon.warm_attention import WarmSpan
from hybridgen.gpu_daemon.tuner import SplitTiming
from hybridgen.kernels.reference import merge_attention_partials

if TYPE_CHECKING:
    from hybridgen.gpu_daemon.warm_tier import WarmTier


@dataclass
class WarmContext:
    """One step's Warm keys, per sequence of the batch (in batch order)."""

    tier: WarmTier
    warm_slots: list[list[int]]
    positions: list[int]
    """Position of each sequence's last query token this step."""
    _index: dict[int, Tensor] = field(default_factory=dict, repr=False)
    """In-place reads: each prefilling sequence's Warm slots on the device, built by its
    first layer and read by all the others."""

    def decode_partial(self, layer: int, q: Tensor, scale: float) -> tuple[Tensor, Tensor]:
        """Partial attention of the decode rows q [nd, Hq, D] over their Warm keys ->
        out [nd, Hq, D] fp32, lse [nd, Hq] fp32 on q's device (lse -inf: no Warm keys)."""
        tier, nd = self.tier, q.shape[0]
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:2], -math.inf, dtype=torch.float32, device=q.device)
        cuts = [tier.cpu_blocks(len(slots)) for slots in self.warm_slots[:nd]]
        # The device's share first: its kernels run while the CPU works on its share below.
        dev = [i for i in range(nd) if len(self.warm_slots[i]) > cuts[i]]
        timing = tier.tuner.timing if tier.tuner is not None and tier.mode == "split" else None
        if dev:
            shares = [list(self.warm_slots[i][cuts[i] :]) for i in dev]
            t0, start = time.perf_counter(), _event(q, timing)
            o, s = tier.device_partial(layer, q[dev], shares, scale)
            if timing is not None:  # CUDA: read at the tuner's next update, never waited on
                n = sum(map(len, shares))
                if start is not None:
                    timing.pending.append((start, _event(q, timing), n))  # type: ignore[arg-type]
                else:
                    timing.gpu_s += time.perf_counter() - t0
                    timing.gpu_blocks += n
            idx = torch.tensor(dev, device=q.device)
            out[idx], lse[idx] = o, s
        rows = [i for i in range(nd) if cuts[i]]
        if rows:
            bs = tier.block_size
            spans = [
                WarmSpan(self.warm_slots[i][: cuts[i]], 0, bs, self.positions[i]) for i in rows
            ]
            before, t0 = tier.stats.cpu.decode_s, time.perf_counter()
            o, s = tier.cpu_partial(layer, q[rows], spans, scale)
            if timing is not None:
                timing.cpu_s += time.perf_counter() - t0
                timing.cpu_blocks += sum(cuts[i] for i in rows)
            tier.stats.record_decompress(tier.stats.cpu.decode_s - before)
            idx = torch.tensor(rows, device=q.device)
            o, s = o.to(q.device), s.to(q.device)
            out[idx], lse[idx] = merge_attention_partials(out[idx], lse[idx], o, s)
        return out, lse

    def prefix(self, layer: int, seq: int, dtype: torch.dtype) -> tuple[Tensor, Tensor] | None:
        """Sequence `seq`'s Warm keys at `layer`, decoded on the device (for its prefill)."""
        slots, view = self.warm_slots[seq], self.tier.view
        if not slots:
            return None
        if view is not None and seq not in self._index:
            self._index[seq] = view.slot_index(slots)
        return self.tier.dense(slots, layer, dtype, self._index.get(seq))


def _event(q: Tensor, timing: SplitTiming | None) -> torch.cuda.Event | None:
    """A recorded CUDA event when a split is being timed on CUDA, else None."""
    if timing is None or not q.is_cuda:
        return None
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event
