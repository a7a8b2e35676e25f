"""Child processes that die with their parent, started without a fork of the parent.

`tied(argv, parent)` is the command line of a child that is sent SIGKILL when `parent` dies
(PR_SET_PDEATHSIG), and that exits at once with status 1 when `parent` died before the
child could ask for that. This file itself runs first, as a stdlib-only script, then execs
`argv` in the same process (the death signal outlives exec).

Why not a `preexec_fn`: it makes Popen fork the parent instead of vfork-ing it, and fork
runs every library's at-fork handlers in the child between fork and exec. gRPC's restart
a poller thread there on an epoll descriptor that Popen's close_fds then closes; the thread
aborts the child (SIGABRT or SIGSEGV, about one spawn in a hundred with gRPC serving in the
parent), which a tensor-parallel start saw as a lost rank.
"""

from __future__ import annotations

import sys

PR_SET_PDEATHSIG = 1


def tied(argv: list[str], parent: int) -> list[str]:
    """`argv`, run so that it dies with process `parent` (usually os.getpid())."""
    return [sys.executable, "-I", "-S", __file__, str(parent), *argv]


def _main() -> None:
    import ctypes
    import os
    import signal

    parent, argv = int(sys.argv[1]), sys.argv[2:]
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    _main()
