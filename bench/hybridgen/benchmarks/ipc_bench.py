"""B5's shared-memory figures: ring throughput and one-way latency between two processes,
and the CPU heartbeat's wake-up lateness."""

from __future__ import annotations

import multiprocessing
import time
import uuid
from collections import deque
from typing import Any

import numpy as np
import structlog

from hybridgen.ipc import shm
from hybridgen.ipc.ring import Ring
from hybridgen.ipc.ticket import Op, Ticket

log = structlog.get_logger()

_SPAWN = multiprocessing.get_context("spawn")  # the child maps the ring itself, like a daemon


def leftovers(instance: str) -> list[str]:
    return sorted(p.name for p in shm.SHM_DIR.glob(f"*{shm.PREFIX}-{instance}-*"))


def ring_producer(instance: str, burst: int, paced: int) -> None:
    """Child: a back-to-back burst (throughput), then one ticket at a time (latency)."""
    ring = Ring.attach(instance, "c2g", wait=60.0)
    for i in range(burst):
        if not ring.put(Ticket(Op.STEP_RESULT, request_id=i, timestamp_ns=time.monotonic_ns()), 60):
            raise SystemExit("burst put timed out")
    for i in range(paced):
        while ring.occupancy():  # the consumer has not taken the previous one yet
            time.sleep(0)
        time.sleep(0.0002)  # let the consumer block in sem_wait: time a real wake-up
        ticket = Ticket(Op.STEP_RESULT, request_id=burst + i, timestamp_ns=time.monotonic_ns())
        if not ring.put(ticket, 60):
            raise SystemExit("paced put timed out")
    ring.close()


def measure_ring(tickets: int, paced: int, capacity: int = 1024) -> dict[str, Any]:
    """Consumer here, producer in a spawned process, over a real shared-memory Ring."""
    instance = f"bench{uuid.uuid4().hex[:10]}"
    log.info("ring_start", tickets=tickets, paced=paced)
    child = None
    try:
        with Ring.create(instance, "c2g", capacity) as ring:
            child = _SPAWN.Process(target=ring_producer, args=(instance, tickets, paced))
            child.start()
            if ring.get(timeout=120) is None:
                raise RuntimeError("the producer process sent nothing in 120 s")
            start, received = time.perf_counter(), 1  # clock from the first ticket
            while received < tickets:
                got = len(ring.drain(256))
                if not got:  # drained faster than produced: block for the next one
                    if ring.get(timeout=60) is None:
                        raise RuntimeError(f"burst stalled at {received}/{tickets}")
                    got = 1
                received += got
            elapsed = time.perf_counter() - start
            latencies = []
            for _ in range(paced):
                t = ring.get(timeout=60)
                if t is None:
                    raise RuntimeError("paced ticket did not arrive in 60 s")
                latencies.append((time.monotonic_ns() - t.timestamp_ns) / 1e3)
            corrupt = ring.stats.corrupt
        child.join(timeout=60)
    finally:
        if child is not None and child.is_alive():
            child.terminate()
        shm.unlink_all(instance)
    p50, p99 = np.percentile(latencies, [50, 99])
    return {
        "tickets": tickets,
        "capacity": capacity,
        "tickets_per_s": (tickets - 1) / elapsed,
        "paced": paced,
        "latency_us": {"p50": float(p50), "p99": float(p99), "max": max(latencies)},
        "corrupt": corrupt,
        "producer_exit_code": child.exitcode,
        "shm_left": leftovers(instance),
    }


def measure_jitter(seconds: float) -> dict[str, Any]:
    """The real CpuHeartbeat thread on real Channels; the GPU side is a stand-in that never
    produces (pid 0 reads as "no peer yet"), so every tick waits its full 2 ms in
    `g2c.get`, which is what jitter_ms records."""
    from hybridgen.cpu_daemon.heartbeat import CpuHeartbeat
    from hybridgen.ipc.channels import Channels

    instance = f"bench{uuid.uuid4().hex[:10]}"
    log.info("heartbeat_start", seconds=seconds)
    channels = Channels.create(instance, capacity=1024, meta_bytes=1 << 20)
    try:
        dead: list[str] = []
        hb = CpuHeartbeat(
            channels,
            lambda r: None,
            lambda i: None,
            dead.append,
            lambda f, n: None,
            lambda r, w: None,
        )
        hb.stats.jitter_ms = deque()  # unbounded: keep every tick of a long run
        hb.start()
        time.sleep(seconds)
        hb.stop()
        late = list(hb.stats.jitter_ms)
    finally:
        channels.close()
        shm.unlink_all(instance)
    if not late:
        raise RuntimeError(f"the heartbeat recorded no ticks (dead: {dead})")
    p50, p99 = np.percentile(late, [50, 99])
    return {
        "seconds": seconds,
        "period_ms": hb.period * 1e3,
        "ticks": hb.stats.ticks,
        "lateness_ms": {"p50": float(p50), "p99": float(p99), "max": max(late)},
        "peer_dead": dead,
        "shm_left": leftovers(instance),
    }
