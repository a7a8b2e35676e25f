"""What `hybridgen serve` shows while the daemons start: a progress bar for each phase a
daemon counts (loading weights, converting experts, warming up) on a terminal, short plain
lines elsewhere; and the statuses the daemons' Progress sends."""

from __future__ import annotations

import io
import os
import socket
from pathlib import Path

import pytest
import structlog

from hybridgen.cli.terminal import Terminal
from hybridgen.runtime import log as hlog
from hybridgen.runtime.log import PROGRESS_STATUS


def test_progress_statuses_are_bars_on_a_terminal() -> None:
    out = io.StringIO()
    term = Terminal(out, tty=True)
    for done in range(1, 5):
        term.status("gpu", f"loading weights {done}/4 tensors")
    term.status("gpu", "warming up 1/2 graphs")
    term.line("a line of serve's own")  # printed above the bar, which goes on
    term.status("gpu", "warming up 2/2 graphs")
    term.status("gpu", "serving tiny-llama")
    text = out.getvalue()
    assert "gpu: loading weights" in text and "4/4" in text and "100%" in text
    assert "gpu: warming up" in text and "2/2" in text
    assert "hybridgen: a line of serve's own" in text
    assert text.rstrip().endswith("hybridgen: gpu: serving tiny-llama")


def test_progress_statuses_are_few_lines_elsewhere(monkeypatch: pytest.MonkeyPatch) -> None:
    out = io.StringIO()
    clock = [100.0]
    monkeypatch.setattr("hybridgen.cli.terminal.time.monotonic", lambda: clock[0])
    term = Terminal(out, tty=False, every_s=5.0)
    for done in range(1, 101):
        clock[0] += 0.125  # 12.5 s in all
        term.status("gpu", f"loading weights {done}/100 tensors")
    term.status("gpu", "serving tiny-llama")
    assert out.getvalue().splitlines() == [
        "hybridgen: gpu: loading weights 1/100 tensors",
        "hybridgen: gpu: loading weights 41/100 tensors",
        "hybridgen: gpu: loading weights 81/100 tensors",
        "hybridgen: gpu: loading weights 100/100 tensors",
        "hybridgen: gpu: serving tiny-llama",
    ]
    assert "\r" not in out.getvalue()


def test_progress_reports_its_status_to_the_supervisor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = str(tmp_path / "notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(path)
        sock.setblocking(False)
        monkeypatch.setenv("NOTIFY_SOCKET", path)
        progress = hlog.Progress("experts_to_host", 3, unit="layers", label="converting experts")
        for done in (1, 2, 3):
            progress.update(done)
        statuses = []
        while True:
            try:
                statuses.append(sock.recv(4096).decode())
            except BlockingIOError:
                break
    # The first step and the last always; in between, at most ten a log interval.
    assert statuses[0] == "STATUS=converting experts 1/3 layers"
    assert statuses[-1] == "STATUS=converting experts 3/3 layers"
    match = PROGRESS_STATUS.fullmatch(statuses[-1].removeprefix("STATUS="))
    assert match is not None and (match["label"], match["done"], match["total"]) == (
        "converting experts",
        "3",
        "3",
    )
    assert os.environ["NOTIFY_SOCKET"] == path


def test_logging_follows_stderr_after_a_swapped_stream_closes(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Logging configured while sys.stderr was a stream since closed (pytest's capture in
    an earlier test, a redirect) writes to today's sys.stderr: it bound the stream once, and
    a later test's log line raised "I/O operation on closed file" inside the engine."""
    gone = io.StringIO()
    monkeypatch.setattr("sys.stderr", gone)
    hlog.configure(json=True)
    gone.close()
    monkeypatch.undo()
    structlog.get_logger().warning("after_the_swap", n=1)
    assert '"event": "after_the_swap"' in capsys.readouterr().err
    hlog.configure()
