"""exit_with: a daemon's process ends at once with main's status, its last lines flushed, even
with a thread left running that the interpreter's teardown would wait for."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

SCRIPT = textwrap.dedent(
    """
    import sys, threading, time
    from hybridgen.runtime.process_exit import exit_with

    def main() -> int:
        threading.Thread(target=time.sleep, args=(60,)).start()  # not a daemon thread
        print("last stdout line", end="")
        print("last stderr line", end="", file=sys.stderr)
        return int(sys.argv[1])

    exit_with(main)
    """
)


def test_exit_with_ends_at_once_with_mains_status_and_flushed_output() -> None:
    for status in (0, 3):
        start = time.monotonic()
        env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
        done = subprocess.run(
            [sys.executable, "-c", SCRIPT, str(status)],
            capture_output=True,
            text=True,
            timeout=30,
            env=env,
        )
        assert time.monotonic() - start < 20  # a normal exit would join the 60 s thread
        assert done.returncode == status
        assert done.stdout == "last stdout line"  # buffered (a pipe), flushed before the exit
        assert done.stderr == "last stderr line"
