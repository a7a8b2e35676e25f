"""Payloads of the request tickets, and the ticket fields that describe them.

A new sequence crosses once (NEW_SEQ); afterwards only diffs cross: STEP_RESULT carries the
tokens a step produced, ABORT carries nothing.

    NEW_SEQ      payload: u32 n_json | params JSON | pad to 4 | int32 prompt ids
                 shape:   (prompt tokens, 0, 0, 0)
    STEP_RESULT  payload: int32 token ids | float32 logprobs (when HAS_LOGPROBS)
                          or, with ERROR, the UTF-8 error message
                 shape:   (new tokens, prompt tokens, output tokens, finish reason code)
                 flags:   FINISHED | HAS_LOGPROBS | ERROR
"""

from __future__ import annotations

import json
import struct
from dataclasses import asdict, dataclass

import numpy as np

from hybridgen.sampling.params import SamplingParams

FINISHED, HAS_LOGPROBS, ERROR = 1, 2, 4
FINISH_CODES = {None: 0, "stop": 1, "length": 2, "aborted": 3}
FINISH_NAMES = {code: name for name, code in FINISH_CODES.items()}
_U32 = struct.Struct("<I")


def encode_new_seq(prompt_ids: list[int], params: SamplingParams) -> bytes:
    head = json.dumps(asdict(params), separators=(",", ":")).encode()
    pad = b"\0" * (-(_U32.size + len(head)) % 4)
    ids = np.asarray(prompt_ids, dtype=np.int32).tobytes()
    return _U32.pack(len(head)) + head + pad + ids


def decode_new_seq(payload: bytes | memoryview) -> tuple[list[int], SamplingParams]:
    buf = bytes(payload)
    (n,) = _U32.unpack_from(buf, 0)
    fields = json.loads(buf[_U32.size : _U32.size + n])
    fields["stop_token_ids"] = tuple(fields.get("stop_token_ids", ()))
    start = _U32.size + n + (-(_U32.size + n) % 4)
    ids = np.frombuffer(buf, dtype=np.int32, offset=start).tolist()
    return ids, SamplingParams(**fields)


@dataclass(frozen=True)
class StepResult:
    """What one engine step produced for one request, as the CPU daemon receives it."""

    request_id: int
    token_ids: list[int]
    logprobs: list[float] | None
    finish_reason: str | None
    """None while running; stop, length or aborted at the end."""
    prompt_tokens: int
    output_tokens: int
    error: str | None = None
    """Set when the GPU daemon refused the request; the message names the field."""


def encode_step_result(result: StepResult) -> tuple[bytes, int, tuple[int, int, int, int]]:
    """-> (payload, flags, shape) for a STEP_RESULT ticket."""
    flags = FINISHED if result.finish_reason is not None or result.error else 0
    if result.error is not None:
        payload = result.error.encode()
        flags |= ERROR
    else:
        payload = np.asarray(result.token_ids, dtype=np.int32).tobytes()
        if result.logprobs is not None:
            payload += np.asarray(result.logprobs, dtype=np.float32).tobytes()
            flags |= HAS_LOGPROBS
    shape = (
        len(result.token_ids),
        result.prompt_tokens,
        result.output_tokens,
        FINISH_CODES[result.finish_reason],
    )
    return payload, flags, shape


def decode_step_result(
    request_id: int, flags: int, shape: tuple[int, int, int, int], payload: bytes | memoryview
) -> StepResult:
    n, prompt_tokens, output_tokens, code = shape
    if flags & ERROR:
        return StepResult(
            request_id, [], None, "aborted", prompt_tokens, output_tokens, bytes(payload).decode()
        )
    ids = np.frombuffer(payload, dtype=np.int32, count=n).tolist()
    logprobs = None
    if flags & HAS_LOGPROBS:
        logprobs = np.frombuffer(payload, dtype=np.float32, count=n, offset=4 * n).tolist()
    return StepResult(request_id, ids, logprobs, FINISH_NAMES[code], prompt_tokens, output_tokens)
