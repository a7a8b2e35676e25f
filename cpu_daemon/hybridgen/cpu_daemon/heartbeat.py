"""The CPU daemon's heartbeat loop: commands to the GPU daemon, step results back.

One thread ticks at least every 2 ms: it sends queued commands (NEW_SEQ, ABORT, STATS) in
order, takes the GPU daemon's tickets (waiting at most 2 ms, so a step result reaches its
request within one tick), hands each to the callback, bumps the c2g heartbeat and pings the
systemd watchdog. A full ring or arena is backpressure: commands wait here, in order. If the
GPU daemon dies (its pid is gone or its heartbeat stalls for `peer_timeout_s`), `on_dead`
is called once and the loop ends.

A bad ticket from the GPU daemon (a corrupt slot, or a payload that fails its CRC or does
not decode) is answered with CORRUPT naming its seq; the GPU daemon then fails that request
with DATA_LOSS. When the GPU daemon answers CORRUPT to one of ours, the request it carried
fails here (`on_lost`), or a command without payload is sent again.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog

from hybridgen.engine.request_output import RequestOutput
from hybridgen.ipc.channels import Channels, Message, Outbox, take_payload
from hybridgen.ipc.messages import decode_stats, decode_step_result
from hybridgen.ipc.peer import STALL_TIMEOUT_S, PeerWatch
from hybridgen.ipc.ticket import CorruptPayload, Op, Ticket
from hybridgen.runtime import sd_notify

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
        on_result: Callable[[RequestOutput], None],
        on_info: Callable[[dict[str, Any]], None],
        on_dead: Callable[[str], None],
        on_backpressure: Callable[[int, int], None],
        on_lost: Callable[[int, str], None],
        period_s: float = 0.002,
        peer_timeout_s: float = STALL_TIMEOUT_S,
    ) -> None:
        self.ch = channels
        self.on_result, self.on_info, self.on_dead = on_result, on_info, on_dead
        self.on_backpressure, self.on_lost = on_backpressure, on_lost
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
        for seq in self.ch.g2c.take_lost():
            self._reject(seq, "corrupt ticket (CRC, torn slot or unknown op)")
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
        try:
            self._dispatch(ticket, take_payload(self.ch.g2c_meta, ticket))
        except CorruptPayload as exc:
            log.warning("corrupt_payload", ring="g2c", seq=ticket.seq, error=str(exc))
            self._reject(ticket.seq, str(exc))

    def _dispatch(self, ticket: Ticket, payload: bytes) -> None:
        if ticket.op is Op.STEP_RESULT:
            self.on_result(
                decode_step_result(ticket.request_id, ticket.flags, ticket.shape, payload)
            )
        elif ticket.op is Op.STATS:
            self.on_info(decode_stats(payload))
        elif ticket.op is Op.BACKPRESSURE:
            self.on_backpressure(ticket.flags, ticket.shape[0])
        elif ticket.op is Op.CORRUPT:
            self._lost_on_peer(ticket.request_id, payload.decode(errors="replace"))
        else:
            log.warning("unexpected_ticket", op=ticket.op.name)

    def _reject(self, seq: int, why: str) -> None:
        """Tell the GPU daemon that its g2c ticket `seq` was bad."""
        self._outbox.append((Op.CORRUPT, seq, why[:256].encode(), 0, (0, 0, 0, 0)))

    def _lost_on_peer(self, seq: int, why: str) -> None:
        """The GPU daemon found our c2g ticket `seq` bad: fail its request, or send a
        command without payload again."""
        sent = self._outbox.sent_at(seq)
        log.warning("ticket_lost", ring="c2g", seq=seq, why=why, known=sent is not None)
        if sent is None:
            return
        op, rid, flags, shape, _ = sent
        if op in (Op.NEW_SEQ, Op.APPEND_TOKENS):
            self.on_lost(rid, f"its {op.name} ticket was corrupted on the way to the GPU daemon")
            self._outbox.append((Op.ABORT, rid, b"", 0, (0, 0, 0, 0)))  # it may hold KV
        else:  # ABORT, STATS, BACKPRESSURE, CORRUPT: idempotent, their payload optional
            self._outbox.append((op, rid, b"", flags, shape))
