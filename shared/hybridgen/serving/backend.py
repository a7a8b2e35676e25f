"""What a front end needs from the model side: the `Backend` protocol, served by the engine in
this process (serving/engine_backend.py), the CPU daemon's rings (its ring_backend.py) or a
daemon upstream (the gateway's proxy_backend.py); all three stream Deltas.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from hybridgen.models.chat import ChatMessage
    from hybridgen.sampling.params import SamplingParams
    from hybridgen.serving.delta import Delta
    from hybridgen.serving.service import GenerateInput
    from hybridgen.serving.stream_input import PromptPart


class BackendUnavailable(RuntimeError):
    """The model is loading, draining or dead; the client may retry elsewhere or later."""


class Backend(Protocol):
    """The model side as the gateway sees it; all methods are called on the event loop."""

    async def start(self) -> None:
        """Load the model; returns once requests can be served, raises if loading failed."""

    async def stop(self) -> None:
        """Stop serving; in-flight requests fail with BackendUnavailable."""

    def ready(self) -> bool:
        """True while requests can be served (loaded and alive)."""

    async def model_info(self) -> dict[str, Any]:
        """Model and pool facts, keyed by GetModelInfoResponse field names."""

    async def tokenize(self, text: str, add_special_tokens: bool) -> list[int]:
        """Token ids of `text`, tokenized off the event loop; InvalidRequest naming `text`
        when it is too long for the context (checked before any tokenizing)."""

    async def tokenize_chat(
        self, messages: Sequence[ChatMessage], add_generation_prompt: bool
    ) -> list[int]:
        """Token ids of a chat in the model's template (models.chat.chat_prompt_ids); raises
        InvalidChat naming the bad field."""

    async def validate(
        self, prompt_ids: Sequence[int], params: SamplingParams, partial: bool = False
    ) -> None:
        """Raise InvalidRequest or InvalidSamplingParameter naming the first bad field.
        `partial`: the prompt's first part (streaming input; may be empty)."""

    def generate(
        self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams, stop: list[str]
    ) -> AsyncIterator[Delta]:
        """Stream the request's Deltas; the last has finished=True. Closing the iterator
        early aborts the request."""

    def stream_generate(
        self, req: GenerateInput, start: PromptPart, parts: AsyncIterator[PromptPart]
    ) -> AsyncIterator[Delta]:
        """generate with streaming input: `start` is the prompt's first part, `parts` the
        rest as the client sends them (up to the one with last); each is tokenized and its
        KV computed as it comes, decoding starts after the last."""

    async def abort(self, request_id: str) -> None:
        """Stop the request and free its KV; unknown or finished ids are ignored."""

    def queue_depth(self) -> int:
        """Requests accepted but not yet streaming."""
