"""Request checks that need only the model's limits (vocabulary size, context length).

The edge runs them: the front end that takes the client's request (serving/service.py's
admit -> Backend.validate, in the gateway with the limits GetModelInfo reports; the prompt's
streamed chunks in serving/stream_input.py's PromptFeed; the offline CLI and the profiler),
and answers InvalidRequest or InvalidSamplingParameter naming the field and the allowed range.
The engine only asserts what they guarantee (`edge_checked`): a request that reaches it
unchecked is a bug in front of it, refused as UncheckedRequest (INTERNAL), never a crash.
Kept free of torch and the engine so that a process without the model can run them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

from hybridgen.sampling.params import InvalidSamplingParameter, SamplingParams


class InvalidRequest(ValueError):
    """A request field is out of range; the message names the field and the allowed range."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class UncheckedRequest(RuntimeError):
    """A request broke what the edge's checks guarantee when it reached the engine: a bug in
    front of the engine (the request is refused as INTERNAL), not the client's mistake."""


@contextlib.contextmanager
def edge_checked() -> Iterator[None]:
    """Around the engine's assertion of the edge's checks: a failure is UncheckedRequest
    (its cause the edge's error, which names the field)."""
    try:
        yield
    except (InvalidRequest, InvalidSamplingParameter) as exc:
        raise UncheckedRequest(f"a request reached the engine unchecked: {exc}") from exc


def validate_request(
    prompt_ids: Sequence[int],
    params: SamplingParams,
    vocab_size: int,
    max_model_len: int,
    partial: bool = False,
) -> None:
    """Raise InvalidRequest or InvalidSamplingParameter naming the first bad field.
    `partial`: the prompt's first part (streaming input), which may be empty."""
    if not prompt_ids and not partial:
        raise InvalidRequest("prompt", "is empty: give at least one token")
    # The length first: it is O(1), and bounds the scan of the ids below.
    check_prompt_length("prompt", len(prompt_ids), max_model_len)
    check_token_ids("prompt_token_ids", prompt_ids, vocab_size)
    params.validate(vocab_size, max_model_len)
    room = max_model_len - len(prompt_ids)
    if params.max_tokens > room:
        raise InvalidRequest(
            "max_tokens",
            f"{params.max_tokens} is beyond the context: the prompt has "
            f"{len(prompt_ids)} tokens, so allowed 1 <= max_tokens <= {room}",
        )


def check_text_size(field: str, text: str, max_bytes: int | None, max_model_len: int) -> None:
    """Refuse text that cannot fit the context before it is tokenized (Tokenizer.max_text_bytes
    gives `max_bytes`; None: no bound but the message size)."""
    if max_bytes is None or len(text) <= max_bytes // 4:  # a character is at most 4 bytes
        return
    size = len(text.encode(errors="surrogatepass"))
    if size > max_bytes:
        raise InvalidRequest(
            field,
            f"is {size} bytes of UTF-8, more than any text of at most {max_model_len} tokens "
            f"(max_model_len) can be with this tokenizer ({max_bytes} bytes); shorten it",
        )


def check_token_ids(field: str, token_ids: Sequence[int], vocab_size: int) -> None:
    """Every id must be in the vocabulary."""
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequest(field, f"token id {bad} is outside [0, {vocab_size})")


def check_prompt_length(
    field: str, prompt_tokens: int, max_model_len: int, max_tokens: int = 1
) -> None:
    """A prompt of `prompt_tokens` must leave room for `max_tokens` generated ones."""
    if prompt_tokens + max_tokens > max_model_len:
        what = "one token" if max_tokens == 1 else f"max_tokens={max_tokens} tokens"
        raise InvalidRequest(
            field,
            f"has {prompt_tokens} tokens; the context allows at most "
            f"{max_model_len - max_tokens} so that {what} can be generated",
        )


def validate_extension(
    prompt_len: int,
    keep: int,
    token_ids: Sequence[int],
    params: SamplingParams,
    vocab_size: int,
    max_model_len: int,
    last: bool,
) -> None:
    """Streaming input: raise InvalidRequest unless an open prompt of `prompt_len` tokens may
    become its first `keep` tokens then `token_ids` (and, with `last`, be complete)."""
    if not 0 <= keep <= prompt_len:
        raise InvalidRequest("keep", f"{keep} is outside [0, {prompt_len}]")
    check_token_ids("chunk.token_ids", token_ids, vocab_size)
    n = keep + len(token_ids)
    check_prompt_length("chunk", n, max_model_len, params.max_tokens)
    if last and not n:
        raise InvalidRequest("prompt", "is empty: give at least one token")
