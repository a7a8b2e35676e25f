"""What the engine hands back for a request: each step's RequestOutput (Engine.step,
Engine.accept_token), and a whole Completion (Engine.generate)."""

from __future__ import annotations

from dataclasses import dataclass

from hybridgen.gpu_daemon.sequence import FinishReason
from hybridgen.sampling.candidates import Candidates


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


@dataclass
class Completion:
    """A whole finished request, from `Engine.generate`."""

    request_id: str
    token_ids: list[int]
    finish_reason: FinishReason
    logprobs: list[float] | None
