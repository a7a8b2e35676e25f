"""Ticket encoding: exact round trips, field ranges, and CRC/length/op errors."""

from __future__ import annotations

import pytest

from hybridgen.ipc.ticket import TICKET_SIZE, CorruptTicket, Op, Ticket


def _full_ticket(**overrides: object) -> Ticket:
    fields: dict[str, object] = dict(
        op=Op.EXPERT_RUN,
        request_id=2**64 - 1,
        seq=2**63 + 5,
        flags=0xBEEF,
        device=7,
        dtype=3,
        shape=(1, 2**32 - 1, 3, 4),
        layer=-1,
        payload_offset=123_456,
        payload_len=2**32 - 1,
        timestamp_ns=1_700_000_000_123_456_789,
    )
    fields.update(overrides)
    return Ticket(**fields)  # type: ignore[arg-type]


# ---- ticket encoding ------------------------------------------------------------------------


def test_pack_unpack_round_trip_is_exact() -> None:
    for op in Op:
        ticket = _full_ticket(op=op)
        raw = ticket.pack()
        assert len(raw) == TICKET_SIZE == 64
        back = Ticket.unpack(raw)
        assert back == ticket
        assert back.op is op
        assert back.pack() == raw
    assert Ticket.unpack(Ticket(Op.SHUTDOWN).pack()) == Ticket(Op.SHUTDOWN)


RANGES = [
    ("seq", 0, 2**64 - 1),
    ("timestamp_ns", 0, 2**64 - 1),
    ("request_id", 0, 2**64 - 1),
    ("payload_offset", 0, 2**32 - 1),
    ("payload_len", 0, 2**32 - 1),
    ("payload_crc", 0, 2**32 - 1),
    ("layer", -1, 2**15 - 1),
    ("dtype", 0, 255),
    ("flags", 0, 65535),
    ("device", -1, 32767),
]


@pytest.mark.parametrize(("field", "low", "high"), RANGES)
def test_every_field_range(field: str, low: int, high: int) -> None:
    for good in (low, high):
        assert getattr(Ticket.unpack(_full_ticket(**{field: good}).pack()), field) == good
    for bad in (low - 1, high + 1):
        with pytest.raises(ValueError, match=rf"{field} must be an int in \[{low}, {high}\]"):
            _full_ticket(**{field: bad}).pack()


def test_shape_and_op_ranges() -> None:
    for dim in (0, 2**32 - 1):
        assert Ticket.unpack(_full_ticket(shape=(dim,) * 4).pack()).shape == (dim,) * 4
    for bad_shape in [(-1, 0, 0, 0), (0, 0, 0, 2**32), (1, 2, 3)]:
        with pytest.raises(ValueError, match="shape"):
            _full_ticket(shape=bad_shape).pack()
    for bad_op in (0, max(Op) + 1, 255):
        with pytest.raises(ValueError, match="op must be an Op value"):
            _full_ticket(op=bad_op).pack()


def test_crc_catches_every_flipped_bit() -> None:
    raw = bytearray(_full_ticket().pack())
    for bit in range(TICKET_SIZE * 8):
        flipped = bytearray(raw)
        flipped[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(CorruptTicket, match="CRC mismatch"):
            Ticket.unpack(bytes(flipped))


def test_unpack_reports_length_and_unknown_op() -> None:
    raw = _full_ticket().pack()
    with pytest.raises(CorruptTicket, match="wrong length: expected 64 bytes, got 63"):
        Ticket.unpack(raw[:-1])
    # A well-formed CRC over an op byte that is not an Op.
    import struct
    import zlib

    body = bytearray(raw[:60])
    body[54] = 99  # the op byte
    forged = bytes(body) + struct.pack("<I", zlib.crc32(body))
    with pytest.raises(CorruptTicket, match="unknown op 99"):
        Ticket.unpack(forged)
