"""Children tied to their parent (runtime/tied_child.py): they run their command in the
same process with a death signal set, exit at once when the parent is already gone, keep
the descriptors passed to them, and are started without forking the parent, so no
library's at-fork handler (gRPC's restarts a poller thread) runs in a half-made child."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from hybridgen.runtime.tied_child import tied

REPORT = r"""
import ctypes, os, sys
flag = ctypes.c_int()
ctypes.CDLL(None).prctl(2, ctypes.byref(flag), 0, 0, 0)  # PR_GET_PDEATHSIG
fd = int(sys.argv[1])
print(os.getpid(), flag.value, os.read(fd, 5).decode(), flush=True)
"""


def test_the_command_runs_in_the_same_process_with_its_death_signal_and_fds() -> None:
    read, write = os.pipe()
    os.write(write, b"kept!")
    try:
        child = subprocess.run(
            tied([sys.executable, "-c", REPORT, str(read)], os.getpid()),
            pass_fds=(read,),
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
    finally:
        os.close(read)
        os.close(write)
    pid, signal_number, passed = child.stdout.split()
    assert int(signal_number) == 9  # SIGKILL
    assert passed == "kept!"
    assert int(pid) > 0


def test_a_child_whose_parent_is_already_gone_exits_before_its_command(tmp_path: Path) -> None:
    """The race a death signal alone would lose: the parent dies before the child sets it;
    the child then has another parent and exits instead of running unsupervised."""
    marker = tmp_path / "ran"
    command = [sys.executable, "-c", f"open({str(marker)!r}, 'w')"]
    child = subprocess.run(tied(command, os.getpid() + 1_000_000), timeout=30)
    assert child.returncode == 1
    assert not marker.exists()


SPAWN = r"""
import os, signal, subprocess, sys
from pathlib import Path
from hybridgen.cli.supervisor import ChildSpec, Supervisor, _Child
from hybridgen.parallel import launch

marker, rt = sys.argv[1], Path(sys.argv[2])
def forked():
    os.write(os.open(marker, os.O_WRONLY | os.O_APPEND | os.O_CREAT), b"f")
os.register_at_fork(after_in_child=forked)
if "control" in sys.argv:
    subprocess.run([sys.executable, "-c", "pass"], preexec_fn=lambda: None, check=True)
spec = ChildSpec("x", (sys.executable, "-c", "pass"))
Supervisor([spec], rt, report=lambda line: None)._popen(_Child(spec, rt)).wait()
worker = launch._spawn(launch.WorkerArgs("none", "auto", "cpu", 1, 2, 1, "gloo", 0))
worker.kill()
worker.wait()
print("spawned")
"""


def test_the_supervisor_and_tensor_parallel_spawn_without_forking(tmp_path: Path) -> None:
    """An at-fork hook in the parent never runs for their children; the control (a
    preexec_fn, which makes Popen fork) shows that the hook sees a fork."""
    for control in (False, True):
        marker = tmp_path / f"forked-{control}"
        argv = [sys.executable, "-c", SPAWN, str(marker), str(tmp_path)]
        out = subprocess.run(
            argv + (["control"] if control else []),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.stdout.strip() == "spawned", out.stderr
        assert marker.exists() == control
