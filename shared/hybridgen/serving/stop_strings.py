"""Stop strings over streamed text: cut the output before the first stop string, across deltas.

Semantics (independent of how the text is split into deltas): generation stops at the first
point in the text where any stop string has appeared, and the output is the text before the
earliest-starting stop string present by then. So with stops "ab" and "bc", "abc" yields ""
("ab" completes first); with "abc" and "bc" (completing together) the earlier "abc" wins; with
"abcd" and "bc", "abcd" yields "a" ("bc" completes before "abcd" could). When no stop string
contains another, this is simply text[:earliest occurrence of any stop].

Text that could still be the start of a stop string is held back, so nothing after (or of) a
stop string is ever emitted; `flush()` releases the held text when the output ends without one.
"""

from __future__ import annotations

MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256


class StopStringError(ValueError):
    """The `stop` request parameter is invalid (the message names it and the limits)."""


def validate_stops(stops: list[str]) -> list[str]:
    """Check the request's `stop` list; return it without duplicates, in order."""
    if not isinstance(stops, list | tuple):
        raise StopStringError(f"stop: expected a list of strings, got {type(stops).__name__}")
    if len(stops) > MAX_STOP_STRINGS:
        raise StopStringError(
            f"stop: at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stops)}"
        )
    for i, stop in enumerate(stops):
        if not isinstance(stop, str):
            raise StopStringError(f"stop[{i}]: expected a string, got {type(stop).__name__}")
        if not stop:
            raise StopStringError(f"stop[{i}]: stop strings must be non-empty")
        if len(stop) > MAX_STOP_LENGTH:
            raise StopStringError(
                f"stop[{i}]: stop strings are at most {MAX_STOP_LENGTH} characters, got {len(stop)}"
            )
    return list(dict.fromkeys(stops))


class StopStringMatcher:
    """Feeds text deltas through a set of stop strings.

    `feed(delta)` returns (text safe to emit now, stopped). Invariants: the emitted text never
    contains the start of a match; `held` (never longer than the longest stop minus one
    character) is the longest suffix of the text seen so far that is a proper prefix of a stop
    string; after a stop nothing more is emitted.
    """

    def __init__(self, stops: list[str]) -> None:
        self._stops = validate_stops(stops)
        self._first_chars = frozenset(s[0] for s in self._stops)
        self._max_held = max((len(s) for s in self._stops), default=1) - 1
        self._held = ""
        self._matched: str | None = None
        self._flushed = False

    @property
    def stopped(self) -> bool:
        """Whether a stop string has been found."""
        return self._matched is not None

    @property
    def matched(self) -> str | None:
        """The stop string that ended the output (None while none has)."""
        return self._matched

    def feed(self, delta: str) -> tuple[str, bool]:
        """Take the next text delta; return the text now safe to emit and whether it stopped."""
        if self._matched is not None:
            return "", True
        if self._flushed:
            raise RuntimeError("StopStringMatcher.feed after flush")
        text = self._held + delta
        cut = self._first_stop(text)
        if cut is not None:
            self._held = ""
            return text[:cut], True
        keep = self._partial_suffix(text)
        self._held = text[len(text) - keep :]
        return text[: len(text) - keep], False

    def flush(self) -> str:
        """The held-back text when the output ended without a stop string ("" after a stop)."""
        self._flushed = True
        held, self._held = self._held, ""
        return "" if self._matched is not None else held

    def _first_stop(self, text: str) -> int | None:
        """Start of the match that ends the output within `text`, recording which one.

        `text` holds every possible start of an unseen match (emitted text contains none), so
        the earliest completion end here is the earliest in the whole output.
        """
        ends = [(i + len(s), s) for s in self._stops if (i := text.find(s)) >= 0]
        if not ends:
            return None
        end = min(e for e, _ in ends)
        # Every stop present in text[:end] ends exactly at `end`; the earliest start wins.
        cut, stop = min((e - len(s), s) for e, s in ends if e == end)
        self._matched = stop
        return cut

    def _partial_suffix(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string.

        Only the last `max_held` characters can start one, and only where a stop's first
        character occurs: O(longest stop) per call, independent of the text seen so far.
        """
        for j in range(max(len(text) - self._max_held, 0), len(text)):
            if text[j] in self._first_chars:
                tail = text[j:]
                if any(len(s) > len(tail) and s.startswith(tail) for s in self._stops):
                    return len(text) - j
        return 0
