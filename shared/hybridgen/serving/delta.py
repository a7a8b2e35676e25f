"""What a request streams back, as the gateway's service sees it, and how an engine output
becomes the next piece of that stream."""

from __future__ import annotations

from dataclasses import dataclass

from hybridgen.engine.request_output import RequestOutput
from hybridgen.engine.sequence import FinishReason
from hybridgen.serving.text import TextStream


@dataclass(frozen=True)
class TokenLogprob:
    """Log-probability of one generated token and its top alternatives."""

    token_id: int
    """The generated token."""
    logprob: float
    """Its log-probability."""
    top: tuple[tuple[int, float], ...]
    """(token id, logprob) of the most likely tokens, most likely first."""


@dataclass(frozen=True)
class Delta:
    """What one request produced since its previous Delta."""

    token_ids: tuple[int, ...]
    """New token ids."""
    text: str
    """New text (may lag token_ids: incomplete characters and stop-string prefixes wait)."""
    logprobs: tuple[TokenLogprob, ...] | None
    """One entry per token, when the request asked for logprobs."""
    finished: bool
    """True on the last Delta of the request."""
    finish_reason: FinishReason | None
    """Set on the last Delta."""
    prompt_tokens: int
    """Tokens in the prompt."""
    completion_tokens: int
    """Tokens generated so far."""


def to_delta(out: RequestOutput, text: TextStream) -> Delta:
    """An engine output as the next Delta of its request's stream (text through `text`)."""
    new_text, stopped = text.push(out.new_token_ids, out.finished)
    assert out.finished == (out.finish_reason is not None)
    finish = FinishReason.STOP_SEQUENCE if stopped else out.finish_reason
    logprobs = None
    if out.logprobs is not None:
        tops = out.top_logprobs or [[] for _ in out.logprobs]
        logprobs = tuple(
            TokenLogprob(t, lp, tuple(top))
            for t, lp, top in zip(out.new_token_ids, out.logprobs, tops, strict=True)
        )
    return Delta(
        token_ids=tuple(out.new_token_ids),
        text=new_text,
        logprobs=logprobs,
        finished=finish is not None,
        finish_reason=finish,
        prompt_tokens=out.prompt_tokens,
        completion_tokens=out.output_tokens,
    )
