"""Children started ahead of their turn (ChildSpec.prestart, runtime/prestart.py): a spare
does its imports while the child before it starts, and does nothing of its own start before
the go; a spare whose turn never comes leaves nothing behind; one that died early is replaced
by a fresh process at its turn. Stand-in children, no model."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

from hybridgen.cli.supervisor import ChildSpec, Supervisor
from hybridgen.ipc.peer import pid_alive
from tests.test_cli import FAST, run_supervisor

# A stand-in that "imports" for `delay` seconds (noted as "loaded"), waits for its go when a
# supervisor started it ahead, then notes its start and says READY=1 (after `ready_s` more).
PRESTART = r"""
import os, socket, sys, time
name, events, delay, ready_s, die = sys.argv[1:6]
def note(what):
    with open(events, "a") as f:
        f.write(f"{what} {name} {os.getpid()} {time.monotonic():.3f}\n")
time.sleep(float(delay))
if os.path.exists(die):  # a marker file: die once, before the go
    os.remove(die)
    note("died")
    sys.exit(1)
note("loaded")
from hybridgen.runtime.prestart import wait_for_go
wait_for_go()
note("start")
time.sleep(float(ready_s))
with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
    s.sendto(b"READY=1", os.environ["NOTIFY_SOCKET"])
while True:
    time.sleep(0.05)
"""


def child(
    name: str, events: Path, delay: float, ready_s: float, prestart: bool, die: str = "-"
) -> ChildSpec:
    argv = (sys.executable, "-c", PRESTART, name, str(events), str(delay), str(ready_s), die)
    return ChildSpec(name, argv, prestart=prestart)


def timeline(events: Path) -> dict[tuple[str, str], tuple[int, float]]:
    """(what, name) -> (pid, monotonic time) of each event (the last of its kind)."""
    rows = [line.split() for line in events.read_text().splitlines()]
    return {(what, name): (int(pid), float(t)) for what, name, pid, t in rows}


def test_a_spare_imports_ahead_and_starts_at_its_turn(tmp_path: Path) -> None:
    """First takes 1 s to import and 1 s more to be ready; second 1 s to import. Started
    ahead, second's import overlaps first's start, and its own start waits for first."""
    events = tmp_path / "events"
    specs = [child("first", events, 1.0, 1.0, False), child("second", events, 1.0, 0.0, True)]
    t0 = time.monotonic()
    ready: list[float] = []

    def on_ready(sup: Supervisor, n: int) -> None:
        ready.append(time.monotonic())
        sup.request_stop()

    status, lines = run_supervisor(specs, tmp_path, on_ready, FAST)
    assert status == 0, lines
    t = timeline(events)
    assert t[("loaded", "second")][1] < t[("start", "first")][1] + 0.9  # imported meanwhile
    first_ready = next(i for i, line in enumerate(lines) if line.startswith("first ready"))
    went = next(i for i, line in enumerate(lines) if line.startswith("started second"))
    assert went > first_ready and lines[went].endswith("(imports done ahead)"), lines
    assert t[("start", "second")][1] >= t[("start", "first")][1] + 0.9  # not before its turn
    assert t[("start", "second")][0] == t[("loaded", "second")][0]  # the spare itself
    assert ready[0] - t0 < 2.9, lines  # in order, one after the other: 3 s


def test_a_spare_whose_turn_never_comes_leaves_nothing(tmp_path: Path) -> None:
    events = tmp_path / "events"
    specs = [child("first", events, 0.0, 30.0, False), child("second", events, 0.2, 0.0, True)]
    sup = Supervisor(specs, tmp_path, FAST, report=lambda line: None)

    def stop_soon() -> None:
        time.sleep(1.0)  # the spare has loaded and waits; first is still starting
        sup.request_stop()

    threading.Thread(target=stop_soon, daemon=True).start()
    assert sup.run() == 0
    t = timeline(events)
    spare = t[("loaded", "second")][0]
    assert ("start", "second") not in t  # it never began its own start
    deadline = time.monotonic() + 5
    while pid_alive(spare) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pid_alive(spare)


def test_a_spare_that_died_is_replaced_at_its_turn(tmp_path: Path) -> None:
    events, marker = tmp_path / "events", tmp_path / "die-once"
    marker.touch()
    specs = [
        child("first", events, 0.0, 0.5, False),
        child("second", events, 0.0, 0.0, True, str(marker)),
    ]

    def on_ready(sup: Supervisor, n: int) -> None:
        sup.request_stop()

    status, lines = run_supervisor(specs, tmp_path, on_ready, FAST)
    assert status == 0, lines
    t = timeline(events)
    assert t[("died", "second")][0] != t[("start", "second")][0]  # a fresh process started
    started = [line for line in lines if line.startswith("started second")]
    assert started == [f"started second (pid {t[('start', 'second')][0]})"], lines
