"""Token ids to streamed text for one request: the CPU daemon's incremental detokenizer and
stop-string matcher, put together the way a Generate stream uses them."""

from __future__ import annotations

from collections.abc import Sequence

from hybridgen.models.tokenizer import Tokenizer
from hybridgen.serving.detokenizer import IncrementalDetokenizer
from hybridgen.serving.stop_strings import StopStringMatcher


class TextStream:
    """One request's output ids -> text deltas, cut before the first stop string."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], stop: Sequence[str]):
        self._detokenizer = IncrementalDetokenizer(tokenizer, list(prompt_ids))
        self._matcher = StopStringMatcher(list(stop)) if stop else None

    def push(self, token_ids: list[int], finished: bool) -> tuple[str, bool]:
        """New text, and whether a stop string ended the request. `finished` (the engine is
        done with it) releases what was held back: incomplete characters, stop prefixes."""
        text = self._detokenizer.push(token_ids)
        if finished:
            text += self._detokenizer.flush()
        if self._matcher is None:
            return text, False
        text, stopped = self._matcher.feed(text)
        if finished and not stopped:
            text += self._matcher.flush()
        return text, stopped
