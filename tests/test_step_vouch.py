"""A long engine step must not look like a dead GPU daemon: while one step runs, a side
thread keeps the heartbeat going (gpu_daemon.heartbeat.StepVouch), for up to a limit."""

from __future__ import annotations

import threading
import time
import uuid

from hybridgen.config.engine import EngineConfig
from hybridgen.engine.engine import Engine
from hybridgen.gpu_daemon.heartbeat import GpuHeartbeat, StepVouch
from hybridgen.ipc import shm
from hybridgen.ipc.channels import Channels, make_ticket, take_payload
from hybridgen.ipc.messages import decode_step_result, encode_new_seq
from hybridgen.ipc.peer import PeerWatch
from hybridgen.ipc.ticket import Op
from hybridgen.sampling.params import SamplingParams

SLOW_STEP_S = 1.5
PEER_TIMEOUT_S = 0.4


def test_vouch_beats_only_inside_a_step_and_within_its_limit() -> None:
    beats: list[float] = []
    vouch = StepVouch(lambda: beats.append(time.monotonic()), 0.02, 0.3)
    vouch.start()
    time.sleep(0.15)
    assert beats == []  # no step running: the loop beats for itself
    with vouch:
        time.sleep(0.6)
    n = len(beats)
    vouch.stop()
    assert 8 <= n <= 16  # about 0.3 s of 0.02 s beats, then none: a stuck step is not covered
    assert beats[-1] - beats[0] < 0.35


def test_a_step_longer_than_the_peer_timeout_keeps_the_daemon_alive() -> None:
    instance = f"t{uuid.uuid4().hex[:12]}"
    ch = Channels.create(instance)
    engine = Engine(EngineConfig(model="tiny-llama", device="cpu"))
    steps = engine.steps  # what the loop runs since the engine yields each decode step

    def slow_steps(defer_sampling: bool = False):  # type: ignore[no-untyped-def]
        time.sleep(SLOW_STEP_S)  # a kernel compiling for a new shape, say
        yield from steps(defer_sampling)

    engine.steps = slow_steps  # type: ignore[method-assign]
    loop = GpuHeartbeat(engine, ch, peer_timeout_s=PEER_TIMEOUT_S)
    status: list[int] = []
    thread = threading.Thread(target=lambda: status.append(loop.run()), daemon=True)
    watch = PeerWatch(ch.g2c, "GPU daemon", PEER_TIMEOUT_S)
    try:
        ch.c2g.heartbeat()
        thread.start()
        params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
        ticket = make_ticket(ch.c2g_meta, Op.NEW_SEQ, 1, encode_new_seq([5, 6, 7], params))
        assert ticket is not None and ch.c2g.put(ticket, timeout=5.0)
        tokens: list[int] = []
        deadline = time.monotonic() + 30
        while len(tokens) < 2:
            assert time.monotonic() < deadline
            ch.c2g.heartbeat()  # the test is the CPU daemon: it beats and watches
            assert watch.dead() is None
            got = ch.g2c.get(0.01)
            if got is not None and got.op is Op.STEP_RESULT:
                payload = take_payload(ch.g2c_meta, got)
                tokens += decode_step_result(
                    got.request_id, got.flags, got.shape, payload
                ).new_token_ids
        assert loop.vouch.beats >= 2 * SLOW_STEP_S / 0.1 * 0.7  # two steps of ~15 beats each
        shutdown = make_ticket(ch.c2g_meta, Op.SHUTDOWN, 0, b"")
        assert shutdown is not None and ch.c2g.put(shutdown, timeout=5.0)
        thread.join(timeout=30)
        assert status == [0]
    finally:
        # The loop must be off the rings before they are unmapped: a failed assertion above
        # otherwise left it reading freed memory, and the segfault ended the whole run.
        loop.stopping = True
        thread.join(timeout=30)
        ch.close()
        shm.unlink_all(instance)
