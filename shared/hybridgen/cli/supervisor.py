"""Start, watch, restart and stop a small set of dependent child processes.

Rules (the same for stand-in commands in tests and for `hybridgen serve`):
- Children start in list order, each once every child before it is ready. A child marked
  `prestart` is spawned at once as a spare: it imports its modules meanwhile and waits
  (runtime/prestart.py) for the go byte, sent when its turn comes; the spare is then the
  child, its start time counted from the go. Ready means
  READY=1 on its private sd_notify socket ($NOTIFY_SOCKET), sent by that child's own pid
  (the kernel's SCM_CREDENTIALS say who sent it, so a leftover process of an earlier run can
  never pass for a new child); a child without a notify socket is ready once spawned.
- A child that exits without being asked to is restarted together with every child that
  depends on it, directly or not (dependents are stopped first, in reverse order).
- Restarts wait min(backoff_initial_s * 2**k, backoff_max_s), k = restarts in the crash
  window; more than `crash_limit` restarts in `crash_window_s` means a crash loop: stop all,
  exit 1. Exit status 2 (a start-up error: bad arguments or config, a missing model, a port
  in use; hybridgen.runtime.startup_error) is never retried, it would only fail again: stop all at
  once, exit 2, with the reason the child gave in its last status.
- SIGINT/SIGTERM: stop every child in reverse start order (SIGTERM, SIGKILL after
  `stop_timeout_s`), exit 0.
- The children die with the supervisor (runtime/tied_child.py: PR_SET_PDEATHSIG = SIGKILL), so
  a supervisor killed with SIGKILL leaves nothing running. They also inherit `inherit_fds`
  (the instance lock of `hybridgen serve`), which therefore stays locked while any process
  of the instance lives, the supervisor or one of its children.
"""

from __future__ import annotations

import collections
import contextlib
import os
import signal
import socket
import struct
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

from hybridgen.runtime.startup_error import EXIT_STARTUP, STATUS_PREFIX
from hybridgen.runtime.tied_child import tied

__all__ = ["ChildSpec", "Policy", "Supervisor", "lock_holders"]


@dataclass(frozen=True)
class ChildSpec:
    """One supervised process."""

    name: str
    """Short name used in messages and socket names (gpu, cpu, gateway)."""
    argv: tuple[str, ...]
    """Command line, argv[0] included."""
    depends_on: tuple[str, ...] = ()
    """Earlier children whose restart restarts this one too (shared state, e.g. shm rings)."""
    notify: bool = True
    """Give the child a private $NOTIFY_SOCKET and take READY=1 / STATUS= from it."""
    log_path: Path | None = None
    """File that receives the child's stdout and stderr; None: inherit the terminal."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Extra environment on top of the supervisor's."""
    prestart: bool = False
    """Spawn it early, to wait for its turn with its imports done (runtime/prestart.py: the
    child must call wait_for_go before its start-up's work)."""


@dataclass(frozen=True)
class Policy:
    """Timings of restarts and stops."""

    backoff_initial_s: float = 0.5
    """Delay before the first restart in a crash window."""
    backoff_max_s: float = 5.0
    """Cap of the exponential restart delay."""
    crash_limit: int = 5
    """Restarts allowed within crash_window_s; one more gives up."""
    crash_window_s: float = 60.0
    """Window of the crash-loop count."""
    drain_s: float = 10.0
    """How long the gateway lets running streams finish after SIGTERM (serving.server
    DRAIN_GRACE_S; a test keeps them equal): what a stop announces."""
    stop_timeout_s: float = 15.0
    """SIGTERM grace before SIGKILL; longer than a child's own drain (drain_s)."""
    poll_s: float = 0.05
    """Main-loop tick."""
    progress_every_s: float = 10.0
    """While a child is starting, say that it still is this often."""


class _Child:
    """Runtime state of one ChildSpec."""

    def __init__(self, spec: ChildSpec, runtime_dir: Path) -> None:
        self.spec = spec
        self.proc: subprocess.Popen[bytes] | None = None
        self.ready = False
        self.started_at = 0.0
        self.last_progress = 0.0
        self.status = ""
        self.not_before = 0.0  # restart back-off: do not start before this monotonic time
        self.sock: socket.socket | None = None
        self.sock_path = runtime_dir / f"notify-{spec.name}.sock"
        self.spare: tuple[subprocess.Popen[bytes], int] | None = None
        """A prestart process waiting for its go, and the write end of its go pipe."""

    @property
    def running(self) -> bool:
        return self.proc is not None


class Supervisor:
    """Runs `specs` until a signal or a crash loop; `run()` returns the exit status."""

    def __init__(
        self,
        specs: Sequence[ChildSpec],
        runtime_dir: Path,
        policy: Policy | None = None,
        report: Callable[[str], None] = print,
        on_all_ready: Callable[[], None] | None = None,
        inherit_fds: tuple[int, ...] = (),
        on_status: Callable[[str, str], None] | None = None,
    ) -> None:
        """`report` gets every line; `on_status(name, status)`, when given, gets a child's
        status changes instead of `report` (a terminal draws progress bars from them)."""
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"child names must be unique, got {names}")
        for spec in specs:
            unknown = [d for d in spec.depends_on if d not in names[: names.index(spec.name)]]
            if unknown:
                raise ValueError(f"{spec.name} depends on {unknown}, not listed before it")
        self.policy = policy or Policy()
        self.report = report
        self.on_all_ready = on_all_ready
        self.on_status = on_status
        self.children = [_Child(s, runtime_dir) for s in specs]
        self.inherit_fds = inherit_fds
        self.restarts: collections.deque[float] = collections.deque()
        self._stop_signal: int | None = None
        self._force = False
        """A second stop request came while stopping: children still running are killed."""
        self._announced = False

    # -- public -----------------------------------------------------------------------------

    def run(self) -> int:
        """Supervise until SIGINT/SIGTERM (0), a crash loop (1) or a child's start-up error
        (2)."""
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            status = self._loop()
        finally:
            self.stop_all()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        return status

    def request_stop(self, signum: int = signal.SIGTERM) -> None:
        """Ask the loop to stop everything (what the signal handlers do); asked again while
        stopping, it stops now: children still draining are killed."""
        if self._stop_signal is not None:
            self._force = True
        self._stop_signal = signum

    def stop_all(self) -> None:
        """Stop every running child in reverse start order and close the notify sockets;
        spares waiting for their turn go first."""
        for child in self.children:
            self._drop_spare(child)
        for child in reversed(self.children):
            self._stop(child)
            self._close_socket(child)

    # -- main loop --------------------------------------------------------------------------

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.request_stop(signum)

    def _loop(self) -> int:
        while self._stop_signal is None:
            now = time.monotonic()
            for child in self.children:
                self._drain_notify(child)
            failed = self._reap(now)
            if failed is not None:
                return failed
            self._prestart()
            self._start_next(now)
            self._check_ready(now)
            time.sleep(self.policy.poll_s)
        name = signal.Signals(self._stop_signal).name
        self.report(
            f"received {name}, stopping: running requests get up to "
            f"{self.policy.drain_s:g} s to finish ({name} again stops at once)"
        )
        return 0

    def _reap(self, now: float) -> int | None:
        """Handle children that exited; an exit status to return when giving up."""
        for child in self.children:
            if child.proc is None or child.proc.poll() is None:
                continue
            self._drain_notify(child)  # what it said just before it exited
            code = child.proc.returncode
            child.proc = None
            child.ready = False
            if code == EXIT_STARTUP and child.status.startswith(STATUS_PREFIX):
                self.report(f"{child.spec.name} {child.status}")
                return EXIT_STARTUP
            self.report(f"{child.spec.name} exited unexpectedly ({_describe(code)})")
            self._tail_log(child)
            if code == EXIT_STARTUP:
                self.report(f"{child.spec.name} rejected its arguments or config; giving up")
                return EXIT_STARTUP
            delay = self._record_restart(now)
            if delay is None:
                self.report(
                    f"crash loop: more than {self.policy.crash_limit} restarts in "
                    f"{self.policy.crash_window_s:g} s; giving up"
                )
                return 1
            group = [child, *self._dependents(child.spec.name)]
            for dependent in reversed(group[1:]):
                if dependent.running:
                    self.report(f"stopping {dependent.spec.name} (depends on {child.spec.name})")
                    self._stop(dependent)
            for member in group:
                member.not_before = now + delay
            names = ", ".join(m.spec.name for m in group)
            self.report(f"restarting {names} in {delay:.1f} s")
            self._announced = False
        return None

    def _record_restart(self, now: float) -> float | None:
        """Back-off delay for one more restart, or None when that makes a crash loop."""
        window = self.policy.crash_window_s
        while self.restarts and now - self.restarts[0] > window:
            self.restarts.popleft()
        if len(self.restarts) >= self.policy.crash_limit:
            return None
        delay = self.policy.backoff_initial_s * 2 ** len(self.restarts)
        self.restarts.append(now)
        return min(delay, self.policy.backoff_max_s)

    def _dependents(self, name: str) -> list[_Child]:
        """Children depending on `name`, directly or transitively, in start order."""
        affected = {name}
        found: list[_Child] = []
        for child in self.children:  # depends_on only names earlier children: one pass
            if affected.intersection(child.spec.depends_on):
                affected.add(child.spec.name)
                found.append(child)
        return found

    def _prestart(self) -> None:
        """A spare for each prestart child not running (one whose spare died is spawned
        again at its turn, the usual way)."""
        for child in self.children:
            if child.spec.prestart and not child.running and child.spare is None:
                read, go = os.pipe()
                try:
                    spare = self._popen(child, {"HYBRIDGEN_GO_FD": str(read)}, (read,))
                except BaseException:
                    os.close(go)
                    raise
                finally:
                    os.close(read)
                child.spare = (spare, go)

    def _start_next(self, now: float) -> None:
        """Start the first child not running, once every child before it is ready."""
        for child in self.children:
            if not child.running:
                if now >= child.not_before:
                    self._spawn(child, now)
                return
            if not child.ready:
                return  # strictly in order: later children wait for this one

    def _check_ready(self, now: float) -> None:
        for child in self.children:
            if child.proc is None or child.ready:
                continue
            if not child.spec.notify:
                child.ready = True
                self.report(f"{child.spec.name} ready after {now - child.started_at:.1f} s")
            elif now - child.last_progress >= self.policy.progress_every_s:
                child.last_progress = now
                what = f": {child.status}" if child.status else ""
                self.report(f"waiting for {child.spec.name}{what} ({now - child.started_at:.0f} s)")
        if not self._announced and all(c.ready for c in self.children):
            self._announced = True
            if self.on_all_ready is not None:
                self.on_all_ready()

    # -- one child --------------------------------------------------------------------------

    def _spawn(self, child: _Child, now: float) -> None:
        """Start `child`: its spare, told to go, or a fresh process."""
        early = ""
        if child.spare is not None and _told_to_go(*child.spare):
            child.proc, child.spare = child.spare[0], None
            early = " (imports done ahead)"
        else:
            self._drop_spare(child)
            child.proc = self._popen(child)
        child.ready, child.status = False, ""
        child.started_at = child.last_progress = now
        self.report(f"started {child.spec.name} (pid {child.proc.pid}){early}")

    def _popen(
        self, child: _Child, extra: Mapping[str, str] | None = None, fds: tuple[int, ...] = ()
    ) -> subprocess.Popen[bytes]:
        spec = child.spec
        env = {**os.environ, **spec.env, **(extra or {})}
        # The supervisor's own watchdog (if systemd runs it) must not leak to the children.
        for key in ("WATCHDOG_USEC", "WATCHDOG_PID", "NOTIFY_SOCKET"):
            env.pop(key, None)
        if spec.notify:
            env["NOTIFY_SOCKET"] = str(self._open_socket(child))
        out = open(spec.log_path, "ab") if spec.log_path is not None else None  # noqa: SIM115
        try:
            # A session of its own: Ctrl-C reaches only the supervisor, which then stops the
            # children in order instead of all of them at once.
            return subprocess.Popen(
                tied(list(spec.argv), os.getpid()),
                env=env,
                stdout=out,
                stderr=out,
                start_new_session=True,
                pass_fds=(*self.inherit_fds, *fds),
            )
        finally:
            if out is not None:
                out.close()

    def _drop_spare(self, child: _Child) -> None:
        """End `child`'s spare, if any: its pipe closed, it exits by itself; waited for."""
        if child.spare is None:
            return
        (spare, go), child.spare = child.spare, None
        os.close(go)
        try:
            spare.wait(self.policy.stop_timeout_s)
        except subprocess.TimeoutExpired:
            spare.kill()
            spare.wait()

    def _stop(self, child: _Child) -> None:
        proc = child.proc
        child.proc, child.ready = None, False
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.policy.stop_timeout_s
        while proc.poll() is None and not self._force and time.monotonic() < deadline:
            time.sleep(self.policy.poll_s)
        if proc.poll() is None:
            if self._force:
                self.report(f"stopping {child.spec.name} now (a second stop request)")
            else:
                self.report(f"{child.spec.name} ignored SIGTERM for {self.policy.stop_timeout_s} s")
            proc.kill()
        proc.wait()
        self.report(f"stopped {child.spec.name} ({_describe(proc.returncode)})")

    def _open_socket(self, child: _Child) -> Path:
        if child.sock is None:
            child.sock_path.unlink(missing_ok=True)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)  # the sender's pid
            sock.bind(str(child.sock_path))
            sock.setblocking(False)
            child.sock = sock
        self._drain_notify(child)  # whatever the previous incarnation left is stale
        return child.sock_path

    def _close_socket(self, child: _Child) -> None:
        if child.sock is not None:
            child.sock.close()
            child.sock = None
            child.sock_path.unlink(missing_ok=True)

    def _drain_notify(self, child: _Child) -> None:
        if child.sock is None:
            return
        while True:
            try:
                data, ancillary, _, _ = child.sock.recvmsg(4096, _CREDENTIALS_SPACE)
            except (BlockingIOError, InterruptedError):
                return
            if child.proc is None:
                continue  # a message from a child already reaped or stopped
            sender = _sender_pid(ancillary)
            if sender != child.proc.pid:
                self.report(f"{child.spec.name}: ignored a notification from pid {sender}")
                continue
            for line in data.decode(errors="replace").splitlines():
                key, _, value = line.partition("=")
                if key == "READY" and value == "1" and not child.ready:
                    child.ready = True
                    took = time.monotonic() - child.started_at
                    self.report(f"{child.spec.name} ready after {took:.1f} s")
                elif key == "STATUS" and value != child.status:
                    child.status = value
                    if value.startswith(STATUS_PREFIX):
                        continue  # reported with the exit it announces
                    if self.on_status is not None:
                        self.on_status(child.spec.name, value)
                    else:
                        self.report(f"{child.spec.name}: {value}")

    def _tail_log(self, child: _Child, lines: int = 5) -> None:
        path = child.spec.log_path
        if path is None:
            return
        with contextlib.suppress(OSError):
            with open(path, "rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - 4096))
                tail = f.read().decode(errors="replace").splitlines()[-lines:]
            for line in tail:
                self.report(f"  {child.spec.name}| {line}")
            self.report(f"  (full log: {path})")


_CREDENTIALS = struct.Struct("3i")  # struct ucred: pid, uid, gid
_CREDENTIALS_SPACE = socket.CMSG_SPACE(_CREDENTIALS.size)


def _told_to_go(spare: subprocess.Popen[bytes], go: int) -> bool:
    """Send a waiting spare its go byte and close the pipe; False (the pipe left open for
    _drop_spare) when the spare has died meanwhile."""
    if spare.poll() is not None:
        return False
    try:
        os.write(go, b"g")
    except BrokenPipeError:  # it died between the poll and the write
        return False
    os.close(go)
    return True


def _sender_pid(ancillary: list[tuple[int, int, bytes]]) -> int | None:
    """The pid in a datagram's SCM_CREDENTIALS (the kernel fills it in: it cannot be forged)."""
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
            return int(_CREDENTIALS.unpack(data[: _CREDENTIALS.size])[0])
    return None


def lock_holders(path: Path) -> list[int]:
    """Pids of this user's processes with `path` open (those that hold its lock)."""
    target = str(path.resolve())
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):  # another user's, or gone meanwhile
            if any(os.readlink(fd) == target for fd in (proc / "fd").iterdir()):
                pids.append(int(proc.name))
    return sorted(pids)


def _describe(code: int | None) -> str:
    if code is not None and code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
    return f"exit status {code}"
