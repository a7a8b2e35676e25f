"""A process started ahead of its turn (the supervisor's ChildSpec.prestart): it imports its
modules while the processes before it start, then waits here for the supervisor's go before
doing anything its turn depends on (attaching to the rings, binding its socket).

The supervisor passes a pipe's read end as $HYBRIDGEN_GO_FD and writes one byte to it when
every process before this one is ready; if it closes the pipe instead (it stopped, or it gave
the turn to a fresh process), this one exits at once with status 0. A process started
without the variable (by hand, by systemd, in tests) goes on at once.
"""

from __future__ import annotations

import os
import sys

GO_FD = "HYBRIDGEN_GO_FD"
"""The environment variable naming the descriptor the go byte comes on."""


def wait_for_go() -> None:
    """Block until the supervisor's go; exit 0 if it closes the pipe instead."""
    fd = os.environ.pop(GO_FD, None)
    if fd is None:
        return
    try:
        go = os.read(int(fd), 1)
    finally:
        os.close(int(fd))
    if not go:
        sys.exit(0)
