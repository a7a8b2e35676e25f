"""Nothing in a ticket crashes a daemon: a corrupt slot, a payload that fails its CRC, a
payload with a valid CRC that does not decode, a span outside the arena. Each bad ticket is
answered with CORRUPT naming its seq, its space is released, and the request it carried
fails (DATA_LOSS) while the next one is served. The GPU daemon runs as a real process; the
CPU daemon's heartbeat is driven tick by tick."""

from __future__ import annotations

import os
import signal
import struct
import subprocess
import time
import zlib
from collections.abc import Iterator

import pytest

from hybridgen.config.engine import EngineConfig
from hybridgen.cpu_daemon.heartbeat import CpuHeartbeat
from hybridgen.engine.engine import Engine
from hybridgen.engine.request_output import RequestOutput
from hybridgen.engine.step_errors import ErrorCode
from hybridgen.ipc import shm
from hybridgen.ipc.channels import Channels, make_ticket, take_payload
from hybridgen.ipc.messages import (
    ERROR,
    encode_new_seq,
    encode_step_result,
)
from hybridgen.ipc.meta_buffer import HEADER_SIZE as META_HEADER
from hybridgen.ipc.meta_buffer import MetaBuffer
from hybridgen.ipc.peer import STALL_TIMEOUT_S, pid_alive
from hybridgen.ipc.ring import HEADER_SIZE, SLOT_SIZE, SLOT_TICKET_OFFSET, Ring
from hybridgen.ipc.ticket import CorruptPayload, Op, Ticket
from hybridgen.sampling.params import SamplingParams
from tests.test_gpu_daemon import GREEDY, collect, daemon, send  # noqa: F401 - a fixture

# -- the pieces ---------------------------------------------------------------------------


def test_payload_crc_is_checked_and_the_span_released_anyway(instance: str) -> None:
    with MetaBuffer.create(instance, "meta", 4096) as meta:
        ticket = make_ticket(meta, Op.NEW_SEQ, 7, b"payload bytes")
        assert ticket is not None and ticket.payload_crc == zlib.crc32(b"payload bytes")
        meta_mm = shm.attach_segment(shm.segment_name(instance, "meta"))
        meta_mm[META_HEADER + ticket.payload_offset] ^= 0x01  # one flipped bit
        with pytest.raises(CorruptPayload, match="payload CRC"):
            take_payload(meta, ticket)
        assert meta.used() == 0, "a bad payload's space is released all the same"
        outside = Ticket(Op.NEW_SEQ, 8, payload_offset=8000, payload_len=16)
        with pytest.raises(CorruptPayload, match="outside the arena"):
            take_payload(meta, outside)
        meta_mm.close()


def test_a_release_frees_the_payloads_of_lost_tickets_and_nothing_that_is_not_live(
    instance: str,
) -> None:
    with MetaBuffer.create(instance, "meta", 4096) as meta:
        spans = [meta.write(bytes([i]) * 1000) for i in range(3)]
        meta.release(*spans[1])  # the ticket of spans[0] was lost: freed with it
        assert meta.used() == 1000
        with pytest.raises(ValueError, match="not a live payload"):
            meta.release(*spans[0])
        assert meta.used() == 1000, "a refused release frees nothing"
        wrapped = meta.write(b"w" * 1500)  # does not fit before the end: starts at 0
        assert wrapped[0] == 0
        meta.release(*wrapped)  # frees spans[2] and the wrap skip too
        assert meta.used() == 0


def corrupt_slot(instance: str, ring: str, seq: int, capacity: int) -> None:
    """Flip a bit in the committed ticket at `seq`, as stray memory writes would."""
    mm = shm.attach_segment(shm.segment_name(instance, ring))
    slot = HEADER_SIZE + ((seq - 1) % capacity) * SLOT_SIZE
    mm[slot + SLOT_TICKET_OFFSET + 20] ^= 0x10  # inside request_id
    mm.close()


def test_a_corrupt_slot_is_skipped_and_its_seq_reported(instance: str) -> None:
    with Ring.create(instance, "r", 8) as ring:
        seq = ring.next_seq()
        assert ring.try_put(Ticket(Op.ABORT, request_id=5))
        corrupt_slot(instance, "r", seq, 8)
        assert ring.try_put(Ticket(Op.ABORT, request_id=6))
        assert [t.request_id for t in ring.drain(8)] == [6]
        assert ring.take_lost() == [seq] and ring.take_lost() == []


# -- the CPU daemon's heartbeat -----------------------------------------------------------


class CpuSide:
    """A CpuHeartbeat whose callbacks record what they get; this test is its GPU daemon."""

    def __init__(self, ch: Channels) -> None:
        self.ch = ch
        self.results: list[RequestOutput] = []
        self.lost: list[tuple[int, str]] = []
        self.dead: list[str] = []
        self.hb = CpuHeartbeat(
            ch,
            self.results.append,
            lambda info: None,
            self.dead.append,
            lambda flags, waiting: None,
            lambda rid, why: self.lost.append((rid, why)),
        )

    def tick(self) -> list[Ticket]:
        """One heartbeat, and the next, which sends its answers; the tickets they sent."""
        assert self.hb.tick() is None and self.hb.tick() is None
        return self.ch.c2g.drain(64)


def put_g2c(ch: Channels, op: Op, rid: int, payload: bytes, flags: int, shape: tuple) -> int:  # type: ignore[type-arg]
    seq = ch.g2c.next_seq()
    ticket = make_ticket(ch.g2c_meta, op, rid, payload, flags, shape)
    assert ticket is not None and ch.g2c.try_put(ticket)
    return seq


def test_bad_g2c_tickets_are_answered_not_fatal(instance: str) -> None:
    ch = Channels.create(instance, capacity=16, meta_bytes=1 << 16)
    try:
        side = CpuSide(ch)
        running = RequestOutput("1", [5, 6], False, None, None, None, 3, 2)
        good, flags, shape = encode_step_result(running)
        short = put_g2c(ch, Op.STEP_RESULT, 1, good[:-1], flags, shape)  # wrong size
        bad_utf8 = put_g2c(ch, Op.STEP_RESULT, 2, b"\xff\xfe", ERROR, (0, 3, 0, 3))
        bad_code = put_g2c(ch, Op.STEP_RESULT, 3, good, flags, (2, 3, 2, 9))
        torn = put_g2c(ch, Op.STEP_RESULT, 4, good, flags, shape)
        corrupt_slot(instance, "g2c", torn, 16)
        seq = ch.g2c.next_seq()
        outside = Ticket(Op.STEP_RESULT, 5, payload_offset=1 << 20, payload_len=8)
        assert ch.g2c.try_put(outside)
        put_g2c(ch, Op.STEP_RESULT, 6, good, flags, shape)  # a good one after them all
        sent = side.tick()
        assert [r.request_id for r in side.results] == ["6"]
        nacks = {t.request_id for t in sent if t.op is Op.CORRUPT}
        assert nacks == {short, bad_utf8, bad_code, torn, seq}
        assert ch.g2c_meta.used() == 0, "every bad ticket's space was released"
        assert side.dead == []
    finally:
        ch.close()


def test_a_c2g_ticket_the_gpu_daemon_refused_fails_its_request(instance: str) -> None:
    ch = Channels.create(instance, capacity=16, meta_bytes=1 << 16)
    try:
        side = CpuSide(ch)
        side.hb.send(Op.NEW_SEQ, 41, encode_new_seq([1, 2], GREEDY), (2, 0, 0, 0))
        side.hb.send(Op.STATS, 0)
        sent = side.tick()
        new_seq, stats = (s.seq for s in sent)
        for seq in (new_seq, stats):  # the GPU daemon's answer: both were bad
            put_g2c(ch, Op.CORRUPT, seq, b"payload CRC mismatch", 0, (0, 0, 0, 0))
        again = side.tick()
        assert side.lost and side.lost[0][0] == 41, "the request fails (DATA_LOSS)"
        assert "NEW_SEQ" in side.lost[0][1]
        assert [(t.op, t.request_id) for t in again] == [(Op.ABORT, 41), (Op.STATS, 0)]
    finally:
        ch.close()


# -- the GPU daemon, a real process -------------------------------------------------------


@pytest.fixture
def stopped(daemon) -> Iterator[tuple[Channels, str, int]]:  # type: ignore[no-untyped-def]  # noqa: F811
    """The daemon's channels, instance and pid; `with paused(pid)` holds it still."""
    proc, ch, instance = daemon
    yield ch, instance, proc.pid
    assert proc.poll() is None, "the GPU daemon survived every bad ticket"


class paused:
    """SIGSTOP the process for the block, so that memory can be corrupted under it."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def __enter__(self) -> None:
        os.kill(self.pid, signal.SIGSTOP)

    def __exit__(self, *exc: object) -> None:
        os.kill(self.pid, signal.SIGCONT)


def test_the_gpu_daemon_survives_every_bad_ticket(
    stopped: tuple[Channels, str, int],
) -> None:
    ch, instance, pid = stopped
    new_seq = encode_new_seq([5, 6, 7], GREEDY)
    seqs = []
    with paused(pid):
        # 1. A corrupt slot whose payload sat in the arena: the next release must free it
        #    (it used to raise "release out of FIFO order" and kill the daemon).
        seqs.append(ch.c2g.next_seq())
        send(ch, Op.NEW_SEQ, 1, new_seq, (3, 0, 0, 0))
        corrupt_slot(instance, "c2g", seqs[-1], ch.c2g.capacity)
        # 2. A payload flipped after its CRC was taken.
        seqs.append(ch.c2g.next_seq())
        ticket = make_ticket(ch.c2g_meta, Op.NEW_SEQ, 2, new_seq, shape=(3, 0, 0, 0))
        assert ticket is not None and ch.c2g.put(ticket, 5)
        arena = shm.attach_segment(shm.segment_name(instance, "c2g_meta"))
        arena[META_HEADER + ticket.payload_offset + 6] ^= 0x40
        arena.close()
    # 3. A valid CRC over parameters that are not UTF-8 JSON (was: UnicodeDecodeError).
    seqs.append(ch.c2g.next_seq())
    send(ch, Op.NEW_SEQ, 3, struct.pack("<I", 4) + b"\xff\xfe\xfd\xfc", (0, 0, 0, 0))
    # 4. A span outside the arena (was: ValueError "outside the arena").
    seqs.append(ch.c2g.next_seq())
    far = Ticket(Op.NEW_SEQ, 4, payload_offset=ch.c2g_meta.capacity, payload_len=64)
    assert ch.c2g.put(far, 5)
    send(ch, Op.NEW_SEQ, 5, new_seq, (3, 0, 0, 0))  # a good request after them all
    events: list[Ticket] = []
    results = collect(ch, {5}, events=events, timeout=60)
    expected = Engine(EngineConfig(model="tiny-llama", device="cpu")).generate([[5, 6, 7]], GREEDY)
    assert [t for r in results[5] for t in r.new_token_ids] == expected[0].token_ids
    deadline = time.monotonic() + 10
    while {t.request_id for t in events if t.op is Op.CORRUPT} != set(seqs):
        assert time.monotonic() < deadline, [(t.op, t.request_id) for t in events]
        collect(ch, set(), events=events, timeout=1)
        ch.c2g.heartbeat()
    assert not set(results) & {1, 2, 3, 4}, "a bad ticket starts nothing"
    assert ch.c2g_meta.used() == 0, "every bad ticket's space was released"


def test_a_lost_step_result_fails_its_request_with_data_loss(
    stopped: tuple[Channels, str, int],
) -> None:
    ch, _, _ = stopped
    long = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    send(ch, Op.NEW_SEQ, 9, encode_new_seq([5, 6, 7], long), (3, 0, 0, 0))
    first = None
    while first is None:  # take one result of request 9, as the CPU daemon would
        ch.c2g.heartbeat()
        first = ch.g2c.get(0.01)
    take_payload(ch.g2c_meta, first)
    send(ch, Op.CORRUPT, first.seq, b"payload CRC mismatch")  # "it arrived corrupted"
    results = collect(ch, {9}, timeout=60)
    last = results[9][-1]
    assert last.error is not None and last.error.code is ErrorCode.DATA_LOSS, last
    assert "corrupted" in str(last.error)


# -- when a peer is dead --------------------------------------------------------------------


def test_a_peer_is_dead_by_its_process_state_not_by_a_short_stall() -> None:
    zombie = subprocess.Popen(["true"])  # exits, and stays a zombie until waited for
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{zombie.pid}") and pid_alive(zombie.pid):
        assert time.monotonic() < deadline, "a zombie counted as alive"
        time.sleep(0.01)
    assert os.path.exists(f"/proc/{zombie.pid}"), "not reaped yet: its state said it is dead"
    zombie.wait()
    assert pid_alive(os.getpid())
    # One busy request (a long prompt, a kernel compiling) must not pass for a dead peer.
    assert STALL_TIMEOUT_S >= 10.0
