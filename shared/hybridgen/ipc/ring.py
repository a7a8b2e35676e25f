"""Single-producer single-consumer ticket ring in POSIX shared memory.

The daemons talk over two rings per instance, ``c2g`` (CPU -> GPU) and ``g2c`` (GPU -> CPU).
Segment ``/hybridgen-<instance>-<name>``, semaphores ``<segment>.items`` / ``<segment>.spaces``::

    offset  size  written by  field
    ------  ----  ----------  --------------------------------------------------------
         0     8  owner       magic b"HGRING01" (written last by create: "initialised")
         8     4  owner       layout version (RING_VERSION)
        12     4  owner       capacity (slots, a power of two)
        16     4  owner       slot size (SLOT_SIZE)
        20     4  owner       ticket size (TICKET_SIZE)
        24     8  owner       epoch (time.time_ns() at create; new on every create)
        32     4  owner       owner pid
        64     8  producer    head: tickets ever committed (monotonic, never wraps)
        72     8  producer    producer pid
        80     8  producer    heartbeat counter
       128     8  consumer    tail: tickets ever consumed (monotonic)
       136     8  consumer    consumer pid
       256        slots[capacity], SLOT_SIZE = 128 bytes each:

          +------------+---------------------------+--------------+
          | stamp  u64 | ticket (TICKET_SIZE = 64) | pad (56)     |
          +------------+---------------------------+--------------+
          0            8                           72             128

       position p (0-based, monotonic) lives in slot p & (capacity - 1) and carries
       seq = p + 1 both in its stamp and in the ticket, so a zero stamp means "never written".

       slots:  [ 0 ][ 1 ][ 2 ][ 3 ][ 4 ][ 5 ][ 6 ][ 7 ]      capacity 8
                          ^ tail & 7          ^ head & 7
                          |<-- head - tail -->|             committed, unconsumed
                          consumer reads here  producer writes here

Invariants:

* Only the producer writes head, the producer pid and the heartbeat; only the consumer
  writes tail and the consumer pid. Each word has one writer, so SPSC needs no lock.
  head and tail sit on different cache lines so the two sides do not false-share.
* ``spaces`` counts free slots and ``items`` counts committed, unconsumed tickets;
  items + spaces == capacity except while one side is between its two semaphore calls.
  The producer takes a space before writing a slot and posts an item after committing it;
  the consumer takes an item before reading and posts a space after copying the slot
  out. The semaphores are counters for wake-up and backpressure, never mutexes.
* Commit order: ticket body, then the stamp, then head, then ``items`` post. The post is a
  full barrier, and x86-64 keeps stores in order, so a consumer that took an item sees a
  complete slot. A slot is still validated (stamp == ticket.seq == p + 1 and the ticket's
  CRC) so memory corruption or a foreign writer is detected: the slot is counted in
  ``stats.corrupt``, logged, skipped, and the ring keeps working.
* Every word that the other side may read concurrently (head, tail, pids, heartbeat,
  stamps) is an aligned u64 written and read through a memoryview cast to 'Q', which is
  one 8-byte load/store. struct.pack_into is not used for them: it zero-fills its target
  before writing, so a concurrent reader could see 0 (a "reset" heartbeat).
* A full ring is backpressure: `try_put` returns False at once and `put` waits at most its
  timeout; nothing is ever dropped or overwritten.
* A slot that fails validation is skipped, and its seq is kept for `take_lost`, so the
  consumer can tell the producer which ticket was lost (channels.py: CORRUPT).

A Ring object is for one thread: head/tail are cached in it without locking. A process
that both produces and consumes on one ring (tests) may use one object for both roles.

A producer that dies between taking a space and posting an item leaks one slot; the owner
re-creates the ring (create unlinks the stale segment and semaphores) when it restarts.
"""

from __future__ import annotations

import collections
import mmap
import os
import struct
import time
from dataclasses import dataclass

import posix_ipc
import structlog

from hybridgen.ipc import shm
from hybridgen.ipc.ticket import TICKET_SIZE, CorruptTicket, Ticket

MAGIC = b"HGRING01"
RING_VERSION = 2
HEADER_SIZE = 256
SLOT_SIZE = 128
SLOT_STAMP_OFFSET = 0
SLOT_TICKET_OFFSET = 8
MAX_CAPACITY = 1 << 20

# Indices of the shared u64 words (byte offset // 8), see the table above.
_HEAD_W, _PRODUCER_PID_W, _HEARTBEAT_W = 64 // 8, 72 // 8, 80 // 8
_TAIL_W, _CONSUMER_PID_W = 128 // 8, 136 // 8
_FIXED = struct.Struct("<8sIIIIQI")  # magic .. owner pid, at offset 0; written once by create
# Log the first few corrupt slots in full, then only every _LOG_EVERY-th, so a garbage
# ring cannot flood the log at ring speed; stats.corrupt always has the exact count.
_LOG_FIRST, _LOG_EVERY = 16, 1024

_log = structlog.get_logger()


@dataclass(frozen=True, slots=True)
class RingStats:
    """Counters of one Ring object (this process's side only)."""

    put: int
    """Tickets committed by this producer."""
    got: int
    """Valid tickets delivered to this consumer."""
    full: int
    """Puts refused because the ring was full (backpressure events)."""
    corrupt: int
    """Slots that failed validation and were skipped."""


class Ring:
    """One direction of ticket traffic; use `create` in the owner and `attach` in the peer."""

    def __init__(
        self,
        mm: mmap.mmap,
        items: posix_ipc.Semaphore,
        spaces: posix_ipc.Semaphore,
        instance: str,
        name: str,
    ) -> None:
        """Wrap an initialised mapping; use `create` / `attach` instead of calling this."""
        self._mm = mm
        self._items, self._spaces = items, spaces
        self.instance, self.name = instance, name
        magic, version, capacity, slot_size, ticket_size, epoch, _ = _FIXED.unpack_from(mm)
        self._check_header(magic, version, capacity, slot_size, ticket_size, len(mm))
        self.capacity: int = capacity
        self.epoch: int = epoch
        self._mask = capacity - 1
        # Atomic u64 access (see module docstring); the mapping may be page-rounded.
        self._view = memoryview(mm)[: HEADER_SIZE + capacity * SLOT_SIZE]
        self._words = self._view.cast("Q")
        self._pid = os.getpid()
        self._head: int | None = None  # cached once this object acts as producer
        self._tail: int | None = None  # cached once this object acts as consumer
        self._put = self._got = self._full = self._corrupt = 0
        self._lost: collections.deque[int] = collections.deque(maxlen=capacity)

    def _check_header(
        self, magic: bytes, version: int, capacity: int, slot: int, ticket: int, size: int
    ) -> None:
        seg = shm.segment_name(self.instance, self.name)
        if magic != MAGIC:
            raise ValueError(f"{seg}: magic {magic!r} is not {MAGIC!r} (not a ring, or not ready)")
        if version != RING_VERSION:
            raise ValueError(f"{seg}: layout version {version}, this code speaks {RING_VERSION}")
        if (slot, ticket) != (SLOT_SIZE, TICKET_SIZE):
            raise ValueError(
                f"{seg}: slot/ticket size {slot}/{ticket}, expected {SLOT_SIZE}/{TICKET_SIZE}"
            )
        if capacity < 2 or capacity & (capacity - 1) or size < HEADER_SIZE + capacity * SLOT_SIZE:
            raise ValueError(f"{seg}: capacity {capacity} does not match segment size {size}")

    @classmethod
    def create(cls, instance: str, name: str, capacity: int) -> Ring:
        """Owner side: replace any stale ring of this name and create an empty one."""
        if not 2 <= capacity <= MAX_CAPACITY or capacity & (capacity - 1):
            raise ValueError(
                f"capacity must be a power of two in [2, {MAX_CAPACITY}], got {capacity}"
            )
        seg = shm.segment_name(instance, name)
        # Unlink the stale segment before replacing the semaphores, so a peer attaching
        # meanwhile finds no segment (and retries) rather than old memory with new semaphores.
        shm.unlink_segment(seg)
        items = shm.create_semaphore(shm.semaphore_name(instance, name, "items"), 0)
        spaces = shm.create_semaphore(shm.semaphore_name(instance, name, "spaces"), capacity)
        mm = shm.create_segment(seg, HEADER_SIZE + capacity * SLOT_SIZE)
        fixed = (RING_VERSION, capacity, SLOT_SIZE, TICKET_SIZE, time.time_ns(), os.getpid())
        _FIXED.pack_into(mm, 0, b"\0" * 8, *fixed)
        mm[0:8] = MAGIC  # last: an attacher that sees the magic sees a complete header
        return cls(mm, items, spaces, instance, name)

    @classmethod
    def attach(cls, instance: str, name: str, wait: float = 0.0) -> Ring:
        """Peer side: map an existing ring, retrying up to `wait` seconds until it is ready."""
        shm.segment_name(instance, name)  # a bad name is not worth retrying
        deadline = time.monotonic() + wait
        while True:
            try:
                return cls._attach_once(instance, name)
            except (FileNotFoundError, ValueError):
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.01)

    @classmethod
    def _attach_once(cls, instance: str, name: str) -> Ring:
        mm = shm.attach_segment(shm.segment_name(instance, name))
        opened: list[posix_ipc.Semaphore] = []
        try:
            if mm[0:8] != MAGIC:
                raise ValueError(
                    f"{shm.segment_name(instance, name)}: not initialised (magic {mm[0:8]!r})"
                )
            for role in ("items", "spaces"):
                opened.append(shm.attach_semaphore(shm.semaphore_name(instance, name, role)))
            return cls(mm, opened[0], opened[1], instance, name)
        except BaseException:
            for sem in opened:
                sem.close()
            mm.close()
            raise

    @classmethod
    def owner(cls, instance: str, name: str) -> tuple[int, int] | None:
        """(owner pid, epoch in time_ns) of an existing ring; None when there is none."""
        try:
            mm = shm.attach_segment(shm.segment_name(instance, name))
        except (FileNotFoundError, ValueError):
            return None
        try:
            if len(mm) < _FIXED.size:
                return None
            magic, _, _, _, _, epoch, pid = _FIXED.unpack_from(mm)
        finally:
            mm.close()
        return (int(pid), int(epoch)) if magic == MAGIC else None

    # ---- producer side -------------------------------------------------------------------

    def _claim_producer(self) -> int:
        # Resume from the shared head so a restarted producer continues the sequence.
        head = self._words[_HEAD_W]
        self._words[_PRODUCER_PID_W] = self._pid
        self._head = head
        return int(head)

    def next_seq(self) -> int:
        """Producer: the seq the next committed ticket will carry."""
        head = self._head if self._head is not None else self._words[_HEAD_W]
        return int(head) + 1

    def try_put(self, ticket: Ticket) -> bool:
        """Commit `ticket` if a slot is free; False (backpressure) when full. Never blocks."""
        try:
            self._spaces.acquire(0)
        except posix_ipc.BusyError:
            self._full += 1
            return False
        self._commit(ticket)
        return True

    def put(self, ticket: Ticket, timeout: float) -> bool:
        """Commit `ticket`, waiting up to `timeout` seconds for a free slot; False if none.

        A signal that interrupts the wait also returns False (after Python ran its handler),
        so a shutdown flag set by the handler is seen by the caller's retry loop.
        """
        if timeout < 0:
            raise ValueError(f"timeout must be >= 0 seconds, got {timeout}")
        try:
            self._spaces.acquire(timeout)
        except (posix_ipc.BusyError, posix_ipc.SignalError):
            self._full += 1
            return False
        self._commit(ticket)
        return True

    def _commit(self, ticket: Ticket) -> None:
        # Called holding one `spaces` count, so slot head & mask is free.
        head = self._head if self._head is not None else self._claim_producer()
        off = HEADER_SIZE + (head & self._mask) * SLOT_SIZE
        try:
            # Straight into the slot: the consumer reads it only after the stamp and the post.
            ticket.pack_into(self._view, off + SLOT_TICKET_OFFSET, seq=head + 1)
        except ValueError:
            self._spaces.release()  # give the space back: the slot was not committed
            raise
        self._words[(off + SLOT_STAMP_OFFSET) >> 3] = head + 1  # commit stamp, after the body
        self._head = head + 1
        self._words[_HEAD_W] = head + 1
        self._put += 1
        self._items.release()

    def heartbeat(self) -> int:
        """Producer: bump the shared heartbeat counter (and claim the producer pid)."""
        if self._head is None:
            self._claim_producer()
        beat = (self._words[_HEARTBEAT_W] + 1) & (2**64 - 1)
        self._words[_HEARTBEAT_W] = beat
        return int(beat)

    def release_producer(self) -> None:
        """Producer: detach cleanly; the consumer then sees no peer (pid 0) instead of a
        dead one, and a later producer resumes from the shared head."""
        if self._head is not None and self._words[_PRODUCER_PID_W] == self._pid:
            self._words[_PRODUCER_PID_W] = 0
        self._head = None

    # ---- consumer side -------------------------------------------------------------------

    def get(self, timeout: float) -> Ticket | None:
        """Next valid ticket, waiting up to `timeout` seconds; None on timeout.

        Corrupt slots are skipped (and counted) within the same deadline. A signal that
        interrupts the wait returns None early, like a timeout.
        """
        if timeout < 0:
            raise ValueError(f"timeout must be >= 0 seconds, got {timeout}")
        deadline = time.monotonic() + timeout
        while True:
            try:
                self._items.acquire(timeout)
            except (posix_ipc.BusyError, posix_ipc.SignalError):
                return None
            ticket = self._take()
            if ticket is not None:
                return ticket
            timeout = max(0.0, deadline - time.monotonic())

    def drain(self, max_items: int) -> list[Ticket]:
        """Up to `max_items` ready slots without blocking; corrupt ones count but are dropped."""
        if max_items < 0:
            raise ValueError(f"max_items must be >= 0, got {max_items}")
        out: list[Ticket] = []
        for _ in range(max_items):
            try:
                self._items.acquire(0)
            except posix_ipc.BusyError:
                break
            ticket = self._take()
            if ticket is not None:
                out.append(ticket)
        return out

    def _take(self) -> Ticket | None:
        # Called holding one `items` count: slot tail & mask was committed by the producer,
        # and it stays ours until the `spaces` post below, so it is parsed in place.
        tail = self._tail
        if tail is None:
            tail = self._words[_TAIL_W]
            self._words[_CONSUMER_PID_W] = self._pid
        off = HEADER_SIZE + (tail & self._mask) * SLOT_SIZE
        stamp = int(self._words[(off + SLOT_STAMP_OFFSET) >> 3])
        ticket: Ticket | None = None
        reason = ""
        try:
            ticket = Ticket.unpack_from(self._view, off + SLOT_TICKET_OFFSET)
        except CorruptTicket as exc:
            reason = str(exc)
        self._tail = tail + 1
        self._words[_TAIL_W] = tail + 1
        self._spaces.release()
        if ticket is None:
            self._report(tail, stamp, reason)
            return None
        if stamp != tail + 1 or ticket.seq != tail + 1:
            self._report(tail, stamp, f"torn slot: stamp {stamp}, ticket seq {ticket.seq}")
            return None
        self._got += 1
        return ticket

    def _report(self, position: int, stamp: int, reason: str) -> None:
        self._corrupt += 1
        self._lost.append(position + 1)
        n = self._corrupt
        if n <= _LOG_FIRST or n % _LOG_EVERY == 0:
            _log.warning(
                "ipc_ring_corrupt_slot",
                ring=shm.segment_name(self.instance, self.name),
                position=position,
                expected_seq=position + 1,
                stamp=stamp,
                reason=reason,
                corrupt_total=n,
            )

    def take_lost(self) -> list[int]:
        """Consumer: the seqs of slots skipped as corrupt since the last call (the last
        `capacity` of them, oldest first)."""
        lost = list(self._lost)
        self._lost.clear()
        return lost

    # ---- both sides ----------------------------------------------------------------------

    def still_current(self) -> bool:
        """False once the owner re-created (or removed) the ring: the peer should re-attach.

        Costs a shm_open and an mmap, so call it from a supervisor loop, not per ticket.
        """
        try:
            mm = shm.attach_segment(shm.segment_name(self.instance, self.name))
        except (FileNotFoundError, ValueError):
            return False
        try:
            fixed = _FIXED.unpack_from(mm)
        finally:
            mm.close()
        return bool(fixed[0] == MAGIC and fixed[5] == self.epoch)

    def peer_heartbeat(self) -> int:
        """The producer's heartbeat counter (read it periodically; stuck means stalled)."""
        return int(self._words[_HEARTBEAT_W])

    def producer_pid(self) -> int:
        """Pid of the last process that produced or heartbeat on this ring; 0 if none yet."""
        return int(self._words[_PRODUCER_PID_W])

    def consumer_pid(self) -> int:
        """Pid of the last process that consumed from this ring; 0 if none yet."""
        return int(self._words[_CONSUMER_PID_W])

    def occupancy(self) -> int:
        """Committed tickets not yet consumed (head - tail), as seen now."""
        tail = self._words[_TAIL_W]  # tail first: head only grows, so the result is >= 0
        return int(self._words[_HEAD_W] - tail)

    @property
    def stats(self) -> RingStats:
        """A snapshot of this object's counters."""
        return RingStats(put=self._put, got=self._got, full=self._full, corrupt=self._corrupt)

    def close(self) -> None:
        """Unmap and close the semaphores (this process only); idempotent."""
        if not self._mm.closed:
            self._words.release()
            self._view.release()
            self._mm.close()
            self._items.close()
            self._spaces.close()

    def unlink(self) -> None:
        """Owner: remove the segment and semaphores from the system (mappings stay valid)."""
        shm.unlink_segment(shm.segment_name(self.instance, self.name))
        for role in ("items", "spaces"):
            shm.unlink_semaphore(shm.semaphore_name(self.instance, self.name, role))

    def __enter__(self) -> Ring:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
