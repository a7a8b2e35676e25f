"""The gateway's Deltas as OpenAI response bodies: a whole completion, or the chunks of a
stream (server-sent events), for /v1/completions and /v1/chat/completions."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from hybridgen.engine.sequence import FinishReason
from hybridgen.models.tokenizer import Tokenizer
from hybridgen.serving.delta import Delta, TokenLogprob
from hybridgen.serving.openai_request import OpenAIRequest

FINISH_REASONS = {
    FinishReason.STOP: "stop",
    FinishReason.STOP_SEQUENCE: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.CANCELLED: "abort",
}
DONE = "data: [DONE]\n\n"


def event(payload: dict[str, Any]) -> str:
    """One server-sent event."""
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


@dataclass
class _Choice:
    """What one choice has produced so far."""

    text: str = ""
    tokens: list[TokenLogprob] = field(default_factory=list)
    finish: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0


class Responder:
    """One request's choices (n samples of each prompt) as OpenAI bodies and chunks."""

    def __init__(self, req: OpenAIRequest, model: str, tokenizer: Tokenizer) -> None:
        self._req, self._model, self._tokenizer = req, model, tokenizer
        self._id = req.inputs[0].request_id.rsplit("-", 1)[0]
        self._created = int(time.time())
        self._object = "chat.completion" if req.chat else "text_completion"
        self._choices = [_Choice() for _ in range(len(req.inputs) * req.n)]

    def add(self, index: int, delta: Delta) -> None:
        """Record a Delta of choice `index`."""
        choice = self._choices[index]
        choice.text += delta.text
        if delta.logprobs is not None:
            choice.tokens += delta.logprobs
        if delta.finish_reason is not None:
            choice.finish = FINISH_REASONS[delta.finish_reason]
        choice.prompt_tokens = delta.prompt_tokens
        choice.completion_tokens = delta.completion_tokens

    def body(self) -> dict[str, Any]:
        """The whole response (non-streaming)."""
        choices = []
        for i, c in enumerate(self._choices):
            logprobs = self._logprobs(c.tokens, 0) if self._req.logprobs else None
            out: dict[str, Any] = {"message": {"role": "assistant", "content": c.text}}
            if not self._req.chat:
                out = {"text": c.text}
            choices.append({"index": i, **out, "logprobs": logprobs, "finish_reason": c.finish})
        return {**self._head(self._object), "choices": choices, "usage": self.usage()}

    def first_chunks(self) -> list[dict[str, Any]]:
        """Chat streams open each choice with its role (every key of a chunk there, as OpenAI
        sends it: clients with strict types read logprobs and finish_reason as null)."""
        if not self._req.chat:
            return []
        fields = {"delta": {"role": "assistant", "content": ""}, "logprobs": None}
        return [
            self._chunk(i, {**fields, "finish_reason": None}) for i in range(len(self._choices))
        ]

    def chunk(self, index: int, delta: Delta) -> dict[str, Any] | None:
        """The stream's chunk for a Delta of choice `index` (recorded too); None when it
        carries nothing (no token, no text, not the end)."""
        offset = len(self._choices[index].text)
        self.add(index, delta)
        finish = self._choices[index].finish if delta.finished else None
        if not delta.text and not delta.token_ids and finish is None:
            return None  # tokens still come as empty text: clients time each of them
        logprobs = None
        if self._req.logprobs and delta.logprobs is not None:
            logprobs = self._logprobs(list(delta.logprobs), offset)
        if self._req.chat:
            content = {"content": delta.text} if delta.text else {}
            fields = {"delta": content, "logprobs": logprobs, "finish_reason": finish}
        else:
            fields = {"text": delta.text, "logprobs": logprobs, "finish_reason": finish}
        return self._chunk(index, fields)

    def usage_chunk(self) -> dict[str, Any]:
        """stream_options.include_usage: the last chunk, no choices."""
        return {**self._head(self._chunk_object()), "choices": [], "usage": self.usage()}

    def usage(self) -> dict[str, int]:
        # Each prompt's tokens count once, however many samples it had.
        prompt = sum(c.prompt_tokens for c in self._choices[:: self._req.n])
        completion = sum(c.completion_tokens for c in self._choices)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }

    def _chunk_object(self) -> str:
        """A streamed chunk's `object`: chat.completion.chunk, or text_completion (OpenAI's
        completions stream has no .chunk)."""
        return f"{self._object}.chunk" if self._req.chat else self._object

    def _chunk(self, index: int, fields: dict[str, Any]) -> dict[str, Any]:
        chunk = {**self._head(self._chunk_object()), "choices": [{"index": index, **fields}]}
        if self._req.continuous_usage:
            chunk["usage"] = self.usage()
        elif self._req.include_usage:
            chunk["usage"] = None
        return chunk

    def _head(self, kind: str) -> dict[str, Any]:
        return {"id": self._id, "object": kind, "created": self._created, "model": self._model}

    def _logprobs(self, tokens: list[TokenLogprob], offset: int) -> dict[str, Any]:
        """OpenAI's logprobs object: chat's `content` list, or completions' parallel lists
        (text_offset counts from `offset`, the choice's text before these tokens)."""
        text = self._token_text
        if self._req.chat:
            return {
                "content": [
                    {
                        **_entry(text(t.token_id), t.logprob),
                        "top_logprobs": [_entry(text(i), lp) for i, lp in t.top],
                    }
                    for t in tokens
                ]
            }
        strings = [text(t.token_id) for t in tokens]
        offsets = []
        for s in strings:
            offsets.append(offset)
            offset += len(s)
        return {
            "tokens": strings,
            "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [_top_dict([(text(i), lp) for i, lp in t.top]) for t in tokens],
            "text_offset": offsets,
        }

    def _token_text(self, token_id: int) -> str:
        return self._tokenizer.decode([token_id])


def _entry(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode())}


def _top_dict(entries: list[tuple[str, float]]) -> dict[str, float]:
    """Alternatives keyed by their text, most likely first; of tokens that decode alike
    (OpenAI's format cannot tell them apart), the most likely one."""
    out: dict[str, float] = {}
    for token, logprob in entries:
        out.setdefault(token, logprob)
    return out
