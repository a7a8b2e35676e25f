"""What `hybridgen serve` writes to the terminal while it starts: its own lines, and the
daemons' statuses. A status that counts (hybridgen.runtime.log.PROGRESS_STATUS: "loading weights
12/291 tensors") is a progress bar while stderr is a terminal (tqdm), and otherwise a plain
line at most every `every_s` seconds and at its end, so that a log file stays short."""

from __future__ import annotations

import shutil
import sys
import time
from typing import IO, Any

from hybridgen.runtime.log import PROGRESS_STATUS

__all__ = ["Terminal"]


class Terminal:
    """Lines prefixed `hybridgen:` and the daemons' progress, on `stream`."""

    def __init__(
        self, stream: IO[str] | None = None, tty: bool | None = None, every_s: float = 5.0
    ) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self.every_s = every_s
        self._bar: Any = None  # tqdm's, while a phase is under way on a terminal
        self._bar_desc = ""
        self._printed: dict[str, float] = {}  # not a terminal: a phase's last line, monotonic

    def line(self, text: str) -> None:
        """One line of `hybridgen serve`'s own."""
        text = f"hybridgen: {text}"
        if self._bar is not None:
            self._bar.write(text, file=self.stream)  # above the bar, which stays at the bottom
        else:
            print(text, file=self.stream, flush=True)

    def status(self, name: str, text: str) -> None:
        """A daemon's status: a progress bar, or a line."""
        match = PROGRESS_STATUS.fullmatch(text)
        if match is None:
            self.close()
            self.line(f"{name}: {text}")
            return
        desc = f"{name}: {match['label']}"
        done, total = int(match["done"]), int(match["total"])
        if self.tty:
            self._draw(desc, done, total, match["unit"])
            return
        now = time.monotonic()
        last = self._printed.get(desc)
        if last is None or done >= total or now - last >= self.every_s:
            self._printed[desc] = now
            self.line(f"{desc} {done}/{total} {match['unit']}")

    def _draw(self, desc: str, done: int, total: int, unit: str) -> None:
        from tqdm import tqdm

        if self._bar is not None and (desc != self._bar_desc or self._bar.total != total):
            self.close()
        if self._bar is None:
            # shutil's size (80x24 when the terminal says none), not tqdm's own query: on a
            # pseudo-terminal without a size that reads 0 rows, and tqdm then hides the bar.
            size = shutil.get_terminal_size()
            self._bar = tqdm(
                total=total,
                desc=desc,
                unit=f" {unit}",
                file=self.stream,
                ncols=size.columns,
                nrows=size.lines,
            )
            self._bar_desc = desc
        self._bar.update(done - self._bar.n)
        if done >= total:
            self.close()

    def close(self) -> None:
        """End the bar in progress, if any (it stays on the screen as it ended)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
