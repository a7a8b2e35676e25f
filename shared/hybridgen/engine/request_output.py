"""What the engine hands back for a request: each step's RequestOutput (Engine.step,
Engine.accept_token), and a whole Completion (Engine.generate)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from hybridgen.engine.sequence import FinishReason
from hybridgen.engine.step_errors import StepFailed

if TYPE_CHECKING:  # a type only: the gateway reads outputs without torch
    from hybridgen.sampling.candidates import Candidates

T = TypeVar("T")


def _joined(a: list[T] | None, b: list[T] | None) -> list[T] | None:
    return None if a is None and b is None else [*(a or []), *(b or [])]


@dataclass
class RequestOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None
    logprobs: list[float] | None
    top_logprobs: list[list[tuple[int, float]]] | None
    prompt_tokens: int
    output_tokens: int
    candidates: Candidates | None = None
    """With deferred CPU sampling: the top-k logits to pick the next token from (no token
    yet; answer with Engine.accept_token)."""
    error: StepFailed | None = None
    """The request ended with this status: refused by the engine, or its step failed."""

    @staticmethod
    def failed(
        request_id: str, error: StepFailed, prompt_tokens: int, output_tokens: int = 0
    ) -> RequestOutput:
        """The last output of a request that ended with `error` (finished, CANCELLED)."""
        return RequestOutput(
            request_id,
            [],
            True,
            FinishReason.CANCELLED,
            None,
            None,
            prompt_tokens,
            output_tokens,
            error=error,
        )

    def then(self, later: RequestOutput) -> RequestOutput:
        """This output followed by a later one of the same request, as one output."""
        return RequestOutput(
            self.request_id,
            self.new_token_ids + later.new_token_ids,
            later.finished,
            later.finish_reason,
            _joined(self.logprobs, later.logprobs),
            _joined(self.top_logprobs, later.top_logprobs),
            later.prompt_tokens,
            later.output_tokens,
            later.candidates,
            later.error,
        )


@dataclass
class Completion:
    """A whole finished request, from `Engine.generate`."""

    request_id: str
    token_ids: list[int]
    finish_reason: FinishReason
    logprobs: list[float] | None
