"""attn_warm mode (a) between the daemons: the GPU daemon asks, the CPU daemon's worker answers.

    w2c ring + w2c_meta arena:  GPU -> CPU  ATTN_WARM, payload = request (below)
    c2w ring + c2w_meta arena:  CPU -> GPU  ATTN_WARM_DONE, payload = out, lse and timings

One request is in flight at a time: the GPU daemon needs a layer's answer before its next
layer, so it waits (its own share of the work, already launched on the device, runs
meanwhile). The Warm pool is mapped by both; the GPU daemon (its owner) keeps every slot of a
request referenced until the answer, so the slots cannot change under the CPU daemon.

Request payload, little-endian::

    u32 rows, u32 heads, u32 head_dim, u32 layer, f32 scale, u32 slots, u32 window, u32 pad
    i64 [rows, 4]        per row: start, last_len, query_pos, number of slots
    i32 [slots]          every row's slots, in row order
    f32 [rows, heads, head_dim]  the queries

Answer payload: f64 decode_s, f64 attn_s, f32 out [rows, heads, head_dim], f32 lse [rows, heads].
A ticket's `request_id` carries a request number, echoed by the answer.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import numpy as np
import structlog
import torch
from torch import Tensor

from hybridgen.ipc.link import LinkShm
from hybridgen.ipc.link_worker import LinkWorker
from hybridgen.ipc.ticket import Op, Ticket
from hybridgen.kvtiers.warm_attention import WarmAttnStats, WarmSpan, warm_decode_attention
from hybridgen.kvtiers.warm_pool import WarmPool

log = structlog.get_logger()

_HEADER = struct.Struct("<IIIIfIII")
_TIMES = struct.Struct("<dd")
ARENA_BYTES = 8 << 20
"""Each direction's arena: queries and answers of a batch of rows, far below this."""


class WarmLinkDown(RuntimeError):
    """The CPU daemon did not answer in time (dead or stuck); compute locally instead."""


def encode_request(
    layer: int, q: Tensor, spans: Sequence[WarmSpan], scale: float, window: int
) -> bytes:
    rows, heads, dim = q.shape
    slots = [s for span in spans for s in span.slots]
    meta = np.array(
        [[sp.start, sp.last_len, sp.query_pos, len(sp.slots)] for sp in spans], dtype=np.int64
    )
    header = _HEADER.pack(rows, heads, dim, layer, scale, len(slots), window, 0)
    q32 = q.detach().to("cpu", torch.float32).contiguous().numpy()
    return header + meta.tobytes() + np.asarray(slots, np.int32).tobytes() + q32.tobytes()


def decode_request(data: bytes) -> tuple[int, Tensor, list[WarmSpan], float, int]:
    rows, heads, dim, layer, scale, n_slots, window, _ = _HEADER.unpack_from(data, 0)
    at = _HEADER.size
    meta = np.frombuffer(data, np.int64, rows * 4, at).reshape(rows, 4)
    at += meta.nbytes
    slots = np.frombuffer(data, np.int32, n_slots, at).tolist()
    at += n_slots * 4
    q = torch.from_numpy(np.frombuffer(data, np.float32, rows * heads * dim, at).copy())
    spans, used = [], 0
    for start, last_len, query_pos, count in meta.tolist():
        spans.append(WarmSpan(slots[used : used + count], start, last_len, query_pos))
        used += count
    return layer, q.view(rows, heads, dim), spans, scale, window


class WarmLinkClient:
    """GPU daemon side: creates the link's shared memory and asks for warm partials."""

    def __init__(self, instance: str, timeout_s: float = 5.0) -> None:
        self.shm = LinkShm.create(instance, "w2c", "c2w", ARENA_BYTES)
        self.timeout_s = timeout_s
        self._seq = 0

    def partial(
        self,
        layer: int,
        q: Tensor,
        spans: Sequence[WarmSpan],
        scale: float,
        window: int = 0,
        stats: WarmAttnStats | None = None,
    ) -> tuple[Tensor, Tensor]:
        """What warm_decode_attention returns, computed by the CPU daemon; raises
        WarmLinkDown when no answer comes within timeout_s."""
        self._seq += 1
        offset, length = self.shm.ask_meta.write(encode_request(layer, q, spans, scale, window))
        ticket = Ticket(
            Op.ATTN_WARM, self._seq, layer=layer, payload_offset=offset, payload_len=length
        )
        if not self.shm.ask.put(ticket, self.timeout_s):
            raise WarmLinkDown("the CPU daemon's attn_warm ring stayed full")
        while True:
            answer = self.shm.answer.get(self.timeout_s)
            if answer is None:
                raise WarmLinkDown(f"no ATTN_WARM_DONE within {self.timeout_s} s")
            if answer.request_id == self._seq:
                break
            # A late answer to a request that timed out: drop it.
            self.shm.answer_meta.release(answer.payload_offset, answer.payload_len)
        data = self.shm.answer_meta.read_bytes(answer.payload_offset, answer.payload_len)
        self.shm.answer_meta.release(answer.payload_offset, answer.payload_len)
        decode_s, attn_s = _TIMES.unpack_from(data, 0)
        rows, heads, dim = q.shape
        n_out = rows * heads * dim
        values = np.frombuffer(data, np.float32, n_out + rows * heads, _TIMES.size)
        if stats is not None:
            stats.decode_s += decode_s
            stats.attn_s += attn_s
            stats.calls += 1
        out = torch.from_numpy(values[:n_out].copy()).view(rows, heads, dim)
        return out, torch.from_numpy(values[n_out:].copy()).view(rows, heads)

    def close(self) -> None:
        self.shm.close()


class WarmLinkWorker(LinkWorker[WarmPool]):
    """CPU daemon side: a thread that answers ATTN_WARM with warm_decode_attention over the
    Warm pool it maps read-only."""

    ask, answer = "w2c", "c2w"

    def _open(self) -> WarmPool:
        return WarmPool.attach(self.instance, wait=0.5)

    def _close(self, resource: WarmPool) -> None:
        resource.close()

    def _answer(self, shm: LinkShm, pool: WarmPool, ticket: Ticket) -> None:
        data = shm.ask_meta.read_bytes(ticket.payload_offset, ticket.payload_len)
        shm.ask_meta.release(ticket.payload_offset, ticket.payload_len)
        layer, q, spans, scale, window = decode_request(data)
        stats = WarmAttnStats()
        out, lse = warm_decode_attention(pool, layer, q, spans, scale, window, stats=stats)
        reply = (
            _TIMES.pack(stats.decode_s, stats.attn_s)
            + out.numpy().tobytes()
            + lse.numpy().tobytes()
        )
        offset, length = shm.answer_meta.write(reply)
        answer = Ticket(
            Op.ATTN_WARM_DONE, ticket.request_id, payload_offset=offset, payload_len=length
        )
        if not shm.answer.put(answer, 5.0):  # the GPU daemon stopped reading: it is going away
            log.warning("attn_warm_answer_dropped", request=ticket.request_id)
        self.answered += 1
        if self.answered == 1:
            log.info("attn_warm_worker_serving", first_request=ticket.request_id)
