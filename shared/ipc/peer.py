"""Noticing that the daemon on the other end of a ring died: its pid is gone, or its
heartbeat counter stopped moving for longer than a timeout."""

from __future__ import annotations

import os
import time

from hybridgen.ipc.ring import Ring


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by another user
        return True
    return True


class PeerWatch:
    """Watches the producer of `ring` (the peer daemon). Until a producer has claimed the
    ring there is nobody to watch, so the peer counts as alive."""

    def __init__(self, ring: Ring, name: str, timeout_s: float = 2.0) -> None:
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
