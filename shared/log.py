"""structlog setup shared by every process: JSON lines to stderr, or readable console lines."""

from __future__ import annotations

import logging
import os
import sys
import time

import structlog


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
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )


class Progress:
    """Logs `event` with done/total at most every `interval_s` seconds, and once at the end."""

    def __init__(self, event: str, total: int, unit: str = "", interval_s: float = 1.0) -> None:
        self.log = structlog.get_logger()
        self.event, self.total, self.unit, self.interval = event, total, unit, interval_s
        self.start = self.last = time.monotonic()

    def update(self, done: int, **extra: object) -> None:
        now = time.monotonic()
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
