"""OpenAI request bodies (/v1/completions, /v1/chat/completions) -> the gateway's
GenerateInput, checked field by field; errors name the OpenAI parameter.

What the sampling values may be is left to the backend's checks, as for gRPC (their errors
name the same parameters: temperature, top_p, ...). Unknown parameters are ignored, as
OpenAI's API does, except those that would change the result and are not supported yet
(`UNSUPPORTED`), which are refused.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from hybridgen.engine.validation import InvalidRequest
from hybridgen.models.chat import ChatMessage, InvalidChat, check_messages
from hybridgen.sampling.params import MAX_LOGPROBS, MAX_SEED, SamplingParams
from hybridgen.serving.service import DEFAULT_MAX_TOKENS, GenerateInput
from hybridgen.serving.stop_strings import validate_stops

MAX_N = 16
"""Most samples one request may ask for (n)."""
_SAMPLING = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)
_NEUTRAL: dict[str, Callable[[Any], bool]] = {
    "tools": lambda v: not v,
    "functions": lambda v: not v,
    "tool_choice": lambda v: v in (None, "none"),
    "function_call": lambda v: v in (None, "none"),
    "response_format": lambda v: v is None or (isinstance(v, dict) and v.get("type") == "text"),
    "logit_bias": lambda v: not v,
    "echo": lambda v: not v,
    "suffix": lambda v: not v,
    "prompt_logprobs": lambda v: v is None,
    "guided_json": lambda v: v is None,
    "guided_regex": lambda v: v is None,
    "guided_choice": lambda v: v is None,
    "guided_grammar": lambda v: v is None,
    "structured_outputs": lambda v: v is None,
    "include_stop_str_in_output": lambda v: not v,
    "skip_special_tokens": lambda v: v in (None, True),
    "best_of": lambda v: v is None or (v == 1 and not isinstance(v, bool)),
    # vLLM's extra parameters that change what is generated
    "min_tokens": lambda v: v is None or (v == 0 and not isinstance(v, bool)),
    "bad_words": lambda v: not v,
    "allowed_token_ids": lambda v: v is None,
    "logits_processors": lambda v: not v,
    "truncate_prompt_tokens": lambda v: v is None,
    "use_beam_search": lambda v: not v,
    "chat_template": lambda v: v is None,
    "chat_template_kwargs": lambda v: not v,
    "continue_final_message": lambda v: not v,
}
"""Parameters that change the result and are not supported: each with what a request may
send that asks for nothing (absent, null, false, empty, or the default)."""


@dataclass(frozen=True)
class OpenAIRequest:
    """A checked completions or chat request: its prompts and how to answer."""

    chat: bool
    """/v1/chat/completions (else /v1/completions)."""
    model: str | None
    """The model the client named."""
    inputs: tuple[GenerateInput, ...]
    """One per prompt (chat: one), each with its own request id; n samples of each."""
    n: int
    """Samples of each prompt."""
    stream: bool
    """Answer with server-sent events."""
    include_usage: bool
    """stream_options.include_usage: a last event with the usage."""
    continuous_usage: bool
    """stream_options.continuous_usage_stats (vLLM's): the usage so far in every event."""
    logprobs: bool
    """Each token's logprob (and params.logprobs alternatives) are returned."""
    aliases: dict[str, str]
    """Internal field names -> the parameter the client used (for error messages)."""
    to_context_end: bool
    """Chat without max_tokens: generate up to the end of the context (OpenAI's default)."""


def parse(body: Any, chat: bool, prompts: list[str | list[int]]) -> OpenAIRequest:
    """Check `body` (a JSON object); `prompts`: the prompt(s), already taken from `prompt`
    or rendered from `messages` by the caller. Raises InvalidRequest naming the parameter."""
    for name, neutral in _NEUTRAL.items():
        if name in body and not neutral(body[name]):
            raise InvalidRequest(name, "is not supported by this server; leave it out")
    aliases: dict[str, str] = {}
    params = _sampling(body, chat, aliases)
    stop = body.get("stop")
    stops = validate_stops([stop] if isinstance(stop, str) else ([] if stop is None else stop))
    add_special = _get(body, "add_special_tokens", bool, not chat)
    base = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    inputs = tuple(
        GenerateInput(
            request_id=f"{base}-{i}",
            prompt=prompt if isinstance(prompt, str) else None,
            prompt_token_ids=() if isinstance(prompt, str) else tuple(prompt),
            messages=(),  # a chat comes rendered by the model's template, as text
            add_generation_prompt=False,
            add_special_tokens=add_special,
            params=params,
            stop=tuple(stops),
        )
        for i, prompt in enumerate(prompts)
    )
    options = _get(body, "stream_options", dict, {})
    return OpenAIRequest(
        chat=chat,
        model=_get(body, "model", str, None),
        inputs=inputs,
        n=_int(body, "n", 1, 1, MAX_N),
        stream=_get(body, "stream", bool, False),
        include_usage=_get(options, "include_usage", bool, False, "stream_options."),
        continuous_usage=_get(options, "continuous_usage_stats", bool, False, "stream_options."),
        logprobs=params.logprobs is not None,
        aliases=aliases,
        to_context_end=chat and _max_tokens(body, chat) is None,
    )


def completion_prompts(body: Any) -> list[str | list[int]]:
    """/v1/completions' `prompt`: a string, a list of strings, token ids, or lists of them."""
    prompt = body.get("prompt")
    if isinstance(prompt, str) or _is_ids(prompt):
        return [prompt]
    many = isinstance(prompt, list) and bool(prompt)
    if many and all(isinstance(p, str) or _is_ids(p) for p in prompt):
        return list(prompt)
    raise InvalidRequest(
        "prompt", "must be a string, a list of token ids, or a non-empty list of either"
    )


def chat_messages(body: Any) -> list[dict[str, Any]]:
    """/v1/chat/completions' `messages`, with content parts joined into text."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages", "must be a non-empty list of {role, content} objects")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise InvalidRequest(f"messages[{i}]", "must be an object with a string role")
        content = message.get("content")
        if isinstance(content, list):
            content = _text_parts(content, f"messages[{i}].content")
        elif content is None and message["role"] != "assistant":
            raise InvalidRequest(
                f"messages[{i}].content", "is missing (a string or a list of parts)"
            )
        elif content is not None and not isinstance(content, str):
            raise InvalidRequest(f"messages[{i}].content", "must be a string or a list of parts")
        role = message["role"]
        if role == "developer":  # OpenAI's newer name for the system message
            role = "system"
        # an assistant's content may be null
        out.append({**message, "role": role, "content": content or ""})
    try:  # the roles and the count, as every API checks them
        check_messages([ChatMessage(m["role"], m["content"]) for m in out])
    except InvalidChat as exc:
        raise InvalidRequest(exc.field, exc.problem) from None
    return out


def sample_inputs(req: GenerateInput, n: int) -> list[GenerateInput]:
    """The n samples of one prompt: request ids -0..-(n-1); with a seed, seed + i each, so
    that the samples differ and the request stays reproducible."""
    out = []
    for i in range(n):
        params, seed = req.params, req.params.seed
        if seed is not None and i:
            params = replace(params, seed=(seed + i) % (MAX_SEED + 1))
        out.append(replace(req, request_id=f"{req.request_id}-{i}", params=params))
    return out


RANDOM_SEED = -1
"""A seed that asks for no seed (llama.cpp's and Ollama's convention): a random draw."""


def _sampling(body: Any, chat: bool, aliases: dict[str, str]) -> SamplingParams:
    values = {k: body[k] for k in _SAMPLING if body.get(k) is not None}
    if values.get("seed") == RANDOM_SEED and not isinstance(values["seed"], bool):
        del values["seed"]
    max_tokens = _max_tokens(body, chat)
    if chat and body.get("max_completion_tokens") is not None:
        aliases["max_tokens"] = "max_completion_tokens"
    ids = body.get("stop_token_ids") or []
    if not isinstance(ids, list):
        raise InvalidRequest("stop_token_ids", "must be a list of token ids")
    return SamplingParams(
        **values,
        max_tokens=DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens,
        stop_token_ids=tuple(ids),
        ignore_eos=_get(body, "ignore_eos", bool, False),
        logprobs=_logprobs(body, chat, aliases),
    )


def _max_tokens(body: Any, chat: bool) -> Any:
    """max_completion_tokens (chat) before max_tokens; None when neither is given."""
    if chat and body.get("max_completion_tokens") is not None:
        return body["max_completion_tokens"]
    return body.get("max_tokens")


def _logprobs(body: Any, chat: bool, aliases: dict[str, str]) -> int | None:
    """completions: logprobs = N alternatives; chat: logprobs (bool) and top_logprobs = N."""
    if not chat:
        value = body.get("logprobs")
        return None if value is None else _int(body, "logprobs", 0, 0, MAX_LOGPROBS)
    top = body.get("top_logprobs")
    if not _get(body, "logprobs", bool, False):
        if top is not None:
            raise InvalidRequest("top_logprobs", "needs logprobs: true")
        return None
    aliases["logprobs"] = "top_logprobs"
    return _int(body, "top_logprobs", 0, 0, MAX_LOGPROBS)


def _text_parts(parts: list[Any], field: str) -> str:
    texts = []
    for j, part in enumerate(parts):
        if not isinstance(part, dict) or part.get("type") != "text":
            raise InvalidRequest(f"{field}[{j}]", "only text parts are supported")
        if not isinstance(part.get("text"), str):
            raise InvalidRequest(f"{field}[{j}].text", "must be a string")
        texts.append(part["text"])
    return "".join(texts)


def _is_ids(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    )


def _get(body: Any, name: str, kind: type, default: Any, prefix: str = "") -> Any:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        article = "an" if kind.__name__[0] in "aeiou" else "a"
        raise InvalidRequest(f"{prefix}{name}", f"must be {article} {kind.__name__}, got {value!r}")
    return value


def _int(body: Any, name: str, default: int, lo: int, hi: int) -> int:
    value: int = _get(body, name, int, default)
    if not lo <= value <= hi:
        raise InvalidRequest(name, f"{value} is out of range: allowed {lo} <= {name} <= {hi}")
    return value
