"""structlog setup shared by every process: JSON lines to stderr, or readable console lines;
and Progress, a long start-up step's done/total in the log and in the daemon's status."""

from __future__ import annotations

import logging
import os
import re
import sys
import time
from typing import TextIO, cast

import structlog

from hybridgen.runtime import sd_notify

PROGRESS_STATUS = re.compile(r"(?P<label>.+) (?P<done>\d+)/(?P<total>\d+) (?P<unit>\S+)")
"""A daemon's STATUS= while a Progress runs ("loading weights 12/291 tensors"): what `hybridgen
serve` draws a progress bar from and `systemctl status` shows."""


class _Stderr:
    """sys.stderr as it is at each write, not as it was when logging was configured: a
    stream swapped in for a while (pytest's capture, a redirect) and closed since must not
    make every later log line raise."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def configure(json: bool | None = None, level: str | None = None) -> None:
    """Configure structlog once per process; HYBRIDGEN_LOG_JSON=1 forces JSON."""
    if json is None:
        json = os.environ.get("HYBRIDGEN_LOG_JSON", "0") == "1"
    level_name = (level or os.environ.get("HYBRIDGEN_LOG_LEVEL", "info")).upper()
    renderer = (
        structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping()[level_name]
        ),
        logger_factory=structlog.PrintLoggerFactory(file=cast(TextIO, _Stderr())),
        cache_logger_on_first_use=False,
    )


class Progress:
    """Logs `event` with done/total at most every `interval_s` seconds, and once at the end;
    under a supervisor (sd_notify), reports `label` done/total as the status ten times as
    often (PROGRESS_STATUS)."""

    def __init__(
        self, event: str, total: int, unit: str = "", interval_s: float = 1.0, label: str = ""
    ) -> None:
        self.log = structlog.get_logger()
        self.event, self.total, self.unit, self.interval = event, total, unit, interval_s
        self.label = label or event.replace("_", " ")
        self.start = self.last = time.monotonic()
        self.last_status = float("-inf")  # the first step is shown at once

    def update(self, done: int, **extra: object) -> None:
        now = time.monotonic()
        if done >= self.total or now - self.last_status >= self.interval / 10:
            self.last_status = now
            sd_notify.status(f"{self.label} {done}/{self.total} {self.unit or 'steps'}")
        if done < self.total and now - self.last < self.interval:
            return
        self.last = now
        pct = 100.0 * done / max(self.total, 1)
        self.log.info(
            self.event,
            done=done,
            total=self.total,
            unit=self.unit,
            percent=round(pct, 1),
            elapsed_s=round(now - self.start, 2),
            **extra,
        )
