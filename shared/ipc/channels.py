"""The four shared-memory objects between the daemons, and sending a ticket with a payload.

    c2g ring + c2g_meta arena:  CPU daemon -> GPU daemon (NEW_SEQ, ABORT, SHUTDOWN)
    g2c ring + g2c_meta arena:  GPU daemon -> CPU daemon (STEP_RESULT, BACKPRESSURE)

The GPU daemon creates them (replacing stale ones from a crashed run); the CPU daemon
attaches. Each arena's payloads are released by its consumer in ticket order.
"""

from __future__ import annotations

import time
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


def take_payload(meta: MetaBuffer, ticket: Ticket) -> bytes:
    """Copy a ticket's payload out and release it (tickets arrive in arena order)."""
    data = meta.read_bytes(ticket.payload_offset, ticket.payload_len)
    meta.release(ticket.payload_offset, ticket.payload_len)
    return data
