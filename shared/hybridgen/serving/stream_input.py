"""Streaming input (StreamGenerate): a prompt that arrives in parts.

    client -> StreamGenerate: start (a GenerateRequest: the prompt's first part), chunk, ...,
              chunk with last: true
    service: `read_parts` checks each message and turns it into a PromptPart
    backend: `PromptFeed` turns parts into the engine's prompt edits (keep, new ids), text
             through PromptStream (tokenized as it comes; the joined text's ids at the end)

One kind per request: text parts if the start gave text (or nothing, and the first chunk
with something brings text), token ids if it gave ids. A message after the last chunk is
INVALID_ARGUMENT naming `chunk`; a client that closes its side without `last` ends the prompt
there. Both the gateway and the CPU daemon run `read_parts` (the gateway forwards the parts
upstream as they come); the process that holds the tokenizer runs `PromptFeed`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from hybridgen.engine.validation import (
    InvalidRequest,
    check_prompt_length,
    check_token_ids,
)
from hybridgen.models.prompt_stream import PromptStream
from hybridgen.models.tokenizer import Tokenizer
from hybridgen.v1 import generation_pb2 as pb


@dataclass(frozen=True)
class PromptPart:
    """A piece of a streamed prompt: text or token ids (one kind per request)."""

    text: str = ""
    """Text to append (tokenized with what came before)."""
    token_ids: tuple[int, ...] = ()
    """Token ids to append."""
    last: bool = False
    """The prompt is complete."""


class PartReader:
    """The chunks of a StreamGenerate call after its start, as PromptParts."""

    def __init__(
        self, messages: AsyncIterator[pb.StreamGenerateRequest], text: bool | None
    ) -> None:
        self._messages = messages
        self.text = text
        """Whether the parts are text (None until a part says)."""
        self.last_at = time.monotonic()
        """When the last part came (the start's arrival until it does)."""

    async def parts(self) -> AsyncIterator[PromptPart]:
        """Every part, the last included; then waits for the client's end of the stream, so
        that a message after the last part is refused (InvalidRequest) rather than lost."""
        done = False
        async for message in self._messages:
            if done:
                raise InvalidRequest("chunk", "arrived after the chunk with last: true")
            part = self._part(message)
            done = part.last
            if done:
                self.last_at = time.monotonic()
            yield part
        if not done:  # the client closed its side: that ends the prompt
            self.last_at = time.monotonic()
            yield PromptPart(last=True)

    def _part(self, message: pb.StreamGenerateRequest) -> PromptPart:
        if message.WhichOneof("kind") != "chunk":
            raise InvalidRequest("start", "only the first message may be start; send chunk")
        chunk = message.chunk
        if chunk.text and chunk.token_ids:
            raise InvalidRequest("chunk", "give text or token_ids, not both")
        if chunk.text or chunk.token_ids:
            text = bool(chunk.text)
            if self.text is None:
                self.text = text
            elif text != self.text:
                kind, other = ("text", "token_ids") if self.text else ("token_ids", "text")
                raise InvalidRequest(
                    f"chunk.{other}", f"this request's prompt is {kind}: send chunk.{kind}"
                )
        return PromptPart(chunk.text, tuple(chunk.token_ids), chunk.last)


class PromptFeed:
    """A streamed prompt's parts -> the engine's prompt edits, within the model's limits."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        add_special_tokens: bool,
        vocab_size: int,
        max_model_len: int,
        max_tokens: int,
    ) -> None:
        self._tokenizer, self._add_special_tokens = tokenizer, add_special_tokens
        self._stream: PromptStream | None = None
        """The text so far; None until a part brings text."""
        self._limits = (vocab_size, max_model_len, max_tokens)
        self.token_ids: list[int] = []
        """The prompt as the engine has it (after the last part: the whole prompt)."""

    def push(self, part: PromptPart) -> tuple[int, list[int]]:
        """(keep, new): the engine's prompt becomes its first `keep` tokens then `new`.
        Raises InvalidRequest naming the chunk's field when the prompt would not fit."""
        vocab_size, max_model_len, max_tokens = self._limits
        if part.text and self._stream is None:  # the first text: nothing was sent before it
            assert not self.token_ids, "PartReader keeps one kind per request"
            self._stream = PromptStream(self._tokenizer, self._add_special_tokens)
            self._stream.push(part.text, part.last)
            keep, new = 0, list(self._stream.token_ids)
            total = self._stream.num_tokens
        elif self._stream is not None:
            assert not part.token_ids, "PartReader keeps one kind per request"
            keep, new = self._stream.push(part.text, part.last)
            total = self._stream.num_tokens
        else:
            check_token_ids("chunk.token_ids", part.token_ids, vocab_size)
            keep, new = len(self.token_ids), list(part.token_ids)
            total = keep + len(new)
        check_prompt_length("chunk", total, max_model_len, max_tokens)
        if part.last and not total:
            raise InvalidRequest("prompt", "is empty: give at least one token")
        self.token_ids = [*self.token_ids[:keep], *new]
        return keep, new


def start_feeding(
    parts: AsyncIterator[PromptPart],
    feed: PromptFeed,
    send: Callable[[int, list[int], bool], None],
    fail: Callable[[BaseException], None],
) -> asyncio.Task[None]:
    """A task that pushes every part through `feed` and sends the engine each edit
    (`send(keep, new, last)`); an error (a bad part) goes to `fail`. Cancel it when the
    request ends."""

    async def run() -> None:
        try:
            async for part in parts:
                keep, new = feed.push(part)
                send(keep, new, part.last)
        except Exception as exc:
            fail(exc)

    return asyncio.create_task(run())
