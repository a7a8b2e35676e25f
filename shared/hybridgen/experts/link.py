"""Cold-Weights experts computed by the CPU daemon: the GPU daemon asks, a worker answers.

    x2c ring + x2c_meta arena:  GPU -> CPU  EXPERT_RUN, payload = request (below)
    c2x ring + c2x_meta arena:  CPU -> GPU  EXPERT_DONE, payload = outputs and compute time

For one MoE layer the GPU daemon sends every routed expert the latency model puts on the
CPU, launches the cached experts on the device, and only then waits for the answer, so the
two sides compute at once. The experts' weights are the GPU daemon's shared expert arena
(experts/arena.py), mapped read-only here: nothing but activations crosses.

Request payload, little-endian: u32 layer, u32 experts, u32 hidden, u32 dtype (ticket.DType),
u32 rows, then i32 expert ids [experts], i32 row counts [experts], then the rows [rows,
hidden] in the model dtype, expert after expert. Answer: f64 compute seconds, f64 when it
was written (time.monotonic(): one clock for every process of the host), then the outputs
[rows, hidden] in the same order and dtype. A ticket's `request_id` carries a request
number, echoed by the answer.
"""

from __future__ import annotations

import struct
import time

import numpy as np
import structlog
import torch
from torch import Tensor

from hybridgen.experts.arena import ExpertArena
from hybridgen.experts.store import ExpertStore, RemoteDown
from hybridgen.ipc.link import LinkShm
from hybridgen.ipc.link_worker import LinkWorker
from hybridgen.ipc.meta_buffer import ArenaFull
from hybridgen.ipc.ticket import DType, Op, Ticket

log = structlog.get_logger()

_HEADER = struct.Struct("<IIIII")
_TIMES = struct.Struct("<dd")
ARENA_BYTES = 32 << 20
"""Each direction's arena; a request that does not fit is computed in the GPU daemon."""
_CODES = {torch.float32: DType.F32, torch.bfloat16: DType.BF16, torch.float16: DType.F16}
_DTYPES = {int(code): dtype for dtype, code in _CODES.items()}


def _raw(t: Tensor) -> bytes:
    """The bytes of a CPU tensor (bf16 has no numpy dtype: viewed as int16)."""
    t = t.contiguous()
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().tobytes()


def _tensor(data: bytes, offset: int, count: int, dtype: torch.dtype) -> Tensor:
    if dtype == torch.bfloat16:
        return torch.from_numpy(np.frombuffer(data, np.int16, count, offset).copy()).view(dtype)
    np_dtype = {torch.float32: np.float32, torch.float16: np.float16}[dtype]
    return torch.from_numpy(np.frombuffer(data, np_dtype, count, offset).copy())


def encode_request(layer: int, jobs: list[tuple[int, Tensor]]) -> bytes:
    xs = [x.detach().to("cpu") for _, x in jobs]
    hidden, dtype = xs[0].shape[1], xs[0].dtype
    rows = sum(x.shape[0] for x in xs)
    header = _HEADER.pack(layer, len(jobs), hidden, _CODES[dtype], rows)
    ids = np.asarray([e for e, _ in jobs], np.int32).tobytes()
    counts = np.asarray([x.shape[0] for x in xs], np.int32).tobytes()
    return header + ids + counts + b"".join(_raw(x) for x in xs)


def decode_request(data: bytes) -> tuple[int, list[tuple[int, Tensor]]]:
    layer, n, hidden, code, rows = _HEADER.unpack_from(data, 0)
    at = _HEADER.size
    ids = np.frombuffer(data, np.int32, n, at).tolist()
    counts = np.frombuffer(data, np.int32, n, at + 4 * n).tolist()
    x = _tensor(data, at + 8 * n, rows * hidden, _DTYPES[code]).view(rows, hidden)
    return layer, list(zip(ids, torch.split(x, counts), strict=True))


class ExpertLinkClient:
    """GPU daemon side: creates the link's shared memory; `submit` then `wait`, one request
    in flight at a time."""

    def __init__(self, instance: str, timeout_s: float = 10.0) -> None:
        self.shm = LinkShm.create(instance, "x2c", "c2x", ARENA_BYTES)
        self.timeout_s = timeout_s
        self._seq = 0
        self.cpu_s = 0.0
        """The CPU daemon's compute time over every answer."""
        self.answered_at = 0.0
        """When the last answer was written (time.monotonic()): a round trip ends there, not
        when the GPU daemon, busy launching the device's experts, got round to reading it."""

    def submit(self, layer: int, jobs: list[tuple[int, Tensor]]) -> int:
        """Send `jobs` (expert id, its rows [N, hidden]); the request's number. RemoteDown when
        the request does not fit or the ring stays full."""
        try:
            offset, length = self.shm.ask_meta.write(encode_request(layer, jobs))
        except ArenaFull as exc:
            raise RemoteDown(f"the EXPERT_RUN request does not fit the arena: {exc}") from exc
        self._seq += 1
        ticket = Ticket(
            Op.EXPERT_RUN, self._seq, layer=layer, payload_offset=offset, payload_len=length
        )
        if not self.shm.ask.put(ticket, self.timeout_s):
            self.shm.ask_meta.release(offset, length)
            raise RemoteDown("the CPU daemon's EXPERT_RUN ring stayed full")
        return self._seq

    def wait(self, seq: int, jobs: list[tuple[int, Tensor]]) -> list[Tensor]:
        """The outputs of request `seq`, on the CPU in job order; RemoteDown after timeout_s."""
        while True:
            answer = self.shm.answer.get(self.timeout_s)
            if answer is None:
                raise RemoteDown(f"no EXPERT_DONE within {self.timeout_s} s")
            if answer.request_id == seq:
                break
            self.shm.answer_meta.release(answer.payload_offset, answer.payload_len)  # a late one
        data = self.shm.answer_meta.read_bytes(answer.payload_offset, answer.payload_len)
        self.shm.answer_meta.release(answer.payload_offset, answer.payload_len)
        seconds, self.answered_at = _TIMES.unpack_from(data, 0)
        self.cpu_s += seconds
        x0 = jobs[0][1]
        rows = sum(x.shape[0] for _, x in jobs)
        y = _tensor(data, _TIMES.size, rows * x0.shape[1], x0.dtype).view(rows, x0.shape[1])
        return list(torch.split(y, [x.shape[0] for _, x in jobs]))

    def close(self) -> None:
        self.shm.close()


class ExpertLinkWorker(LinkWorker[list[ExpertStore]]):
    """CPU daemon side: a thread that answers EXPERT_RUN with the experts of the shared
    arena, computed here (expert_store.ExpertStore.run_cpu)."""

    ask, answer = "x2c", "c2x"

    def _open(self) -> list[ExpertStore]:
        return ExpertArena.attach(self.instance)

    def _answer(self, shm: LinkShm, stores: list[ExpertStore], ticket: Ticket) -> None:
        data = shm.ask_meta.read_bytes(ticket.payload_offset, ticket.payload_len)
        shm.ask_meta.release(ticket.payload_offset, ticket.payload_len)
        layer, jobs = decode_request(data)
        start = time.perf_counter()
        with torch.inference_mode():
            ys = [stores[layer].run_cpu(expert, x) for expert, x in jobs]
        outputs = b"".join(_raw(y) for y in ys)
        reply = _TIMES.pack(time.perf_counter() - start, time.monotonic()) + outputs
        offset, length = shm.answer_meta.write(reply)
        answer = Ticket(
            Op.EXPERT_DONE, ticket.request_id, payload_offset=offset, payload_len=length
        )
        if not shm.answer.put(answer, 5.0):  # the GPU daemon stopped reading: it is going away
            log.warning("expert_answer_dropped", request=ticket.request_id)
        self.answered += 1
        if self.answered == 1:
            log.info("expert_worker_serving", first_request=ticket.request_id)
