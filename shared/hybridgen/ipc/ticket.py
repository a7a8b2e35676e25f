"""Fixed-size binary tickets exchanged between the GPU and CPU daemons.

A ticket is 64 bytes (one cache line), little-endian, CRC32-protected::

    offset size field           type  range
    ------ ---- --------------- ----- ----------------------------------------
         0    8 seq             u64   0 .. 2**64-1 (the ring rewrites it)
         8    8 timestamp_ns    u64   0 .. 2**64-1 (CLOCK_MONOTONIC, host-wide)
        16    8 request_id      u64   0 .. 2**64-1
        24   16 shape[4]        u32   0 .. 2**32-1 each
        40    4 payload_offset  u32   0 .. 2**32-1 (byte offset in the Meta-Buffer)
        44    4 payload_len     u32   0 .. 2**32-1
        48    4 payload_crc     u32   zlib.crc32 of the payload bytes (0 for none)
        52    2 layer           i16   -1 (none) .. 32767
        54    1 op              u8    an `Op` value
        55    1 dtype           u8    0 .. 255 (a `DType` value by convention)
        56    2 flags           u16   0 .. 65535
        58    2 device          i16   -1 (CPU / none) .. 32767
        60    4 crc             u32   zlib.crc32 of bytes 0..59

`Ticket.unpack` raises `CorruptTicket` (a ValueError) on a wrong length, a CRC mismatch
or an unknown op, and the message says which; it never returns a half-valid ticket. The
ticket's CRC covers the payload's CRC, so a payload read through `channels.take_payload`
is checked end to end; the bulk links (warm attention, experts) leave payload_crc 0.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from enum import IntEnum
from typing import ClassVar


class Op(IntEnum):
    """What a ticket asks for or reports; 0 is never used so a zeroed slot is invalid."""

    NEW_SEQ = 1
    APPEND_TOKENS = 2
    ABORT = 3
    STEP_RESULT = 4
    KV_EVICT = 5
    KV_FETCH = 6
    KV_READY = 7
    ATTN_WARM = 8
    ATTN_WARM_DONE = 9
    EXPERT_RUN = 10
    EXPERT_DONE = 11
    BACKPRESSURE = 12
    STATS = 13
    SHUTDOWN = 14
    HEARTBEAT = 15
    CORRUPT = 16
    """The sender found the ticket of seq `request_id` on the other ring bad (payload: why)."""
    APPEND_PROMPT = 17


class DType(IntEnum):
    """Conventional codes for `Ticket.dtype`; the field itself accepts any u8."""

    NONE = 0
    F32 = 1
    F16 = 2
    BF16 = 3
    I32 = 4
    I64 = 5
    U8 = 6
    FP8_E4M3 = 7


# Body (everything the CRC covers) and the trailing CRC; see the table in the docstring.
_BODY = struct.Struct("<QQQ4IIIIhBBHh")
_CRC = struct.Struct("<I")
_BODY_SIZE = _BODY.size
TICKET_SIZE = _BODY_SIZE + _CRC.size
assert TICKET_SIZE == 64, TICKET_SIZE

# dict lookup is several times faster than Op(value) on the hot unpack path.
_OPS: dict[int, Op] = {int(op): op for op in Op}
_MIN_OP, _MAX_OP = min(_OPS), max(_OPS)  # the codes are contiguous; an int compare is cheap
assert len(_OPS) == _MAX_OP - _MIN_OP + 1

_U64 = (0, 2**64 - 1)
_U32 = (0, 2**32 - 1)
# (field, low, high) in the order `_range_error` reports them.
_RANGES: tuple[tuple[str, int, int], ...] = (
    ("seq", *_U64),
    ("timestamp_ns", *_U64),
    ("request_id", *_U64),
    ("payload_offset", *_U32),
    ("payload_len", *_U32),
    ("payload_crc", *_U32),
    ("layer", -1, 2**15 - 1),
    ("dtype", 0, 255),
    ("flags", 0, 2**16 - 1),
    ("device", -1, 2**15 - 1),
)

# Frozen dataclasses forbid plain assignment; Ticket.__init__ fills __dict__ through object.
_setattr = object.__setattr__
_new = object.__new__


class CorruptTicket(ValueError):
    """Bytes that are not a valid ticket: wrong length, CRC mismatch or unknown op."""


class CorruptPayload(ValueError):
    """A valid ticket whose payload is not: its span is not a live payload of the arena, its
    bytes fail the ticket's payload_crc, or they do not decode as the op's payload."""


@dataclass(frozen=True, init=False)
class Ticket:
    """One message between the daemons; payload bytes live in a Meta-Buffer."""

    op: Op
    """What to do (or what happened)."""
    request_id: int = 0
    """Request the ticket belongs to (u64); 0 when it concerns no request."""
    seq: int = 0
    """Sequence number; the ring overwrites it with its own 1-based counter on put."""
    flags: int = 0
    """Op-specific bit flags (u16)."""
    device: int = -1
    """Target device index (i16); -1 means the CPU / not applicable."""
    dtype: int = 0
    """Element type of the payload (u8, a `DType` by convention)."""
    shape: tuple[int, int, int, int] = (0, 0, 0, 0)
    """Up to four dimensions of the payload or tensor (u32 each); unused ones are 0."""
    layer: int = -1
    """Model layer (i16); -1 means none."""
    payload_offset: int = 0
    """Byte offset of the payload in the Meta-Buffer (u32)."""
    payload_len: int = 0
    """Payload length in bytes (u32); 0 means no payload."""
    payload_crc: int = 0
    """zlib.crc32 of the payload bytes (u32), checked by the consumer's take_payload."""
    timestamp_ns: int = 0
    """Sender's time.monotonic_ns() (u64), for latency accounting."""

    SIZE: ClassVar[int] = TICKET_SIZE

    def __init__(
        self,
        op: Op,
        request_id: int = 0,
        seq: int = 0,
        flags: int = 0,
        device: int = -1,
        dtype: int = 0,
        shape: tuple[int, int, int, int] = (0, 0, 0, 0),
        layer: int = -1,
        payload_offset: int = 0,
        payload_len: int = 0,
        payload_crc: int = 0,
        timestamp_ns: int = 0,
    ) -> None:
        """Same signature as the generated one; filling __dict__ at once is ~4x faster than
        the frozen dataclass __init__ (one object.__setattr__ per field), which matters at
        200k tickets/s. Ranges are checked by `pack`, where it is free."""
        _setattr(
            self,
            "__dict__",
            {
                "op": op,
                "request_id": request_id,
                "seq": seq,
                "flags": flags,
                "device": device,
                "dtype": dtype,
                "shape": shape,
                "layer": layer,
                "payload_offset": payload_offset,
                "payload_len": payload_len,
                "payload_crc": payload_crc,
                "timestamp_ns": timestamp_ns,
            },
        )

    def pack(self, seq: int | None = None) -> bytes:
        """Serialize to exactly TICKET_SIZE bytes; `seq` overrides self.seq."""
        buf = bytearray(TICKET_SIZE)
        self.pack_into(memoryview(buf), 0, seq)
        return bytes(buf)

    def pack_into(self, buf: memoryview, offset: int, seq: int | None = None) -> None:
        """Serialize into buf[offset : offset + TICKET_SIZE] in place (the ring writes its slot
        this way, with no intermediate bytes). On a range error the bytes written so far are
        garbage and a ValueError names the field."""
        try:
            _BODY.pack_into(
                buf,
                offset,
                self.seq if seq is None else seq,
                self.timestamp_ns,
                self.request_id,
                *self.shape,
                self.payload_offset,
                self.payload_len,
                self.payload_crc,
                self.layer,
                self.op,
                self.dtype,
                self.flags,
                self.device,
            )
        except (struct.error, TypeError) as exc:
            # Only the failing (cold) path pays for finding out which field is wrong.
            raise self._range_error(seq) from exc
        # struct accepts the full i16 range; -1 is the only negative these fields allow.
        if not _MIN_OP <= self.op <= _MAX_OP or self.layer < -1 or self.device < -1:
            raise self._range_error(seq)
        body_end = offset + _BODY_SIZE
        _CRC.pack_into(buf, body_end, zlib.crc32(buf[offset:body_end]))

    def _range_error(self, seq: int | None) -> ValueError:
        """Name the first field that is outside its range (called only when packing failed)."""
        values = {name: getattr(self, name) for name, _, _ in _RANGES}
        if seq is not None:
            values["seq"] = seq
        for name, low, high in _RANGES:
            value = values[name]
            if not isinstance(value, int) or not low <= value <= high:
                return ValueError(f"{name} must be an int in [{low}, {high}], got {value!r}")
        shape = self.shape
        if not isinstance(shape, tuple) or len(shape) != 4:
            return ValueError(f"shape must be a tuple of 4 ints, got {shape!r}")
        for dim in shape:
            if not isinstance(dim, int) or not _U32[0] <= dim <= _U32[1]:
                return ValueError(f"shape dims must be ints in [0, {_U32[1]}], got {shape!r}")
        return ValueError(f"op must be an Op value in 1..{len(_OPS)}, got {self.op!r}")

    @classmethod
    def unpack(cls, buf: bytes | bytearray | memoryview) -> Ticket:
        """Parse exactly TICKET_SIZE bytes; raises CorruptTicket saying what was wrong."""
        if len(buf) != TICKET_SIZE:
            raise CorruptTicket(f"wrong length: expected {TICKET_SIZE} bytes, got {len(buf)}")
        return cls.unpack_from(buf, 0)

    @classmethod
    def unpack_from(cls, buf: bytes | bytearray | memoryview, offset: int = 0) -> Ticket:
        """Parse the TICKET_SIZE bytes at `offset` of a larger buffer (no slicing copy)."""
        if len(buf) - offset < TICKET_SIZE or offset < 0:
            raise CorruptTicket(
                f"wrong length: need {TICKET_SIZE} bytes at offset {offset}, buffer has {len(buf)}"
            )
        (stored,) = _CRC.unpack_from(buf, offset + _BODY_SIZE)
        view = buf if isinstance(buf, memoryview) else memoryview(buf)
        computed = zlib.crc32(view[offset : offset + _BODY_SIZE])
        if stored != computed:
            raise CorruptTicket(f"CRC mismatch: stored {stored:#010x}, computed {computed:#010x}")
        (
            seq,
            ts,
            rid,
            s0,
            s1,
            s2,
            s3,
            p_off,
            p_len,
            p_crc,
            layer,
            op_code,
            dtype,
            flags,
            device,
        ) = _BODY.unpack_from(buf, offset)
        op = _OPS.get(op_code)
        if op is None:
            raise CorruptTicket(f"unknown op {op_code}: known ops are 1..{len(_OPS)}")
        # What __init__ does, minus its argument handling: this is the ring consumer's path.
        ticket = _new(cls)
        _setattr(
            ticket,
            "__dict__",
            {
                "op": op,
                "request_id": rid,
                "seq": seq,
                "flags": flags,
                "device": device,
                "dtype": dtype,
                "shape": (s0, s1, s2, s3),
                "layer": layer,
                "payload_offset": p_off,
                "payload_len": p_len,
                "payload_crc": p_crc,
                "timestamp_ns": ts,
            },
        )
        return ticket
