"""How a daemon's process ends once its main function returned: at once, with its status.

The daemons have cleaned up by then (rings closed, segments unlinked, workers stopped). The
interpreter's own teardown would then join leftover threads (gRPC's, a torch pool's) and free
every module and tensor one by one: for the GPU daemon, freeing the model and its KV pool took
seconds of a stop. `exit_with(main)` flushes stdout and stderr (their last log lines) and ends
the process by `os._exit` with main's status.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import NoReturn

__all__ = ["exit_with"]


def exit_with(main: Callable[[], int]) -> NoReturn:
    """Run `main`, then end the process with its status, skipping the interpreter's teardown."""
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
