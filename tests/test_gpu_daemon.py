"""The GPU daemon as a real process, driven over the shared-memory rings by this test acting
as the CPU daemon."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from hybridgen.config.engine import EngineConfig
from hybridgen.engine.engine import Engine
from hybridgen.engine.request_output import RequestOutput
from hybridgen.engine.sequence import FinishReason
from hybridgen.engine.step_errors import ErrorCode
from hybridgen.gpu_daemon.heartbeat import NO_SEQ_SLOTS, PEER_DEAD
from hybridgen.ipc.channels import Channels, make_ticket, take_payload
from hybridgen.ipc.messages import decode_step_result, encode_new_seq
from hybridgen.ipc.ticket import Op, Ticket
from hybridgen.sampling.params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def start_daemon(
    instance: str, log_path: Path, config: Path | None = None
) -> subprocess.Popen[bytes]:
    module = "hybridgen.gpu_daemon.main"
    args = ["--model", "tiny-llama", "--instance", instance, "--device", "cpu"]
    args += ["--config", str(config)] if config else []
    return subprocess.Popen([sys.executable, "-m", module, *args], stderr=log_path.open("wb"))


def wait_ready(log_path: Path, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while "gpu_daemon_ready" not in log_path.read_text():
        assert time.monotonic() < deadline, log_path.read_text()
        time.sleep(0.05)


def segments(instance: str) -> list[str]:
    return [p.name for p in Path("/dev/shm").glob(f"*hybridgen-{instance}-*")]


@pytest.fixture
def daemon(
    tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[tuple[subprocess.Popen[bytes], Channels, str]]:
    instance = f"t{uuid.uuid4().hex[:12]}"
    log_path = tmp_path / "gpu_daemon.log"
    config = None
    if hasattr(request, "param"):  # YAML text of a config for this daemon
        config = tmp_path / "hybridgen_config.yaml"
        config.write_text(request.param)
    proc = start_daemon(instance, log_path, config)
    channels = Channels.attach(instance, wait=60.0)
    wait_ready(log_path)
    yield proc, channels, instance
    channels.close()
    if proc.poll() is None:
        proc.terminate()  # a clean stop: the daemon removes its segments itself
        proc.wait(timeout=30)
    assert segments(instance) == [], "the daemon left shared memory behind"


def send(ch: Channels, op: Op, rid: int, payload: bytes = b"", shape=(0, 0, 0, 0)) -> None:  # type: ignore[no-untyped-def]
    ticket = make_ticket(ch.c2g_meta, op, rid, payload, shape=shape)
    assert ticket is not None and ch.c2g.put(ticket, timeout=5.0)


def collect(
    ch: Channels, want: set[int], timeout: float = 120.0, events: list[Ticket] | None = None
) -> dict[int, list[RequestOutput]]:
    """Step results until every request in `want` finished, heartbeating like a CPU daemon;
    other tickets go to `events`."""
    results: dict[int, list[RequestOutput]] = {}
    deadline = time.monotonic() + timeout
    while want - {r for r, rs in results.items() if rs[-1].finished}:
        assert time.monotonic() < deadline, f"timed out; got {sorted(results)}"
        ch.c2g.heartbeat()
        ticket = ch.g2c.get(0.002)
        if ticket is None:
            continue
        payload = take_payload(ch.g2c_meta, ticket)
        if ticket.op is not Op.STEP_RESULT:
            if events is not None:
                events.append(ticket)
            continue
        res = decode_step_result(ticket.request_id, ticket.flags, ticket.shape, payload)
        results.setdefault(int(res.request_id), []).append(res)
    return results


@pytest.mark.slow
def test_serves_requests_over_rings_and_cleans_up(daemon) -> None:  # type: ignore[no-untyped-def]
    prompts = [[5, 6, 7], list(range(1, 60)), [300, 301, 302, 303]]
    expected = Engine(EngineConfig(model="tiny-llama", device="cpu")).generate(prompts, GREEDY)
    proc, ch, instance = daemon  # from here on, heartbeat at least every 2 s or be declared dead
    for rid, prompt in enumerate(prompts, start=1):
        send(ch, Op.NEW_SEQ, rid, encode_new_seq(prompt, GREEDY), (len(prompt), 0, 0, 0))
    send(ch, Op.NEW_SEQ, 99, encode_new_seq([1, 100_000], GREEDY), (2, 0, 0, 0))
    results = collect(ch, {1, 2, 3, 99})
    refused = results[99][-1].error  # the CPU daemon checks ids: one it did not is a bug there
    assert refused is not None and refused.code is ErrorCode.INTERNAL
    assert "prompt_token_ids" in str(refused)
    for rid, completion in enumerate(expected, start=1):
        tokens = [t for r in results[rid] for t in r.new_token_ids]
        assert tokens == completion.token_ids
        assert results[rid][-1].finish_reason is FinishReason.LENGTH
    send(ch, Op.SHUTDOWN, 0)
    assert proc.wait(timeout=30) == 0
    assert segments(instance) == [], "a clean stop leaves nothing in /dev/shm"


@pytest.mark.slow
def test_abort_stops_a_request(daemon) -> None:  # type: ignore[no-untyped-def]
    proc, ch, _ = daemon
    long = SamplingParams(temperature=0.0, max_tokens=2000, ignore_eos=True)
    send(ch, Op.NEW_SEQ, 1, encode_new_seq([1, 2, 3], long), (3, 0, 0, 0))
    send(ch, Op.NEW_SEQ, 2, encode_new_seq([4, 5], GREEDY), (2, 0, 0, 0))
    got = collect(ch, {2})
    assert sum(len(r.new_token_ids) for r in got[2]) == 16
    send(ch, Op.ABORT, 1)
    send(ch, Op.NEW_SEQ, 3, encode_new_seq([7, 8], GREEDY), (2, 0, 0, 0))
    later = collect(ch, {3})
    assert 1 not in later or not later[1][-1].finished, "aborted: no more results"
    assert proc.poll() is None


@pytest.mark.slow
def test_dead_cpu_daemon_stops_the_gpu_daemon(daemon) -> None:  # type: ignore[no-untyped-def]
    proc, ch, instance = daemon
    peer = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import time; from hybridgen.ipc.channels import Channels; "
                f"ch = Channels.attach('{instance}', wait=30); ch.c2g.heartbeat(); time.sleep(60)"
            ),
        ]
    )
    deadline = time.monotonic() + 60
    while ch.c2g.producer_pid() != peer.pid:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    peer.kill()
    peer.wait()
    killed = time.monotonic()
    assert proc.wait(timeout=30) == PEER_DEAD
    assert time.monotonic() - killed < 2.5
    assert segments(instance) == []
    assert os.environ.get("NOTIFY_SOCKET") is None


@pytest.mark.slow
@pytest.mark.parametrize("daemon", ["model:\n  max_num_seqs: 1\n"], indirect=True)
def test_backpressure_is_signalled_and_released(daemon) -> None:  # type: ignore[no-untyped-def]
    """With one sequence slot, a second request must wait: the GPU daemon says so with a
    BACKPRESSURE ticket, then releases it once the first request is done."""
    _, ch, _ = daemon
    for rid in (1, 2):
        send(ch, Op.NEW_SEQ, rid, encode_new_seq([5, 6, 7], GREEDY), (3, 0, 0, 0))
    events: list[Ticket] = []
    collect(ch, {1, 2}, events=events)
    signals = [(t.flags, t.shape[0]) for t in events if t.op is Op.BACKPRESSURE]
    assert signals[0] == (NO_SEQ_SLOTS, 1), signals
    assert signals[-1][0] == 0, "backpressure must be released when the slot frees"


@pytest.mark.slow
@pytest.mark.parametrize("daemon", ['device_topology:\n  cpu:\n    cores: "0"\n'], indirect=True)
def test_daemon_binds_to_the_configured_cores(daemon, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """device_topology.cpu.cores binds the daemon (its worker threads with it); cores this
    process may not use stop it at once with an error naming the key."""
    proc, _, _ = daemon
    assert os.sched_getaffinity(proc.pid) == {0}
    config = tmp_path / "bad.yaml"
    config.write_text('device_topology:\n  cpu:\n    cores: "4000-4001"\n')
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "hybridgen.gpu_daemon.main",
            "--model",
            "tiny-llama",
            "--instance",
            f"t{uuid.uuid4().hex[:12]}",
            "--device",
            "cpu",
            "--config",
            str(config),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2
    assert "device_topology.cpu.cores='4000-4001' is out of range" in bad.stderr
