"""The four shared-memory objects between the daemons, and sending a ticket with a payload.

    c2g ring + c2g_meta arena:  CPU daemon -> GPU daemon (NEW_SEQ, ABORT, SHUTDOWN)
    g2c ring + g2c_meta arena:  GPU daemon -> CPU daemon (STEP_RESULT, BACKPRESSURE)

The GPU daemon creates them (replacing stale ones from a crashed run); the CPU daemon
attaches. Each arena's payloads are released by its consumer in ticket order.

Nothing read from shared memory is trusted: a ticket carries the CRC of its payload, and
`take_payload` checks the span and the bytes. A consumer that finds a ticket bad (the ring
drops a torn or CRC-failing slot and names its seq in `Ring.take_lost`; a bad payload raises
CorruptPayload) answers CORRUPT with that seq on its own outbox, and the producer, which
remembers what it put at each seq (`Outbox.sent_at`), fails that ticket's request with
DATA_LOSS or sends a payload-free command again.
"""

from __future__ import annotations

import os
import time
import zlib
from collections import OrderedDict, deque
from dataclasses import dataclass

from hybridgen.ipc import shm
from hybridgen.ipc.meta_buffer import MetaBuffer
from hybridgen.ipc.peer import pid_alive, started_before
from hybridgen.ipc.ring import Ring
from hybridgen.ipc.ticket import CorruptPayload, Op, Ticket


class InstanceInUse(RuntimeError):
    """Another running process owns this instance's shared memory."""


def live_owner(instance: str) -> int | None:
    """Pid of the running process that created `instance`'s rings; None when there are none
    or their creator is gone (they are stale, safe to replace)."""
    found = Ring.owner(instance, "c2g")
    if found is None:
        return None
    pid, epoch_ns = found
    if pid == os.getpid() or not pid_alive(pid) or not started_before(pid, epoch_ns):
        return None
    return pid


@dataclass
class Channels:
    c2g: Ring
    g2c: Ring
    c2g_meta: MetaBuffer
    g2c_meta: MetaBuffer

    @classmethod
    def create(cls, instance: str, capacity: int = 1024, meta_bytes: int = 16 << 20) -> Channels:
        """Replace the instance's stale shared memory with new rings; InstanceInUse when its
        creator still runs (two GPU daemons of one instance would tear each other's rings)."""
        owner = live_owner(instance)
        if owner is not None:
            raise InstanceInUse(
                f"instance {instance!r}: its shared memory belongs to the running process "
                f"{owner}; stop that process, or serve another instance"
            )
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
        payload_crc=zlib.crc32(payload),
        timestamp_ns=time.monotonic_ns(),
    )


Message = tuple[Op, int, bytes, int, tuple[int, int, int, int]]
"""(op, request id, payload, flags, shape) of a ticket still to be sent."""


Sent = tuple[Op, int, int, tuple[int, int, int, int], bool]
"""(op, request id, flags, shape, had a payload) of a ticket an Outbox put on its ring."""


class Outbox:
    """Messages for one ring, sent strictly in order.

    Invariant: the arena is FIFO, so a message's payload is placed only when that message is
    next in line, and a placed ticket is retried until the ring takes it. A full ring or arena
    keeps messages here: that is backpressure, and nothing is ever dropped. What went out at
    each of the last 2 x capacity seqs is remembered (without payloads), for a CORRUPT answer.
    """

    def __init__(self, ring: Ring, meta: MetaBuffer) -> None:
        self.ring, self.meta = ring, meta
        self.queue: deque[Message] = deque()
        self.sent = 0
        self._placed: Ticket | None = None  # the head message, its payload in the arena
        self._history: OrderedDict[int, Sent] = OrderedDict()

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
            seq = self.ring.next_seq()
            if not self.ring.try_put(self._placed):
                return "ring full"
            self._remember(seq, self._placed)
            self._placed = None
            self.queue.popleft()
            self.sent += 1
        return None

    def _remember(self, seq: int, ticket: Ticket) -> None:
        t = ticket
        self._history[seq] = (t.op, t.request_id, t.flags, t.shape, t.payload_len > 0)
        if len(self._history) > 2 * self.ring.capacity:
            self._history.popitem(last=False)

    def sent_at(self, seq: int) -> Sent | None:
        """What this outbox put on its ring at `seq`; None when unknown or forgotten."""
        return self._history.get(seq)


def take_payload(meta: MetaBuffer, ticket: Ticket) -> bytes:
    """Copy a ticket's payload out and release it (with the payload of any older ticket that
    was lost); CorruptPayload when the span is not a live payload or the bytes fail its CRC."""
    try:
        data = meta.read_bytes(ticket.payload_offset, ticket.payload_len)
        meta.release(ticket.payload_offset, ticket.payload_len)
    except ValueError as exc:
        raise CorruptPayload(f"{ticket.op.name} ticket seq {ticket.seq}: {exc}") from exc
    crc = zlib.crc32(data)
    if crc != ticket.payload_crc:
        raise CorruptPayload(
            f"{ticket.op.name} ticket seq {ticket.seq}: payload CRC {crc:#010x} is not the "
            f"ticket's {ticket.payload_crc:#010x}"
        )
    return data
