"""The four shared-memory objects between the daemons, and sending a ticket with a payload.

    c2g ring + c2g_meta arena:  CPU daemon -> GPU daemon (NEW_SEQ, ABORT, SHUTDOWN)
    g2c ring + g2c_meta arena:  GPU daemon -> CPU daemon (STEP_RESULT, BACKPRESSURE)

The GPU daemon creates them (replacing stale ones from a crashed run); the CPU daemon
attaches. Each arena's payloads are released by its consumer in ticket order.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from hybridgen.ipc import shm
from hybridgen.ipc.meta_buffer import MetaBuffer
from hybridgen.ipc.ring import Ring
from hybridgen.ipc.ticket import Op, Ticket


@dataclass
class Channels:
    c2g: Ring
    g2c: Ring
    c2g_meta: MetaBuffer
    g2c_meta: MetaBuffer

    @classmethod
    def create(cls, instance: str, capacity: int = 1024, meta_bytes: int = 16 << 20) -> Channels:
        shm.unlink_all(instance)
        return cls(
            Ring.create(instance, "c2g", capacity),
            Ring.create(instance, "g2c", capacity),
            MetaBuffer.create(instance, "c2g_meta", meta_bytes),
            MetaBuffer.create(instance, "g2c_meta", meta_bytes),
        )

    @classmethod
    def attach(cls, instance: str, wait: float = 0.0) -> Channels:
        return cls(
            Ring.attach(instance, "c2g", wait),
            Ring.attach(instance, "g2c", wait),
            MetaBuffer.attach(instance, "c2g_meta", wait),
            MetaBuffer.attach(instance, "g2c_meta", wait),
        )

    def close(self) -> None:
        for obj in (self.c2g, self.g2c, self.c2g_meta, self.g2c_meta):
            obj.close()


def make_ticket(
    meta: MetaBuffer,
    op: Op,
    request_id: int,
    payload: bytes = b"",
    flags: int = 0,
    shape: tuple[int, int, int, int] = (0, 0, 0, 0),
) -> Ticket | None:
    """Place `payload` in the arena and describe it in a ticket; None when the arena is full
    (backpressure: the caller keeps the message and retries, nothing is dropped)."""
    placed = meta.try_write(payload)
    if placed is None:
        return None
    offset, length = placed
    return Ticket(
        op,
        request_id=request_id,
        flags=flags,
        shape=shape,
        payload_offset=offset,
        payload_len=length,
        timestamp_ns=time.monotonic_ns(),
    )


Message = tuple[Op, int, bytes, int, tuple[int, int, int, int]]
"""(op, request id, payload, flags, shape) of a ticket still to be sent."""


class Outbox:
    """Messages for one ring, sent strictly in order.

    Invariant: the arena is FIFO, so a message's payload is placed only when that message is
    next in line, and a placed ticket is retried until the ring takes it. A full ring or arena
    keeps messages here: that is backpressure, and nothing is ever dropped.
    """

    def __init__(self, ring: Ring, meta: MetaBuffer) -> None:
        self.ring, self.meta = ring, meta
        self.queue: deque[Message] = deque()
        self.sent = 0
        self._placed: Ticket | None = None  # the head message, its payload in the arena

    def __len__(self) -> int:
        return len(self.queue)

    def append(self, message: Message) -> None:
        self.queue.append(message)

    def flush(self) -> str | None:
        """Send what the ring takes; None when everything went, else what was full."""
        while self.queue:
            if self._placed is None:
                self._placed = make_ticket(self.meta, *self.queue[0])
            if self._placed is None:
                return "arena full"
            if not self.ring.try_put(self._placed):
                return "ring full"
            self._placed = None
            self.queue.popleft()
            self.sent += 1
        return None


def take_payload(meta: MetaBuffer, ticket: Ticket) -> bytes:
    """Copy a ticket's payload out and release it (tickets arrive in arena order)."""
    data = meta.read_bytes(ticket.payload_offset, ticket.payload_len)
    meta.release(ticket.payload_offset, ticket.payload_len)
    return data
