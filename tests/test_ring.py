"""The SPSC shared-memory ring (hybridgen.ipc.ring), within one process and across two.

Cross-process tests use the 'spawn' start method, so the child runs only what it imports
(no inherited mappings or semaphores). Every test uses its own instance name and removes
everything of that instance from /dev/shm afterwards, even when it fails.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import time
import uuid
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import structlog.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridgen.ipc import shm
from hybridgen.ipc.meta_buffer import MetaBuffer
from hybridgen.ipc.ring import HEADER_SIZE, SLOT_SIZE, SLOT_TICKET_OFFSET, Ring
from hybridgen.ipc.ticket import TICKET_SIZE, DType, Op, Ticket

SPAWN = multiprocessing.get_context("spawn")
STAMPED = SLOT_TICKET_OFFSET + TICKET_SIZE  # stamp + ticket: the bytes of a slot that matter


def _new_instance() -> str:
    return "t" + uuid.uuid4().hex[:16]


# ---- naming and lifecycle -------------------------------------------------------------------


def test_segment_name_validation() -> None:
    assert shm.segment_name("a-b_C9", "c2g") == "/hybridgen-a-b_C9-c2g"
    for bad in ("", "x" * 33, "a/b", "a b", "ü"):
        with pytest.raises(ValueError, match=r"instance must be 1\.\.32 characters"):
            shm.segment_name(bad, "c2g")
    with pytest.raises(ValueError, match="name must be"):
        shm.segment_name("ok", "c-2g")


def test_capacity_must_be_power_of_two(instance: str) -> None:
    for bad in (0, 1, 3, 100, 2**21):
        with pytest.raises(ValueError, match=r"power of two in \[2, 1048576\]"):
            Ring.create(instance, "c2g", bad)


def test_attach_missing_ring_fails_clearly(instance: str) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Ring.attach(instance, "c2g")


def test_stale_segment_of_crashed_owner_is_replaced(instance: str) -> None:
    crashed = Ring.create(instance, "c2g", 4)
    for i in range(3):
        assert crashed.try_put(Ticket(Op.NEW_SEQ, request_id=i))
    crashed.heartbeat()
    old_epoch = crashed.epoch
    old_peer = Ring.attach(instance, "c2g")
    assert old_peer.still_current()
    crashed.close()  # the "crash": no unlink
    time.sleep(0.001)
    owner = Ring.create(instance, "c2g", 4)
    peer = Ring.attach(instance, "c2g")
    try:
        assert not old_peer.still_current() and peer.still_current()
        old_peer.close()
        assert owner.epoch == peer.epoch != old_epoch
        assert peer.occupancy() == 0 and peer.peer_heartbeat() == 0 and peer.producer_pid() == 0
        assert peer.get(0.0) is None
        assert all(owner.try_put(Ticket(Op.STATS, request_id=i)) for i in range(4))
        assert not owner.try_put(Ticket(Op.STATS))
        assert [t.request_id for t in peer.drain(10)] == [0, 1, 2, 3]
    finally:
        owner.close()
        peer.close()


def test_unlink_all_leaves_nothing_of_the_instance(instance: str) -> None:
    other = instance + "-x"  # a prefix-sharing instance that must survive
    rings = [Ring.create(instance, n, 8) for n in ("c2g", "g2c")]
    meta = MetaBuffer.create(instance, "meta_c2g", 4096)
    survivor = Ring.create(other, "c2g", 2)
    try:
        assert len(shm.list_instance(instance)) == 7  # 3 segments + 4 semaphores
        removed = shm.unlink_all(instance)
        assert len(removed) == 7
        mine = [
            p.name
            for p in shm.SHM_DIR.iterdir()
            if p.name.removeprefix("sem.").startswith(f"hybridgen-{instance}-")
            and not p.name.removeprefix("sem.").startswith(f"hybridgen-{other}-")
        ]
        assert mine == []
        assert shm.list_instance(instance) == []
        assert len(shm.list_instance(other)) == 3
    finally:
        for ring in [*rings, survivor]:
            ring.close()
        meta.close()
        shm.unlink_all(other)
    assert shm.list_instance(other) == []


def test_heartbeat_pids_occupancy(instance: str) -> None:
    with Ring.create(instance, "g2c", 8) as owner, Ring.attach(instance, "g2c") as peer:
        assert owner.producer_pid() == 0 and peer.peer_heartbeat() == 0
        assert owner.heartbeat() == 1 and owner.heartbeat() == 2
        assert peer.peer_heartbeat() == 2
        import os

        assert peer.producer_pid() == os.getpid()
        owner.try_put(Ticket(Op.HEARTBEAT))
        assert peer.occupancy() == 1
        assert peer.get(1.0) == Ticket(Op.HEARTBEAT, seq=1)
        assert peer.occupancy() == 0 and peer.consumer_pid() == os.getpid()


def test_full_ring_is_backpressure_and_drops_nothing(instance: str) -> None:
    with Ring.create(instance, "c2g", 4) as prod, Ring.attach(instance, "c2g") as cons:
        assert [prod.try_put(Ticket(Op.APPEND_TOKENS, request_id=i)) for i in range(6)] == [
            True,
            True,
            True,
            True,
            False,
            False,
        ]
        start = time.monotonic()
        assert not prod.put(Ticket(Op.APPEND_TOKENS, request_id=99), timeout=0.05)
        assert time.monotonic() - start >= 0.04
        assert (prod.stats.put, prod.stats.full, prod.stats.corrupt) == (4, 3, 0)
        assert prod.occupancy() == 4
        assert [t.request_id for t in cons.drain(2)] == [0, 1]
        assert prod.try_put(Ticket(Op.APPEND_TOKENS, request_id=4))
        assert prod.put(Ticket(Op.APPEND_TOKENS, request_id=5), timeout=0.5)
        got = [t.request_id for t in cons.drain(100)]
        assert got == [2, 3, 4, 5]
        assert cons.get(0.02) is None
        assert cons.stats.got == 6 and cons.stats.corrupt == 0


# ---- two real processes ---------------------------------------------------------------------


def _producer_main(instance: str, count: int) -> None:
    """Child process: attach as producer and send `count` tickets, request_id = index."""
    ring = Ring.attach(instance, "c2g", wait=30.0)
    for i in range(count):
        ticket = Ticket(Op.APPEND_TOKENS, request_id=i, layer=i % 80, shape=(i, 0, 0, 0))
        if not ring.put(ticket, timeout=30.0):
            raise SystemExit(f"put {i} timed out")
    ring.close()


@contextlib.contextmanager
def _child(target: Callable[..., None], *args: object) -> Iterator[None]:
    """Run `target(*args)` in a spawned process; on success it must exit 0 within 30 s.

    When the body fails, the child (possibly blocked on a full ring) is killed at once.
    """
    proc = SPAWN.Process(target=target, args=args, daemon=True)
    proc.start()
    ok = False
    try:
        yield
        ok = True
    finally:
        proc.join(timeout=30 if ok else 0.5)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5)
            if ok:
                pytest.fail("child process hung")
    assert proc.exitcode == 0, f"child exited with {proc.exitcode}"


def test_cross_process_10k_tickets_in_order(instance: str) -> None:
    count = 10_000
    with Ring.create(instance, "c2g", 64) as ring, _child(_producer_main, instance, count):
        for i in range(count):
            ticket = ring.get(timeout=30.0)
            assert ticket is not None, f"ticket {i} never arrived"
            assert (ticket.seq, ticket.request_id, ticket.shape[0]) == (i + 1, i, i)
        assert ring.get(0.05) is None
        assert ring.stats.got == count and ring.stats.corrupt == 0


def _heartbeat_main(instance: str, beats: int) -> None:
    """Child: bump the c2g heartbeat as fast as it can."""
    ring = Ring.attach(instance, "c2g", wait=30.0)
    for _ in range(beats):
        ring.heartbeat()
    ring.close()


def test_peer_never_sees_a_torn_or_reset_heartbeat(instance: str) -> None:
    # Shared words are single 8-byte stores: a reader racing the writer must only ever
    # see values that grow (struct.pack_into, which zero-fills first, fails this).
    beats = 200_000
    with Ring.create(instance, "c2g", 2) as ring, _child(_heartbeat_main, instance, beats):
        last, reads = 0, 0
        deadline = time.monotonic() + 30
        while last < beats and time.monotonic() < deadline:
            now = ring.peer_heartbeat()
            assert now >= last, f"heartbeat went back from {last} to {now}"
            last, reads = now, reads + 1
        assert last == beats and reads > 1


def _payload_producer_main(instance: str, count: int) -> None:
    """Child: token ids through the Meta-Buffer, tickets pointing at them through the ring."""
    ring = Ring.attach(instance, "c2g", wait=30.0)
    meta = MetaBuffer.attach(instance, "meta_c2g", wait=30.0)
    for i in range(count):
        ids = np.arange(i % 61 + 1, dtype=np.int32) + i
        placed = None
        while placed is None:  # arena full is backpressure: wait for the consumer
            placed = meta.try_write(ids.data)
            if placed is None:
                time.sleep(0.0001)
        offset, length = placed
        ticket = Ticket(
            Op.APPEND_TOKENS,
            request_id=i,
            dtype=DType.I32,
            shape=(len(ids), 0, 0, 0),
            payload_offset=offset,
            payload_len=length,
        )
        if not ring.put(ticket, timeout=30.0):
            raise SystemExit(f"put {i} timed out")
    ring.close()
    meta.close()


def test_payloads_through_meta_buffer_across_processes(instance: str) -> None:
    count = 3_000
    with (
        Ring.create(instance, "c2g", 16) as ring,
        MetaBuffer.create(instance, "meta_c2g", 4096) as meta,
        _child(_payload_producer_main, instance, count),
    ):
        for i in range(count):
            ticket = ring.get(timeout=30.0)
            assert ticket is not None and ticket.request_id == i
            assert ticket.dtype == DType.I32
            ids = meta.read_array(ticket.payload_offset, ticket.payload_len, np.int32)
            assert len(ids) == ticket.shape[0] == i % 61 + 1
            assert ids[0] == i and ids[-1] == i + len(ids) - 1
            del ids  # the view must go before the space is reused or the arena closed
            meta.release(ticket.payload_offset, ticket.payload_len)
        assert meta.used() == 0


def test_corrupt_slot_is_logged_once(instance: str) -> None:
    with Ring.create(instance, "c2g", 4) as ring:
        raw = shm.attach_segment(shm.segment_name(instance, "c2g"))
        try:
            for i in range(3):
                ring.try_put(Ticket(Op.EXPERT_DONE, request_id=i))
            raw[HEADER_SIZE + SLOT_SIZE + 20] ^= 0xFF  # flip a byte of ticket 1's body
            with structlog.testing.capture_logs() as logs:
                assert [t.request_id for t in ring.drain(10)] == [0, 2]
                assert ring.get(0.01) is None
        finally:
            raw.close()
        assert ring.stats.corrupt == 1
        assert [e["event"] for e in logs] == ["ipc_ring_corrupt_slot"]
        assert "CRC mismatch" in logs[0]["reason"] and logs[0]["position"] == 1


def _timed_producer_main(instance: str, burst: int, paced: int) -> None:
    """Child: a back-to-back burst (throughput), then one ticket at a time (latency)."""
    ring = Ring.attach(instance, "c2g", wait=30.0)
    for i in range(burst):
        ticket = Ticket(Op.STEP_RESULT, request_id=i, timestamp_ns=time.monotonic_ns())
        if not ring.put(ticket, timeout=30.0):
            raise SystemExit("burst put timed out")
    for i in range(paced):
        while ring.occupancy():  # wait until the consumer took the previous one
            time.sleep(0)
        time.sleep(0.0002)  # let the consumer block in sem_wait: measure a real wake-up
        ticket = Ticket(Op.STEP_RESULT, request_id=burst + i, timestamp_ns=time.monotonic_ns())
        if not ring.put(ticket, timeout=30.0):
            raise SystemExit("paced put timed out")
    ring.close()


def test_throughput_and_latency_between_processes(instance: str) -> None:
    burst, paced = 100_000, 2_000
    with (
        Ring.create(instance, "c2g", 1024) as ring,
        _child(_timed_producer_main, instance, burst, paced),
    ):
        first = ring.get(timeout=30.0)
        assert first is not None
        start, received = time.perf_counter(), 1
        while received < burst:
            batch = ring.drain(256) or [ring.get(timeout=30.0)]
            assert batch[-1] is not None
            received += len(batch)
        elapsed = time.perf_counter() - start
        latencies = []
        for _ in range(paced):
            ticket = ring.get(timeout=30.0)
            assert ticket is not None
            latencies.append(time.monotonic_ns() - ticket.timestamp_ns)
        assert ticket.request_id == burst + paced - 1
    rate = (burst - 1) / elapsed
    p50, p99 = np.percentile(np.array(latencies) / 1000.0, [50, 99])
    print(
        f"\nring throughput {rate:,.0f} tickets/s; one-way latency p50 {p50:.1f} us, "
        f"p99 {p99:.1f} us"
    )
    assert rate > 20_000


# ---- torn and garbage slots (Hypothesis) ----------------------------------------------------

CAPACITY = 8
_damage = st.one_of(
    st.just(("none", 0, b"")),
    st.tuples(st.just("garbage"), st.just(0), st.binary(min_size=STAMPED, max_size=STAMPED)),
    st.tuples(
        st.just("partial"),
        st.integers(SLOT_TICKET_OFFSET, STAMPED - 1),
        st.binary(min_size=1, max_size=TICKET_SIZE),
    ),
    st.just(("stamp_without_body", 0, b"")),
    st.just(("body_without_stamp", 0, b"")),
    st.just(("zeroed", 0, b"")),
)


def _damaged(slot: bytes, previous: bytes, kind: str, at: int, data: bytes) -> bytes:
    """The new stamp+ticket bytes of a slot after `kind` damage."""
    if kind == "garbage":
        return data
    if kind == "partial":
        data = data[: STAMPED - at]
        return slot[:at] + data + slot[at + len(data) :]
    if kind == "stamp_without_body":  # new stamp, body still from the previous lap
        return slot[:SLOT_TICKET_OFFSET] + previous[SLOT_TICKET_OFFSET:]
    if kind == "body_without_stamp":  # new body, stamp still from the previous lap
        return previous[:SLOT_TICKET_OFFSET] + slot[SLOT_TICKET_OFFSET:]
    if kind == "zeroed":
        return bytes(STAMPED)
    return slot


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(damage=st.lists(_damage, min_size=CAPACITY, max_size=CAPACITY), use_get=st.booleans())
def test_reader_survives_torn_and_garbage_slots(
    damage: list[tuple[str, int, bytes]], use_get: bool
) -> None:
    instance = _new_instance()
    try:
        prod = Ring.create(instance, "c2g", CAPACITY)
        cons = Ring.attach(instance, "c2g")
        raw = shm.attach_segment(shm.segment_name(instance, "c2g"))
        slots = [HEADER_SIZE + i * SLOT_SIZE for i in range(CAPACITY)]
        # Lap 1 fills every slot so "previous lap" contents exist, and is consumed.
        for i in range(CAPACITY):
            assert prod.try_put(Ticket(Op.KV_FETCH, request_id=1000 + i))
        assert len(cons.drain(CAPACITY)) == CAPACITY
        previous = [raw[off : off + STAMPED] for off in slots]
        # Lap 2 is committed normally, then damaged in place before the reader looks.
        for i in range(CAPACITY):
            assert prod.try_put(Ticket(Op.KV_READY, request_id=i))
        expected_ids, expected_corrupt = [], 0
        for i, (off, (kind, at, data)) in enumerate(zip(slots, damage, strict=True)):
            slot = raw[off : off + STAMPED]
            new = _damaged(slot, previous[i], kind, at, data)
            raw[off : off + STAMPED] = new
            if new == slot:
                expected_ids.append(i)
            else:
                expected_corrupt += 1
        # Lap 3: valid tickets behind the damage must still be delivered, in order.
        got = cons.drain(CAPACITY)
        for i in range(CAPACITY):
            assert prod.try_put(Ticket(Op.KV_READY, request_id=100 + i))
        if use_get:
            got += [t for t in iter(lambda: cons.get(0.01), None)]
        else:
            got += cons.drain(4 * CAPACITY)
        assert [t.request_id for t in got] == expected_ids + [100 + i for i in range(CAPACITY)]
        assert cons.stats.corrupt == expected_corrupt
        assert cons.occupancy() == 0
        raw.close()
        prod.close()
        cons.close()
    finally:
        shm.unlink_all(instance)
