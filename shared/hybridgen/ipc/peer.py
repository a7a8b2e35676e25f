"""Noticing that the daemon on the other end of a ring died: its process is gone (or a zombie
waiting to be reaped), or its heartbeat counter stopped moving for longer than a timeout."""

from __future__ import annotations

import os
import time
from pathlib import Path

from hybridgen.ipc.ring import Ring

STALL_TIMEOUT_S = 10.0
"""A peer whose heartbeat has not moved for this long is taken as hung. Far longer than any
bounded work a heartbeat loop does between beats (a step beyond it is vouched for by the GPU
daemon's StepVouch, tokenization runs off the loops), so one busy request never trips it; a
peer that exits or is killed is seen at once through its process state."""


def pid_alive(pid: int) -> bool:
    """Whether `pid` runs: it exists and is not a zombie (exited, not yet reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by another user
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:  # no procfs (kill said it exists), or it exited just now: next look
        return True
    # The state letter follows the parenthesised command name, which may contain ')'.
    end = stat.rindex(b")")
    return stat[end + 2 : end + 3] not in (b"Z", b"X")


def started_before(pid: int, time_ns: int) -> bool:
    """Whether process `pid` started before wall-clock `time_ns` (give or take 2 s: boot time
    is kept in whole seconds); True when that cannot be read, so a caller errs on the side of
    a live owner. A pid that started later is a reused pid, not the one that left `time_ns`."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
        boot = next(
            int(line.split()[1])
            for line in Path("/proc/stat").read_text().splitlines()
            if line.startswith("btime ")
        )
    except (OSError, StopIteration, ValueError):
        return True
    ticks = int(stat[stat.rindex(b")") + 2 :].split()[19])  # field 22: starttime
    started_ns = (boot + ticks / os.sysconf("SC_CLK_TCK")) * 1e9
    return started_ns <= time_ns + 2e9


class PeerWatch:
    """Watches the producer of `ring` (the peer daemon). Until a producer has claimed the
    ring there is nobody to watch, so the peer counts as alive."""

    def __init__(self, ring: Ring, name: str, timeout_s: float = STALL_TIMEOUT_S) -> None:
        self.ring, self.name, self.timeout = ring, name, timeout_s
        self._beat, self._seen = -1, time.monotonic()

    def dead(self) -> str | None:
        """Why the peer is considered dead, or None while it is alive."""
        pid, beat, now = self.ring.producer_pid(), self.ring.peer_heartbeat(), time.monotonic()
        if pid == 0:
            return None
        if beat != self._beat:
            self._beat, self._seen = beat, now
        if not pid_alive(pid):
            return f"the {self.name} (pid {pid}) is gone"
        if now - self._seen > self.timeout:
            return f"the {self.name}'s heartbeat stalled for {now - self._seen:.1f} s"
        return None
