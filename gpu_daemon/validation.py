"""Request checks that need only the model's limits (vocabulary size, context length).

Kept free of torch and the engine so that a process without the model (the gateway in front
of the CPU daemon) can refuse bad requests with exactly the engine's messages.
"""

from __future__ import annotations

from collections.abc import Sequence

from hybridgen.sampling.params import SamplingParams


class InvalidRequest(ValueError):
    """A request field is out of range; the message names the field and the allowed range."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def validate_request(
    prompt_ids: Sequence[int], params: SamplingParams, vocab_size: int, max_model_len: int
) -> None:
    """Raise InvalidRequest or InvalidSamplingParameter naming the first bad field."""
    if not prompt_ids:
        raise InvalidRequest("prompt", "is empty: give at least one token")
    # The length first: it is O(1), and bounds the scan of the ids below.
    if len(prompt_ids) >= max_model_len:
        raise InvalidRequest(
            "prompt",
            f"has {len(prompt_ids)} tokens; the context allows at most "
            f"{max_model_len - 1} so that one token can be generated",
        )
    bad = next((t for t in prompt_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequest("prompt_token_ids", f"token id {bad} is outside [0, {vocab_size})")
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
