"""systemd's sd_notify protocol with no dependency: one datagram to $NOTIFY_SOCKET per call.

Outside systemd (tests, `hybridgen serve`, a shell) NOTIFY_SOCKET is unset and every call is a
no-op returning False, so daemons call these helpers unconditionally. A send never raises: a
lost READY or WATCHDOG shows up in systemd's own state, and the daemon must keep serving.
"""

from __future__ import annotations

import os
import socket

import structlog

__all__ = [
    "extend_timeout",
    "notify",
    "ready",
    "status",
    "stopping",
    "watchdog",
    "watchdog_interval_s",
]

_log = structlog.get_logger()
_warned = False


def _address() -> str | None:
    """The socket address from $NOTIFY_SOCKET; '@name' is Linux's abstract namespace."""
    path = os.environ.get("NOTIFY_SOCKET", "")
    if path.startswith("@"):
        return "\0" + path[1:]
    if path.startswith("/"):
        return path
    return None  # unset, or a transport we do not speak (vsock:), which _warn_once reports


def _warn_once(event: str, **fields: object) -> None:
    # The watchdog pings every few seconds; one line says the same as thousands would.
    global _warned
    if not _warned:
        _warned = True
        _log.warning(event, **fields)


def notify(state: str) -> bool:
    """Send newline-separated KEY=VALUE assignments; True when systemd got the datagram."""
    address = _address()
    if address is None:
        if os.environ.get("NOTIFY_SOCKET"):
            _warn_once("sd_notify_unsupported_socket", socket=os.environ["NOTIFY_SOCKET"])
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall(state.encode())
    except OSError as exc:
        _warn_once("sd_notify_failed", socket=os.environ.get("NOTIFY_SOCKET"), error=str(exc))
        return False
    return True


def ready(status: str | None = None) -> bool:
    """Start-up is complete (Type=notify): for the daemons, after the model is loaded."""
    return notify("READY=1" if status is None else f"READY=1\nSTATUS={status}")


def watchdog() -> bool:
    """Keep-alive for WatchdogSec=; call every watchdog_interval_s() from a heartbeat loop.

    systemd arms the watchdog at READY=1, or at the first WATCHDOG=1 if that comes earlier:
    a model loader should report with status()/extend_timeout(), not ping once and stall.
    """
    return notify("WATCHDOG=1")


def stopping() -> bool:
    """Shutdown has begun (draining), so systemd shows `deactivating` and not a crash."""
    return notify("STOPPING=1")


def status(text: str) -> bool:
    """One line for `systemctl status`, such as the loading progress."""
    return notify(f"STATUS={text}")


def extend_timeout(seconds: float) -> bool:
    """Ask for `seconds` more before TimeoutStartSec= fails a start (a slow model load)."""
    return notify(f"EXTEND_TIMEOUT_USEC={int(seconds * 1_000_000)}")


def watchdog_interval_s() -> float | None:
    """How often to ping: half of $WATCHDOG_USEC, as sd_watchdog_enabled(3) advises.

    None when there is no watchdog, or when it belongs to another process ($WATCHDOG_PID:
    the variables leak into children, which must not ping for their parent).
    """
    pid = os.environ.get("WATCHDOG_PID")
    if pid is not None and pid != str(os.getpid()):
        return None
    try:
        usec = int(os.environ.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    return usec / 2 / 1_000_000 if usec > 0 else None
