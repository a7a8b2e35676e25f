"""How a daemon ends on a start-up error that a restart cannot fix: bad arguments or config, a
model that is not there, a budget too small for it, a port another program holds.

It exits with EXIT_STARTUP after saying why twice: one line on stderr (its log) and the same
as its sd_notify status, prefixed STATUS_PREFIX. `hybridgen serve` then stops at once and
prints that line instead of restarting the daemon, and systemd does not restart the unit
(RestartPreventExitStatus=2). Crashes after start-up have other exit statuses and are
restarted.
"""

from __future__ import annotations

import sys

from hybridgen.runtime import sd_notify

__all__ = ["EXIT_STARTUP", "STATUS_PREFIX", "startup_failed"]

EXIT_STARTUP = 2
"""The exit status of a start-up error (argparse's, too, for bad arguments)."""
STATUS_PREFIX = "cannot start: "
"""Heads the status that carries the reason."""


def startup_failed(process: str, reason: str) -> int:
    """Report `reason` (one line: the problem and the fix); returns EXIT_STARTUP."""
    reason = " ".join(reason.split())
    print(f"{process}: {reason}", file=sys.stderr, flush=True)
    sd_notify.status(STATUS_PREFIX + reason)
    return EXIT_STARTUP
