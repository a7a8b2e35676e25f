"""The supervisor owns its children: they die with it (even by SIGKILL), only the child's own
pid can say it is ready, the instance lock lives as long as any of them, and a serve beside
a live process of its instance refuses to start, naming it. Stand-in children, no model."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from hybridgen.cli.main import main
from hybridgen.cli.supervisor import ChildSpec, Policy, Supervisor, lock_holders
from hybridgen.ipc.peer import pid_alive
from tests.test_cli import FAST, STAND_IN, read_events, run_supervisor, stand_in
from tests.test_gpu_daemon import daemon  # noqa: F401 - a fixture

# A stand-in whose READY=1 comes from a process it forks, never from itself, until it is
# sent SIGUSR1: a leftover of an earlier run looks like this to the notify socket.
PROXY_READY = r"""
import os, signal, socket, sys, time
events = sys.argv[1]
def ready(*_):
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.sendto(b"READY=1", os.environ["NOTIFY_SOCKET"])
signal.signal(signal.SIGUSR1, ready)
with open(events, "a") as f:
    f.write(f"start proxy {os.getpid()}\n")
if os.fork() == 0:
    ready()
    os._exit(0)
os.wait()
while True:
    time.sleep(0.05)
"""


def test_ready_counts_only_from_the_childs_own_pid(tmp_path: Path) -> None:
    events = tmp_path / "events"
    spec = ChildSpec("proxy", (sys.executable, "-c", PROXY_READY, str(events)))
    ready_at: list[float] = []
    start = time.monotonic()

    def on_ready(sup: Supervisor, n: int) -> None:
        ready_at.append(time.monotonic() - start)
        sup.request_stop()

    def nudge() -> None:  # after 1.5 s, the child itself says READY=1
        time.sleep(1.5)
        pid = next(pid for what, _, pid in read_events(events) if what == "start")
        os.kill(pid, signal.SIGUSR1)

    threading.Thread(target=nudge, daemon=True).start()
    status, lines = run_supervisor([spec], tmp_path, on_ready, FAST)
    assert status == 0
    assert ready_at and ready_at[0] >= 1.5, (ready_at, lines)
    assert any("ignored a notification from pid" in line for line in lines), lines


SUPERVISE = r"""
import sys
from pathlib import Path
from hybridgen.cli.supervisor import ChildSpec, Policy, Supervisor
rt, events, stand_in = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
lock = open(rt / "serve.lock", "ab")
specs = [
    ChildSpec(name, (sys.executable, "-c", stand_in, name, events, "0"))
    for name in ("gpu", "cpu", "gateway")
]
policy = Policy(poll_s=0.02)
Supervisor(specs, rt, policy, report=lambda s: None, inherit_fds=(lock.fileno(),)).run()
"""


def test_children_die_with_a_supervisor_killed_by_sigkill(tmp_path: Path) -> None:
    events = tmp_path / "events"
    supervisor = subprocess.Popen(
        [sys.executable, "-c", SUPERVISE, str(tmp_path), str(events), STAND_IN]
    )
    try:
        deadline = time.monotonic() + 30
        while len(read_events(events)) < 3:
            assert time.monotonic() < deadline and supervisor.poll() is None
            time.sleep(0.05)
        children = [pid for _, _, pid in read_events(events)]
        holders = set(lock_holders(tmp_path / "serve.lock"))
        assert holders == {supervisor.pid, *children}, "each process holds the instance lock"
        os.kill(supervisor.pid, signal.SIGKILL)
        killed = time.monotonic()
        supervisor.wait()
        while any(pid_alive(pid) for pid in children):
            assert time.monotonic() - killed < 2.0, [p for p in children if pid_alive(p)]
            time.sleep(0.02)
        with open(tmp_path / "serve.lock", "ab") as lock:  # nobody holds it any more
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        if supervisor.poll() is None:
            supervisor.kill()


HOLD = r"""
import fcntl, sys, time
f = open(sys.argv[1], "ab")
fcntl.flock(f, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(60)
"""


def test_serve_refuses_while_a_process_of_the_instance_lives(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    instance = f"lk{os.getpid()}"
    config = tmp_path / "hybridgen_config.yaml"
    config.write_text(f"server:\n  instance: {instance}\n  runtime_dir: {tmp_path}\n")
    (tmp_path / instance).mkdir(mode=0o700)
    lock = tmp_path / instance / "serve.lock"
    # A process of the instance left running (it holds the lock it inherited).
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(lock)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        start = time.monotonic()
        assert main(["serve", "--config", str(config), "--device", "cpu"]) == 2
        assert time.monotonic() - start < 5
        err = capsys.readouterr().err
        assert f"instance '{instance}' is still running (pids {holder.pid}" in err, err
    finally:
        holder.kill()
        holder.wait()


def test_policy_stop_timeout_outlasts_the_gateways_drain() -> None:
    from hybridgen.serving.server import DRAIN_GRACE_S

    assert Policy().stop_timeout_s > DRAIN_GRACE_S
    assert Policy().drain_s == DRAIN_GRACE_S  # what a stop announces


def test_a_second_stop_request_stops_a_draining_child_at_once(tmp_path: Path) -> None:
    """A child slow to stop (it ignores SIGTERM, as a gateway draining its streams waits): the
    first Ctrl-C says how long running requests get and how to stop at once; a second one,
    while waiting, kills it instead of waiting out stop_timeout_s."""
    events = tmp_path / "events"
    slow = stand_in("gateway", events, ignore_term=True)
    policy = Policy(stop_timeout_s=30.0, poll_s=0.02)
    stopped_at: list[float] = []

    def on_ready(sup: Supervisor, n: int) -> None:
        sup.request_stop(signal.SIGINT)

        def again() -> None:
            time.sleep(0.5)
            stopped_at.append(time.monotonic())
            sup.request_stop(signal.SIGINT)

        threading.Thread(target=again, daemon=True).start()

    status, lines = run_supervisor([slow], tmp_path, on_ready, policy)
    took = time.monotonic() - stopped_at[0]
    assert status == 0 and took < 5.0, (took, lines)
    assert any("received SIGINT, stopping: running requests get up to 10 s" in x for x in lines)
    assert any("SIGINT again stops at once" in x for x in lines)
    assert any("stopping gateway now (a second stop request)" in x for x in lines), lines
    assert any("stopped gateway (killed by SIGKILL)" in x for x in lines)


def test_shared_memory_is_replaced_only_when_its_owner_is_gone(daemon, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    proc, ch, instance = daemon
    argv = ["--model", "tiny-llama", "--instance", instance, "--device", "cpu"]
    second = subprocess.run(
        [sys.executable, "-m", "hybridgen.gpu_daemon.main", *argv],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert second.returncode == 2, second.stderr
    assert f"belongs to the running process {proc.pid}" in second.stdout + second.stderr
    assert ch.c2g.still_current(), "the live daemon's rings were left alone"
    assert proc.poll() is None
