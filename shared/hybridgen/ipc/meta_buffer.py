"""Meta-Buffer: an SPSC byte arena in shared memory for small per-step ticket payloads.

The producer copies a payload (token ids, sampling parameters, ...) into the arena and
sends a ticket carrying (payload_offset, payload_len); the consumer reads it in place and
releases it, in the same FIFO order the tickets arrive. Segment
``/hybridgen-<instance>-<name>``::

    offset  size      written by  field
    ------  --------  ----------  ----------------------------------------------------
         0         8  owner       magic b"HGMETA01" (written last by create)
         8         4  owner       layout version (META_VERSION)
        16         8  owner       capacity in bytes (multiple of ALIGN)
        24         8  owner       epoch (time.time_ns() at create)
        32         4  owner       owner pid
        64         8  producer    head: bytes ever allocated, wrap skips included
       128         8  consumer    tail: bytes ever released
       256  capacity  both        data

       data:  |....released....|##### live payloads #####|....free....|
                               ^ tail % capacity          ^ head % capacity

Invariants:

* Only the producer writes head and payload bytes in [head, tail + capacity); only the
  consumer writes tail. One writer per word: no lock. Both are aligned u64 words read and
  written with single 8-byte loads/stores (a 'Q' memoryview), never torn or zero-filled.
* Allocations are ALIGN-aligned and never split across the end of the data area: if a
  payload does not fit before the end, the rest of the lap is skipped and it starts at
  offset 0. A release frees its payload and every older one still live (a wrap skip, or
  the payload of a ticket the consumer found corrupt and dropped), so a lost ticket never
  blocks the arena; a span that is not live (released already, or never written) is
  refused with ValueError and changes nothing.
* A payload may be at most capacity // 2 bytes, which guarantees it fits in an empty arena
  wherever the head stands.
* Payloads become visible to the consumer through the ticket ring, whose semaphore post is
  a barrier. The producer reads tail without a barrier; a stale tail only under-reports
  free space. This relies on x86-64 store ordering (the consumer's tail store cannot
  pass its earlier payload loads); weaker memory models would need a fence in `release`.

Views returned by `read` / `read_array` / `alloc_array` point into the mapping, so they
must be dropped before `close()` (which otherwise raises BufferError).
"""

from __future__ import annotations

import mmap
import os
import struct
import time

import numpy as np
import numpy.typing as npt

from hybridgen.ipc import shm

MAGIC = b"HGMETA01"
META_VERSION = 1
HEADER_SIZE = 256
ALIGN = 8
MIN_CAPACITY, MAX_CAPACITY = 4096, 1 << 31  # offsets travel as u32 in tickets

_FIXED = struct.Struct("<8sIIQQI")  # magic, version, pad, capacity, epoch, owner pid
# head / tail are read and written through a memoryview cast to 'Q' (one 8-byte load or
# store). struct.pack_into would zero-fill first, letting the peer read a transient 0.
_HEAD_W, _TAIL_W = 64 // 8, 128 // 8


class ArenaFull(Exception):
    """The consumer has not released enough space yet (backpressure, not an error)."""


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) & ~(ALIGN - 1)


class MetaBuffer:
    """Shared byte arena; the producer writes/allocates, the consumer reads/releases."""

    def __init__(self, mm: mmap.mmap, instance: str, name: str) -> None:
        """Wrap an initialised mapping; use `create` / `attach` instead of calling this."""
        self._mm = mm
        self.instance, self.name = instance, name
        seg = shm.segment_name(instance, name)
        magic, version, _, capacity, epoch, _ = _FIXED.unpack_from(mm)
        if magic != MAGIC:
            raise ValueError(f"{seg}: magic {magic!r} is not {MAGIC!r} (not a Meta-Buffer)")
        if version != META_VERSION:
            raise ValueError(f"{seg}: layout version {version}, this code speaks {META_VERSION}")
        if len(mm) < HEADER_SIZE + capacity:
            raise ValueError(f"{seg}: capacity {capacity} exceeds segment size {len(mm)}")
        self.capacity: int = capacity
        self.epoch: int = epoch
        self.max_payload: int = capacity // 2
        self._words = memoryview(mm)[:HEADER_SIZE].cast("Q")

    @classmethod
    def create(cls, instance: str, name: str, capacity: int) -> MetaBuffer:
        """Owner side: replace any stale arena of this name and create an empty one."""
        if not MIN_CAPACITY <= capacity <= MAX_CAPACITY or capacity % ALIGN:
            raise ValueError(
                f"capacity must be a multiple of {ALIGN} in [{MIN_CAPACITY}, {MAX_CAPACITY}] "
                f"bytes, got {capacity}"
            )
        mm = shm.create_segment(shm.segment_name(instance, name), HEADER_SIZE + capacity)
        _FIXED.pack_into(mm, 0, b"\0" * 8, META_VERSION, 0, capacity, time.time_ns(), os.getpid())
        mm[0:8] = MAGIC  # last: an attacher that sees the magic sees a complete header
        return cls(mm, instance, name)

    @classmethod
    def attach(cls, instance: str, name: str, wait: float = 0.0) -> MetaBuffer:
        """Peer side: map an existing arena, retrying up to `wait` seconds until ready."""
        shm.segment_name(instance, name)  # a bad name is not worth retrying
        deadline = time.monotonic() + wait
        while True:
            try:
                mm = shm.attach_segment(shm.segment_name(instance, name))
                try:
                    return cls(mm, instance, name)
                except ValueError:
                    mm.close()
                    raise
            except (FileNotFoundError, ValueError):
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.01)

    # ---- producer side -------------------------------------------------------------------

    def _allocate(self, length: int) -> int | None:
        """Reserve `length` bytes; the data offset, or None when the consumer lags."""
        if not 0 <= length <= self.max_payload:
            raise ValueError(
                f"payload length must be in [0, {self.max_payload}] bytes "
                f"(capacity // 2), got {length}"
            )
        head = self._words[_HEAD_W]
        tail = self._words[_TAIL_W]
        need = _aligned(length)
        pos = head % self.capacity
        skip = 0 if pos + need <= self.capacity else self.capacity - pos
        if skip + need > self.capacity - (head - tail):
            return None
        self._words[_HEAD_W] = head + skip + need
        return 0 if skip else pos

    def try_write(self, data: bytes | bytearray | memoryview) -> tuple[int, int] | None:
        """Copy `data` in; (offset, length) for the ticket, or None when full."""
        view = memoryview(data).cast("B")
        length = len(view)
        if length == 0:
            return (0, 0)  # nothing allocated; release(0, 0) is a no-op
        offset = self._allocate(length)
        if offset is None:
            return None
        start = HEADER_SIZE + offset
        self._mm[start : start + length] = view
        return (offset, length)

    def write(self, data: bytes | bytearray | memoryview) -> tuple[int, int]:
        """Like `try_write` but raises ArenaFull instead of returning None."""
        placed = self.try_write(data)
        if placed is None:
            raise ArenaFull(self._full_message(len(memoryview(data).cast("B"))))
        return placed

    def _full_message(self, length: int) -> str:
        return (
            f"{shm.segment_name(self.instance, self.name)}: no room for {length} bytes, "
            f"{self.used()} of {self.capacity} in use"
        )

    def write_array(self, array: npt.NDArray[np.generic]) -> tuple[int, int]:
        """Copy a numpy array's bytes in (one copy; C order); raises ArenaFull when full."""
        if array.dtype.hasobject:
            raise TypeError(f"only plain numeric arrays can be shared, got dtype {array.dtype}")
        return self.write(np.ascontiguousarray(array).data.cast("B"))

    def alloc_array(
        self, count: int, dtype: npt.DTypeLike
    ) -> tuple[int, int, npt.NDArray[np.generic]]:
        """Reserve room for `count` elements; fill the returned view in place (zero copy)."""
        dt = np.dtype(dtype)
        if count < 0:
            raise ValueError(f"count must be >= 0, got {count}")
        length = count * dt.itemsize
        if length == 0:
            return (0, 0, np.empty(0, dtype=dt))
        offset = self._allocate(length)
        if offset is None:
            raise ArenaFull(self._full_message(length))
        view = np.frombuffer(self._mm, dtype=dt, count=count, offset=HEADER_SIZE + offset)
        return (offset, length, view)

    # ---- consumer side -------------------------------------------------------------------

    def _check_span(self, offset: int, length: int) -> None:
        if offset < 0 or length < 0 or offset + length > self.capacity:
            raise ValueError(
                f"payload span [{offset}, {offset + length}) is outside the arena "
                f"[0, {self.capacity})"
            )

    def read(self, offset: int, length: int) -> memoryview:
        """A zero-copy view of a payload (drop it before close, and before release)."""
        self._check_span(offset, length)
        start = HEADER_SIZE + offset
        return memoryview(self._mm)[start : start + length]

    def read_bytes(self, offset: int, length: int) -> bytes:
        """A private copy of a payload (safe to keep after release)."""
        self._check_span(offset, length)
        start = HEADER_SIZE + offset
        return self._mm[start : start + length]

    def read_array(self, offset: int, length: int, dtype: npt.DTypeLike) -> npt.NDArray[np.generic]:
        """A zero-copy 1-D numpy view of a payload; valid until the payload is released."""
        self._check_span(offset, length)
        dt = np.dtype(dtype)
        if length % dt.itemsize:
            raise ValueError(
                f"payload length {length} is not a multiple of {dt} size {dt.itemsize}"
            )
        if length == 0:
            return np.empty(0, dtype=dt)
        return np.frombuffer(
            self._mm, dtype=dt, count=length // dt.itemsize, offset=HEADER_SIZE + offset
        )

    def release(self, offset: int, length: int) -> None:
        """Free the payload at [offset, offset + length) and every older one still live;
        ValueError (nothing freed) when that span is not a live payload."""
        if length == 0:
            return
        self._check_span(offset, length)
        tail = self._words[_TAIL_W]
        head = self._words[_HEAD_W]
        pos = tail % self.capacity
        # The one place at or after the tail where a payload at `offset` can start: later
        # in this lap, or in the next one (after a wrap skip); any other lies beyond head.
        start = tail + (offset - pos if offset >= pos else self.capacity - pos + offset)
        end = start + _aligned(length)
        if end > head:
            raise ValueError(
                f"release of [{offset}, {offset + length}) is not a live payload "
                f"({head - tail} bytes live from offset {pos})"
            )
        self._words[_TAIL_W] = end

    # ---- both sides ----------------------------------------------------------------------

    def used(self) -> int:
        """Bytes allocated and not yet released (wrap skips included)."""
        tail = self._words[_TAIL_W]  # tail first: head only grows, so the result is >= 0
        return int(self._words[_HEAD_W] - tail)

    def close(self) -> None:
        """Unmap (this process only); raises BufferError while views from it are alive."""
        if self._mm.closed:
            return
        self._words.release()
        try:
            self._mm.close()
        except BufferError as exc:
            self._words = memoryview(self._mm)[:HEADER_SIZE].cast("Q")  # still usable
            raise BufferError(
                f"{shm.segment_name(self.instance, self.name)}: views from read()/read_array()/"
                "alloc_array() are still alive; drop them before close()"
            ) from exc

    def unlink(self) -> None:
        """Owner: remove the segment from the system (existing mappings stay valid)."""
        shm.unlink_segment(shm.segment_name(self.instance, self.name))

    def __enter__(self) -> MetaBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
