"""sd_notify against a real unix datagram socket standing in for systemd."""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from hybridgen.runtime import sd_notify


@pytest.fixture
def systemd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[socket.socket]:
    """A bound datagram socket exported as $NOTIFY_SOCKET, as systemd does for Type=notify."""
    path = tmp_path / "notify"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
        sock.settimeout(5)
        monkeypatch.setenv("NOTIFY_SOCKET", str(path))
        yield sock


def _received(sock: socket.socket) -> str:
    return sock.recv(4096).decode()


def test_messages_reach_the_socket(systemd: socket.socket) -> None:
    assert sd_notify.ready()
    assert _received(systemd) == "READY=1"
    assert sd_notify.ready("model loaded: tiny-llama")
    assert _received(systemd) == "READY=1\nSTATUS=model loaded: tiny-llama"
    assert sd_notify.watchdog()
    assert _received(systemd) == "WATCHDOG=1"
    assert sd_notify.status("loading 3/8 shards")
    assert _received(systemd) == "STATUS=loading 3/8 shards"
    assert sd_notify.stopping()
    assert _received(systemd) == "STOPPING=1"
    assert sd_notify.extend_timeout(90)
    assert _received(systemd) == "EXTEND_TIMEOUT_USEC=90000000"
    assert sd_notify.notify("RELOADING=1\nSTATUS=x")
    assert _received(systemd) == "RELOADING=1\nSTATUS=x"


def test_abstract_namespace_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    name = f"hybridgen-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(5)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        assert sd_notify.watchdog()
        assert _received(sock) == "WATCHDOG=1"


def test_no_socket_is_a_no_op(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert sd_notify.notify("READY=1") is False
    assert sd_notify.ready("x") is False
    assert sd_notify.watchdog() is False
    monkeypatch.setenv("NOTIFY_SOCKET", "")
    assert sd_notify.stopping() is False


def test_socket_errors_never_raise(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sd_notify, "_warned", False)
    warnings: list[str] = []
    monkeypatch.setattr(sd_notify._log, "warning", lambda event, **_: warnings.append(event))
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "gone"))
    assert sd_notify.watchdog() is False
    assert sd_notify.watchdog() is False
    monkeypatch.setenv("NOTIFY_SOCKET", "vsock:2:1234")
    assert sd_notify.ready() is False
    assert warnings == ["sd_notify_failed"]  # logged once, not once per heartbeat


@pytest.mark.parametrize(
    ("usec", "pid", "interval"),
    [
        ("30000000", None, 15.0),
        ("30000000", "self", 15.0),
        ("30000000", "1", None),
        (None, None, None),
        ("0", None, None),
        ("soon", None, None),
    ],
)
def test_watchdog_interval(
    monkeypatch: pytest.MonkeyPatch, usec: str | None, pid: str | None, interval: float | None
) -> None:
    for name, value in (("WATCHDOG_USEC", usec), ("WATCHDOG_PID", pid)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, str(os.getpid()) if value == "self" else value)
    assert sd_notify.watchdog_interval_s() == interval
