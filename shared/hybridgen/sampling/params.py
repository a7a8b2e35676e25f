"""Per-request sampling parameters and their validation.

Ranges follow the OpenAI / vLLM conventions where those exist. Caps chosen here:
- temperature <= 100: beyond that the distribution is uniform to within float32 rounding for
  any realistic logit range, so larger values only hide client bugs.
- repetition_penalty <= 10: HF-style division by more than 10 already drives any positive logit
  to near zero; larger values are almost certainly a confusion with another scale.
- logprobs <= 20: OpenAI's limit for top log-probabilities.
- seed <= 2**63 - 1: seeds are held in int64 tensors on the device.
- at most 1024 stop_token_ids: a model's stop set is a handful of ids (EOS variants, end of
  turn); the cap keeps a request's parameters a few KB, checked before they are copied.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Integral, Real
from typing import Any

MAX_TEMPERATURE = 100.0
"""Largest accepted temperature."""
MAX_REPETITION_PENALTY = 10.0
"""Largest accepted HF-style repetition penalty."""
MAX_ABS_PRESENCE_FREQUENCY = 2.0
"""OpenAI's bound on |presence_penalty| and |frequency_penalty|."""
MAX_LOGPROBS = 20
"""Largest number of top log-probabilities a request may ask for."""
MAX_SEED = 2**63 - 1
"""Largest seed: seeds must fit in int64."""
MAX_STOP_TOKEN_IDS = 1024
"""Most stop token ids a request may give."""


class InvalidSamplingParameter(ValueError):
    """A sampling parameter outside its allowed range; `field` names the parameter."""

    def __init__(self, field: str, value: Any, allowed: str, problem: str = "is out of range"):
        self.field = field
        self.value = value
        self.allowed = allowed
        super().__init__(f"{field}={value!r} {problem}: allowed {allowed}")


def _is_int(value: Any) -> bool:
    # bool is an int subclass, but top_k=True is a client bug, not 1.
    return isinstance(value, Integral) and not isinstance(value, bool)


def _check_real(field: str, value: Any, lo: float, hi: float, lo_open: bool = False) -> None:
    """Raise unless value is a finite real in [lo, hi] (or (lo, hi] when lo_open)."""
    lo_op = "<" if lo_open else "<="
    allowed = f"{lo:g} {lo_op} {field} <= {hi:g} (finite)"
    if not isinstance(value, Real) or isinstance(value, bool):
        raise InvalidSamplingParameter(field, value, allowed, "is not a real number")
    value = float(value)
    in_range = (lo < value if lo_open else lo <= value) and value <= hi
    if not math.isfinite(value) or not in_range:
        raise InvalidSamplingParameter(field, value, allowed)


def _check_int(field: str, value: Any, lo: int, hi: int | None, allowed: str) -> None:
    """Raise unless value is an int in [lo, hi] (hi None: unbounded)."""
    if not _is_int(value):
        raise InvalidSamplingParameter(field, value, allowed, "is not an integer")
    if value < lo or (hi is not None and value > hi):
        raise InvalidSamplingParameter(field, value, allowed)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next tokens of one request."""

    temperature: float = 1.0
    """Softmax temperature; 0 means greedy (argmax of the penalised logits)."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 or -1 disables the filter."""
    top_p: float = 1.0
    """Keep the smallest set of most likely tokens whose probability sums to >= top_p."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the most likely token's."""
    seed: int | None = None
    """Random seed; None lets the engine draw one at admission (still self-consistent)."""
    repetition_penalty: float = 1.0
    """HF-style penalty over prompt and output tokens; 1 disables it."""
    presence_penalty: float = 0.0
    """OpenAI-style penalty subtracted once from every token present in the output."""
    frequency_penalty: float = 0.0
    """OpenAI-style penalty subtracted per occurrence of a token in the output."""
    max_tokens: int = 16
    """Maximum number of tokens to generate."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end generation (in addition to EOS unless ignore_eos)."""
    ignore_eos: bool = False
    """Keep generating after EOS."""
    logprobs: int | None = None
    """None: no logprobs; 0: logprob of the sampled token; N: plus the top N alternatives."""

    def __post_init__(self) -> None:
        # Accept any iterable of ids but store a tuple so the params stay hashable.
        if not isinstance(self.stop_token_ids, tuple):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    @property
    def is_greedy(self) -> bool:
        """True when the result is the argmax regardless of the seed."""
        return self.temperature == 0 or self.top_k == 1

    def validate(self, vocab_size: int, max_model_len: int | None = None) -> None:
        """Raise InvalidSamplingParameter for the first field outside its allowed range."""
        if not _is_int(vocab_size) or vocab_size < 1:
            raise ValueError(f"vocab_size must be a positive int, got {vocab_size!r}")
        _check_real("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        _check_int("top_k", self.top_k, -1, vocab_size, f"-1 <= top_k <= {vocab_size}")
        _check_real("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        _check_real("min_p", self.min_p, 0.0, 1.0)
        _check_real(
            "repetition_penalty", self.repetition_penalty, 0.0, MAX_REPETITION_PENALTY, True
        )
        bound = MAX_ABS_PRESENCE_FREQUENCY
        _check_real("presence_penalty", self.presence_penalty, -bound, bound)
        _check_real("frequency_penalty", self.frequency_penalty, -bound, bound)
        if max_model_len is None:
            _check_int("max_tokens", self.max_tokens, 1, None, "max_tokens >= 1")
        else:
            allowed = f"1 <= max_tokens <= {max_model_len} (max_model_len)"
            _check_int("max_tokens", self.max_tokens, 1, max_model_len, allowed)
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidSamplingParameter(
                "stop_token_ids",
                f"{len(self.stop_token_ids)} ids",
                f"at most {MAX_STOP_TOKEN_IDS} ids",
                "has too many ids",
            )
        allowed_id = f"0 <= stop_token_ids[i] < {vocab_size}"
        for token_id in self.stop_token_ids:
            _check_int("stop_token_ids", token_id, 0, vocab_size - 1, allowed_id)
        if not isinstance(self.ignore_eos, bool):
            raise InvalidSamplingParameter(
                "ignore_eos", self.ignore_eos, "True or False", "is not a bool"
            )
        if self.logprobs is not None:
            allowed = f"None or 0 <= logprobs <= {MAX_LOGPROBS}"
            _check_int("logprobs", self.logprobs, 0, MAX_LOGPROBS, allowed)
        if self.seed is not None:
            allowed = f"None (-1 over HTTP) or 0 <= seed <= {MAX_SEED}"
            _check_int("seed", self.seed, 0, MAX_SEED, allowed)
