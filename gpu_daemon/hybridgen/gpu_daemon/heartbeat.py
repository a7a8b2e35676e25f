"""The GPU daemon's heartbeat loop: tickets in, engine steps, step results out.

Every tick: take what the CPU daemon sent (waiting at most 16 ms when idle, not at all when
there is work), apply it to the engine, run one engine step if anything is running, publish
the results, bump the heartbeat and ping the systemd watchdog. When the engine cannot admit
waiting requests (no free KV blocks, or every sequence slot busy), a BACKPRESSURE ticket
tells the CPU side, and another one when that ends. A full ring or arena holds results here
in order; nothing is dropped. If the CPU daemon dies (its pid is gone or its heartbeat
stalls), every request is aborted and the loop exits non-zero so that systemd restarts both.
A bad ticket (corrupt slot or payload) is answered with CORRUPT naming its seq; a CORRUPT
for one of ours aborts the request it carried (DATA_LOSS) or sends the message again.

One step can take longer than the peers' heartbeat timeout: a kernel compiled for a new
shape, a prefill chunk over a long Warm prefix, a swap of thousands of blocks. While a step
runs, a side thread keeps the heartbeat and the systemd watchdog going, for up to
MAX_STEP_S; a step stuck beyond that stops the beats, and the CPU daemon (and systemd)
restart the pair as for a dead daemon.
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog

from hybridgen.engine.engine import Engine
from hybridgen.engine.info import counter_info, engine_info, memory_info, step_info
from hybridgen.engine.request_output import RequestOutput
from hybridgen.engine.step_errors import ErrorCode, StepFailed
from hybridgen.engine.validation import InvalidRequest, UncheckedRequest
from hybridgen.ipc.channels import Channels, Outbox, take_payload
from hybridgen.ipc.messages import (
    LAST_CHUNK,
    PROMPT_OPEN,
    decode_append,
    decode_new_seq,
    decode_prompt_chunk,
    encode_step_result,
)
from hybridgen.ipc.peer import STALL_TIMEOUT_S, PeerWatch
from hybridgen.ipc.ticket import CorruptPayload, Op, Ticket
from hybridgen.runtime import sd_notify
from hybridgen.runtime.percentile import p99

log = structlog.get_logger()

NO_KV_BLOCKS, NO_SEQ_SLOTS = 1, 2
"""BACKPRESSURE flags: why waiting requests cannot be admitted."""

PEER_DEAD = 3
"""Exit status when the CPU daemon died: systemd restarts the pair."""

MAX_STEP_S = 300.0
"""Longest one engine step is vouched for by the side thread (StepVouch)."""


class StepVouch:
    """While the loop is inside one engine step (`with vouch:`), calls `beat` every
    `period_s` for it, for up to `limit_s`."""

    def __init__(self, beat: Callable[[], None], period_s: float, limit_s: float) -> None:
        self._beat, self.period, self.limit = beat, period_s, limit_s
        self._since: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="step-vouch", daemon=True)
        self.beats = 0
        """Beats sent for steps so far."""

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def __enter__(self) -> None:
        self._since = time.monotonic()

    def __exit__(self, *exc: object) -> None:
        self._since = None

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            since = self._since
            if since is not None and time.monotonic() - since < self.limit:
                self._beat()
                self.beats += 1


@dataclass
class HeartbeatStats:
    ticks: int = 0
    steps: int = 0
    tickets_in: int = 0
    results_out: int = 0
    backpressure: int = 0
    """BACKPRESSURE tickets sent (each start and end of a period the engine was full)."""
    ring_full: int = 0
    """Ticks that found g2c (or its arena) full: results waited here, none was dropped."""
    max_tick_gap_ms: float = 0.0
    """Longest time between two ticks: the reaction latency bound actually achieved."""
    jitter_ms: deque[float] = field(default_factory=lambda: deque(maxlen=4096))
    """Idle wake-up lateness past the period, for the heartbeat-jitter metric."""


class GpuHeartbeat:
    def __init__(
        self,
        engine: Engine,
        channels: Channels,
        period_s: float = 0.016,
        peer_timeout_s: float = STALL_TIMEOUT_S,
    ) -> None:
        self.engine, self.ch = engine, channels
        self.period = period_s
        self.stats = HeartbeatStats()
        self.outbox = Outbox(channels.g2c, channels.g2c_meta)
        self.stopping = False
        self.defer_sampling = True
        """When the engine samples on the host (placements.sample: cpu, or degraded), the CPU
        daemon picks tokens from the candidates this daemon sends."""
        self.backpressure = 0
        """Reasons the engine cannot take work (NO_KV_BLOCKS | NO_SEQ_SLOTS), as last sent."""
        self._peer = PeerWatch(channels.c2g, "CPU daemon", peer_timeout_s)
        self._attached = False
        self._last_tick = time.monotonic()
        self._watchdog = sd_notify.watchdog_interval_s()
        self._last_ping = 0.0
        self._lock = threading.Lock()
        """Serializes the loop's beats and the vouch thread's."""
        self.vouch = StepVouch(self._vouch_beat, min(0.1, peer_timeout_s / 4), MAX_STEP_S)

    def run(self) -> int:
        """Tick until SHUTDOWN or a dead peer; returns the process exit status."""
        self.vouch.start()
        try:
            while not self.stopping:
                if not self.tick():
                    return PEER_DEAD
            return 0
        finally:
            self.vouch.stop()

    def tick(self) -> bool:
        busy = self.engine.has_unfinished() or bool(self.outbox)
        wait = 0.0 if busy else self.period
        t0 = time.monotonic()
        first = self.ch.c2g.get(wait)
        if first is None and wait:
            self.stats.jitter_ms.append(max(0.0, (time.monotonic() - t0 - wait) * 1e3))
        tickets = ([first] if first else []) + self.ch.c2g.drain(256)
        for ticket in tickets:
            self._handle(ticket)
        for seq in self.ch.c2g.take_lost():
            self._reject(seq, "corrupt ticket (CRC, torn slot or unknown op)")
        if self.engine.has_unfinished():
            # Each decode step's tokens leave as soon as they are on the host, not at the end
            # of a multi-step batch: the CPU daemon streams them while the device goes on.
            with self.vouch:
                for outputs in self.engine.steps(defer_sampling=self.defer_sampling):
                    for out in outputs:
                        self._send_result(out)
                    self._flush()
            self.stats.steps += 1
        self._signal_backpressure()
        self._flush()
        self._beat()
        return self._peer_alive()

    def _handle(self, ticket: Ticket) -> None:
        self.stats.tickets_in += 1
        try:
            self._apply(ticket, take_payload(self.ch.c2g_meta, ticket))
        except CorruptPayload as e:
            log.warning("corrupt_payload", ring="c2g", seq=ticket.seq, error=str(e))
            self._reject(ticket.seq, str(e))

    def _apply(self, ticket: Ticket, payload: bytes) -> None:
        rid = ticket.request_id
        if ticket.op is Op.NEW_SEQ:
            prompt, params = decode_new_seq(payload)
            try:
                self.engine.add_request(str(rid), prompt, params, bool(ticket.flags & PROMPT_OPEN))
            except UncheckedRequest as e:  # the CPU daemon validated it: a bug there
                self._send_result(_refused(rid, e, len(prompt)))
        elif ticket.op is Op.APPEND_PROMPT:
            self._extend_prompt(ticket, decode_prompt_chunk(payload))
        elif ticket.op is Op.APPEND_TOKENS:
            token, logprob = decode_append(payload)
            try:
                self._send_result(self.engine.accept_token(str(rid), token, logprob))
            except InvalidRequest as e:  # aborted meanwhile: the pick has nobody to go to
                log.info("token_not_awaited", request_id=rid, reason=str(e))
        elif ticket.op is Op.ABORT:
            self.engine.abort(str(rid))
        elif ticket.op is Op.BACKPRESSURE:  # the CPU daemon's degrade command (flags: on)
            self.engine.degrade.set(bool(ticket.flags))
        elif ticket.op is Op.STATS:
            self._send_stats()
        elif ticket.op is Op.CORRUPT:
            self._lost_on_peer(rid, payload.decode(errors="replace"))
        elif ticket.op is Op.SHUTDOWN:
            self.stopping = True
        else:
            log.warning("unexpected_ticket", op=ticket.op.name, request_id=rid)

    def _send_stats(self) -> None:
        info = dict(
            engine_info(self.engine),
            **counter_info(self.engine),
            **step_info(self.engine),
            **memory_info(self.engine.device),
            **self.engine.degrade.info(),
            kv_blocks_used=self.engine.pool.num_used,
            running_requests=len(self.engine.seqs),
            ring_occupancy_c2g=self.ch.c2g.occupancy() / self.ch.c2g.capacity,
            gpu_heartbeat_jitter_p99_ms=p99(self.stats.jitter_ms),
        )
        self.outbox.append((Op.STATS, 0, json.dumps(info).encode(), 0, (0, 0, 0, 0)))

    def _reject(self, seq: int, why: str) -> None:
        """Tell the CPU daemon that its c2g ticket `seq` was bad."""
        self.outbox.append((Op.CORRUPT, seq, why[:256].encode(), 0, (0, 0, 0, 0)))

    def _lost_on_peer(self, seq: int, why: str) -> None:
        """The CPU daemon found our g2c ticket `seq` bad: abort the request it carried and
        say so (DATA_LOSS), or send the message again."""
        sent = self.outbox.sent_at(seq)
        log.warning("ticket_lost", ring="g2c", seq=seq, why=why, known=sent is not None)
        if sent is None:
            return
        op, rid, flags, shape, _ = sent
        if op is Op.STEP_RESULT:
            self.engine.abort(str(rid))
            lost = "its STEP_RESULT ticket was corrupted on the way to the CPU daemon"
            prompt, output = shape[1], shape[2]
            error = StepFailed(ErrorCode.DATA_LOSS, lost)
            self._send_result(RequestOutput.failed(str(rid), error, prompt, output))
        elif op is Op.STATS:
            self._send_stats()
        else:  # BACKPRESSURE, CORRUPT: idempotent, their payload optional
            self.outbox.append((op, rid, b"", flags, shape))

    def _extend_prompt(self, ticket: Ticket, token_ids: list[int]) -> None:
        """A chunk of an open prompt; one that breaks what the CPU daemon's checks guarantee
        ends its request (INTERNAL)."""
        rid, keep = ticket.request_id, ticket.shape[1]
        try:
            self.engine.extend_prompt(str(rid), keep, token_ids, bool(ticket.flags & LAST_CHUNK))
        except (InvalidRequest, UncheckedRequest) as e:
            seq = self.engine.seqs.get(str(rid))
            if seq is None:  # aborted meanwhile: nobody waits for an answer
                log.info("prompt_chunk_dropped", request_id=rid, reason=str(e))
                return
            self.engine.abort(str(rid))
            self._send_result(_refused(rid, e, seq.prompt_len))

    def _signal_backpressure(self) -> None:
        """Tell the CPU daemon when requests wait because the engine cannot take them (no
        free KV blocks, or every sequence slot busy), and again when that ends."""
        sched, reasons = self.engine.scheduler, 0
        if sched.waiting:
            if sched.kv_short:
                reasons |= NO_KV_BLOCKS
            if len(sched.running) >= sched.config.max_num_seqs:
                reasons |= NO_SEQ_SLOTS
        if reasons != self.backpressure:
            self.backpressure = reasons
            self.stats.backpressure += 1
            self.outbox.append((Op.BACKPRESSURE, 0, b"", reasons, (len(sched.waiting), 0, 0, 0)))

    def _send_result(self, result: RequestOutput) -> None:
        payload, flags, shape = encode_step_result(result)
        self.outbox.append((Op.STEP_RESULT, int(result.request_id), payload, flags, shape))

    def _flush(self) -> None:
        sent = self.outbox.sent
        full = self.outbox.flush()
        self.stats.results_out += self.outbox.sent - sent
        if full is not None:
            self._ring_full(f"g2c {full}")

    def _ring_full(self, reason: str) -> None:
        self.stats.ring_full += 1
        if self.stats.ring_full % 1000 == 1:
            log.warning("ring_full", reason=reason, queued=len(self.outbox))

    def _beat(self) -> None:
        now = time.monotonic()
        self.stats.ticks += 1
        self.stats.max_tick_gap_ms = max(self.stats.max_tick_gap_ms, (now - self._last_tick) * 1e3)
        self._last_tick = now
        self._vouch_beat()

    def _vouch_beat(self) -> None:
        """Bump the heartbeat the CPU daemon watches, and ping systemd's watchdog when due."""
        with self._lock:
            self.ch.g2c.heartbeat()
            now = time.monotonic()
            if self._watchdog and now - self._last_ping >= self._watchdog:
                sd_notify.watchdog()
                self._last_ping = now

    def _peer_alive(self) -> bool:
        """False when the CPU daemon died. When it detached cleanly, its requests are
        aborted (nobody will read their results) and the loop waits for the next one."""
        reason = self._peer.dead()
        attached = self.ch.c2g.producer_pid() != 0
        if reason is not None or (self._attached and not attached):
            if reason is not None:
                log.error("peer_dead", peer="cpu_daemon", reason=reason)
            for rid in list(self.engine.seqs):
                self.engine.abort(rid)
        self._attached = attached
        return reason is None


def _refused(rid: int, error: Exception, prompt_tokens: int) -> RequestOutput:
    """The engine would not take the request: it reached it unchecked (a bug in the CPU
    daemon, whose checks answer clients INVALID_ARGUMENT), so INTERNAL."""
    log.error("unchecked_request", request_id=rid, error=str(error))
    return RequestOutput.failed(str(rid), StepFailed(ErrorCode.INTERNAL, str(error)), prompt_tokens)
