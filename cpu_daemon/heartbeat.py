"""The CPU daemon's heartbeat loop: commands to the GPU daemon, step results back.

One thread ticks at least every 2 ms: it sends queued commands (NEW_SEQ, ABORT, STATS) in
order, takes the GPU daemon's tickets (waiting at most 2 ms, so a step result reaches its
request within one tick), hands each to the callback, bumps the c2g heartbeat and pings the
systemd watchdog. A full ring or arena is backpressure: commands wait here, in order. If the
GPU daemon dies (its pid is gone or its heartbeat stalls for `peer_timeout_s`), `on_dead`
is called once and the loop ends.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog

from hybridgen import sd_notify
from hybridgen.ipc.channels import Channels, Message, Outbox, take_payload
from hybridgen.ipc.messages import StepResult, decode_step_result
from hybridgen.ipc.peer import PeerWatch
from hybridgen.ipc.ticket import Op, Ticket

log = structlog.get_logger()


@dataclass
class CpuHeartbeatStats:
    ticks: int = 0
    sent: int = 0
    received: int = 0
    backpressure: int = 0
    jitter_ms: deque[float] = field(default_factory=lambda: deque(maxlen=4096))
    """How late each tick woke past its 2 ms period."""


class CpuHeartbeat:
    def __init__(
        self,
        channels: Channels,
        on_result: Callable[[StepResult], None],
        on_info: Callable[[dict[str, Any]], None],
        on_dead: Callable[[str], None],
        on_backpressure: Callable[[int, int], None],
        period_s: float = 0.002,
        peer_timeout_s: float = 2.0,
    ) -> None:
        self.ch = channels
        self.on_result, self.on_info, self.on_dead = on_result, on_info, on_dead
        self.on_backpressure = on_backpressure
        self.period = period_s
        self.commands: queue.SimpleQueue[Message] = queue.SimpleQueue()
        self.stats = CpuHeartbeatStats()
        self.stopping = False
        self._outbox = Outbox(channels.c2g, channels.c2g_meta)
        self._peer = PeerWatch(channels.g2c, "GPU daemon", peer_timeout_s)
        self._watchdog = sd_notify.watchdog_interval_s()
        self._last_ping = 0.0
        self._thread = threading.Thread(target=self._run, name="cpu-heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop ticking and detach from c2g, so the GPU daemon waits for a new CPU daemon
        instead of treating this clean exit as a death."""
        self.stopping = True
        self._thread.join(timeout=5)
        self.ch.c2g.release_producer()

    def send(
        self,
        op: Op,
        request_id: int,
        payload: bytes = b"",
        shape: tuple[int, int, int, int] = (0, 0, 0, 0),
        flags: int = 0,
    ) -> None:
        """Queue a command; the heartbeat thread sends it on its next tick (thread-safe)."""
        self.commands.put((op, request_id, payload, flags, shape))

    def _run(self) -> None:
        try:
            while not self.stopping:
                reason = self.tick()
                if reason is not None:
                    self.on_dead(reason)
                    return
        except Exception as e:  # the loop must never die silently: fail the requests
            log.exception("cpu_heartbeat_crashed")
            self.on_dead(f"heartbeat loop crashed: {e}")

    def tick(self) -> str | None:
        """One heartbeat; returns why the GPU daemon is considered dead, or None."""
        t0 = time.monotonic()
        while True:
            try:
                self._outbox.append(self.commands.get_nowait())
            except queue.Empty:
                break
        self._flush()
        ticket = self.ch.g2c.get(self.period)
        late = time.monotonic() - t0 - self.period
        if ticket is None:
            self.stats.jitter_ms.append(max(0.0, late * 1e3))
        for t in ([ticket] if ticket else []) + self.ch.g2c.drain(256):
            self._receive(t)
        self.stats.ticks += 1
        self.ch.c2g.heartbeat()
        now = time.monotonic()
        if self._watchdog and now - self._last_ping >= self._watchdog:
            sd_notify.watchdog()
            self._last_ping = now
        return self._peer.dead()

    def _flush(self) -> None:
        sent = self._outbox.sent
        if self._outbox.flush() is not None:
            self.stats.backpressure += 1
        self.stats.sent += self._outbox.sent - sent

    def _receive(self, ticket: Ticket) -> None:
        self.stats.received += 1
        payload = take_payload(self.ch.g2c_meta, ticket)
        if ticket.op is Op.STEP_RESULT:
            self.on_result(
                decode_step_result(ticket.request_id, ticket.flags, ticket.shape, payload)
            )
        elif ticket.op is Op.STATS:
            self.on_info(json.loads(payload))
        elif ticket.op is Op.BACKPRESSURE:
            self.on_backpressure(ticket.flags, ticket.shape[0])
        else:
            log.warning("unexpected_ticket", op=ticket.op.name)
