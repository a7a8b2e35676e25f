"""Payloads of the request tickets, and the ticket fields that describe them.

A new sequence crosses once (NEW_SEQ); afterwards only diffs cross: STEP_RESULT carries the
tokens a step produced, ABORT carries nothing.

    NEW_SEQ      payload: u32 n_json | params JSON | pad to 4 | int32 prompt ids
                 shape:   (prompt tokens, 0, 0, 0)
                 flags:   PROMPT_OPEN (streaming input: APPEND_PROMPT tickets bring the rest)
    STEP_RESULT  payload: int32 token ids | float32 logprobs (when HAS_LOGPROBS)
                          | int32 top ids[n * T] | float32 top logprobs[n * T] (HAS_TOP)
                          or, with ERROR, the UTF-8 error message
                          or, with CANDIDATES, int32 ids[K] | float32 logits[K] | lse, lse_t
                 shape:   (new tokens or K, prompt tokens, output tokens, finish reason code,
                          or with ERROR the step_errors.ErrorCode)
                 flags:   FINISHED | HAS_LOGPROBS | ERROR | CANDIDATES | HAS_TOP
    APPEND_TOKENS  payload: int32 token | float32 logprob  (the CPU's pick for CANDIDATES)
    APPEND_PROMPT  payload: int32 token ids (a chunk of an open prompt)
                   shape:   (tokens, keep: the prompt's tokens kept before them, 0, 0)
                   flags:   LAST_CHUNK (the prompt is complete; decoding starts)
    STATS        payload: a JSON object (GPU -> CPU), none (CPU -> GPU: a request for one)
    CORRUPT      payload: UTF-8 reason; request_id: the seq of the bad ticket

The decoders trust nothing: a payload whose size, encoding or fields do not match its op
raises CorruptPayload saying what is wrong, never another exception.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from dataclasses import asdict
from typing import Any

import numpy as np

from hybridgen.engine.request_output import RequestOutput
from hybridgen.engine.sequence import FinishReason
from hybridgen.engine.step_errors import ErrorCode, StepFailed
from hybridgen.ipc.ticket import CorruptPayload
from hybridgen.sampling.candidates import Candidates
from hybridgen.sampling.params import SamplingParams

FINISHED, HAS_LOGPROBS, ERROR, CANDIDATES, HAS_TOP = 1, 2, 4, 8, 16
PROMPT_OPEN = 1
"""NEW_SEQ flag."""
LAST_CHUNK = 1
"""APPEND_PROMPT flag."""
_PARAM_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))
_ERROR_CODES = frozenset(int(code) for code in ErrorCode)
FINISH_CODES: dict[FinishReason | None, int] = {
    None: 0,
    FinishReason.STOP: 1,
    FinishReason.LENGTH: 2,
    FinishReason.CANCELLED: 3,
    FinishReason.STOP_SEQUENCE: 4,
}
FINISH_REASONS = {code: reason for reason, code in FINISH_CODES.items()}
_U32 = struct.Struct("<I")


def encode_new_seq(prompt_ids: list[int], params: SamplingParams) -> bytes:
    head = json.dumps(asdict(params), separators=(",", ":")).encode()
    pad = b"\0" * (-(_U32.size + len(head)) % 4)
    ids = np.asarray(prompt_ids, dtype=np.int32).tobytes()
    return _U32.pack(len(head)) + head + pad + ids


def decode_new_seq(payload: bytes | memoryview) -> tuple[list[int], SamplingParams]:
    buf = bytes(payload)
    if len(buf) < _U32.size:
        raise CorruptPayload(f"NEW_SEQ payload of {len(buf)} bytes has no parameter header")
    (n,) = _U32.unpack_from(buf, 0)
    start = _U32.size + n + (-(_U32.size + n) % 4)
    if start > len(buf) or (len(buf) - start) % 4:
        raise CorruptPayload(
            f"NEW_SEQ payload of {len(buf)} bytes does not hold {n} bytes of parameters "
            "followed by whole int32 token ids"
        )
    fields = _json_object("NEW_SEQ parameters", buf[_U32.size : _U32.size + n])
    unknown = set(fields) - _PARAM_FIELDS
    if unknown:
        raise CorruptPayload(f"NEW_SEQ parameters have unknown fields {sorted(unknown)}")
    stops = fields.get("stop_token_ids", [])
    if not isinstance(stops, list):
        raise CorruptPayload(f"NEW_SEQ stop_token_ids is a {type(stops).__name__}, not a list")
    fields["stop_token_ids"] = tuple(stops)
    ids = np.frombuffer(buf, dtype=np.int32, offset=start).tolist()
    return ids, SamplingParams(**fields)  # value types and ranges: SamplingParams.validate


def _json_object(what: str, data: bytes) -> dict[str, Any]:
    try:
        value = json.loads(data)
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
        raise CorruptPayload(f"{what} are not UTF-8 JSON: {exc}") from None
    if not isinstance(value, dict):
        raise CorruptPayload(f"{what} are a JSON {type(value).__name__}, not an object")
    return value


def decode_stats(payload: bytes | memoryview) -> dict[str, Any]:
    """The GPU daemon's STATS payload: a JSON object of GetModelInfo fields."""
    return _json_object("STATS fields", bytes(payload))


def encode_step_result(result: RequestOutput) -> tuple[bytes, int, tuple[int, int, int, int]]:
    """-> (payload, flags, shape) for a STEP_RESULT ticket: one engine output, the type the
    CPU daemon gets back from decode_step_result."""
    flags = FINISHED if result.finished or result.error is not None else 0
    n = len(result.new_token_ids)
    if result.error is not None:
        payload = str(result.error).encode()
        flags |= ERROR
    elif result.candidates is not None:
        c = result.candidates
        n = len(c.ids)
        payload = (
            np.asarray(c.ids, dtype=np.int32).tobytes()
            + np.asarray(c.logits, dtype=np.float32).tobytes()
            + np.asarray([c.lse, c.lse_t], dtype=np.float32).tobytes()
        )
        flags |= CANDIDATES
    else:
        payload = np.asarray(result.new_token_ids, dtype=np.int32).tobytes()
        if result.logprobs is not None:
            payload += np.asarray(result.logprobs, dtype=np.float32).tobytes()
            flags |= HAS_LOGPROBS
        if result.logprobs is not None and result.top_logprobs and result.top_logprobs[0]:
            payload += _encode_top(result.top_logprobs)
            flags |= HAS_TOP
    last = FINISH_CODES[result.finish_reason] if result.error is None else result.error.code
    shape = (n, result.prompt_tokens, result.output_tokens, int(last))
    return payload, flags, shape


def decode_step_result(
    request_id: int, flags: int, shape: tuple[int, int, int, int], payload: bytes | memoryview
) -> RequestOutput:
    n, prompt_tokens, output_tokens, code = shape
    if flags & ERROR:
        if code not in _ERROR_CODES:
            raise CorruptPayload(f"STEP_RESULT error code {code} is not an ErrorCode")
        try:
            message = bytes(payload).decode()
        except UnicodeDecodeError as exc:
            raise CorruptPayload(f"STEP_RESULT error message is not UTF-8: {exc}") from None
        error = StepFailed(ErrorCode(code), message)
        return RequestOutput.failed(str(request_id), error, prompt_tokens, output_tokens)
    if code not in FINISH_REASONS:
        raise CorruptPayload(
            f"STEP_RESULT finish reason code {code} is not one of 0..{len(FINISH_REASONS) - 1}"
        )
    if flags & CANDIDATES:
        _expect_size(payload, 4 * n + 4 * (n + 2), f"{n} candidates")
        logits = np.frombuffer(payload, dtype=np.float32, count=n + 2, offset=4 * n)
        cands = Candidates(
            np.frombuffer(payload, dtype=np.int32, count=n).copy(),
            logits[:n].copy(),
            float(logits[n]),
            float(logits[n + 1]),
        )
        return RequestOutput(
            str(request_id), [], False, None, None, None, prompt_tokens, output_tokens, cands
        )
    logprobs = top = None
    base = (8 if flags & HAS_LOGPROBS else 4) * n
    if flags & HAS_TOP:
        extra = len(payload) - base
        if not (flags & HAS_LOGPROBS and n and extra > 0 and extra % (8 * n) == 0):
            raise CorruptPayload(
                f"STEP_RESULT top logprobs of {n} tokens need logprobs and a multiple of "
                f"{8 * max(n, 1)} bytes after {base}, got {len(payload)} bytes in all"
            )
    else:
        _expect_size(payload, base, f"{n} tokens")
    ids = np.frombuffer(payload, dtype=np.int32, count=n).tolist()
    if flags & HAS_LOGPROBS:
        logprobs = np.frombuffer(payload, dtype=np.float32, count=n, offset=4 * n).tolist()
    if flags & HAS_TOP:
        top = _decode_top(memoryview(payload)[8 * n :], n)
    reason = FINISH_REASONS[code]
    return RequestOutput(
        str(request_id),
        ids,
        reason is not None,
        reason,
        logprobs,
        top,
        prompt_tokens,
        output_tokens,
    )


def _encode_top(top: list[list[tuple[int, float]]]) -> bytes:
    """Every token's alternatives, as many for each: ids then logprobs, token by token."""
    width = len(top[0])
    assert all(len(t) == width for t in top), "one top-N width per result"
    pairs = [pair for token in top for pair in token]
    ids = np.asarray([p[0] for p in pairs], dtype=np.int32).tobytes()
    return ids + np.asarray([p[1] for p in pairs], dtype=np.float32).tobytes()


def _decode_top(buf: memoryview, n: int) -> list[list[tuple[int, float]]]:
    width = len(buf) // (8 * n)
    ids = np.frombuffer(buf, dtype=np.int32, count=n * width).tolist()
    lps = np.frombuffer(buf, dtype=np.float32, count=n * width, offset=4 * n * width).tolist()
    pairs = list(zip(ids, lps, strict=True))
    return [pairs[i * width : (i + 1) * width] for i in range(n)]


def _expect_size(payload: bytes | memoryview, size: int, what: str) -> None:
    if len(payload) != size:
        raise CorruptPayload(f"STEP_RESULT of {what} needs {size} bytes, got {len(payload)}")


_APPEND = struct.Struct("<if")


def encode_append(token_id: int, logprob: float) -> bytes:
    return _APPEND.pack(token_id, logprob)


def decode_append(payload: bytes | memoryview) -> tuple[int, float]:
    if len(payload) != _APPEND.size:
        raise CorruptPayload(f"APPEND_TOKENS needs {_APPEND.size} bytes, got {len(payload)}")
    token_id, logprob = _APPEND.unpack(bytes(payload))
    return token_id, logprob


def encode_prompt_chunk(token_ids: list[int]) -> bytes:
    return np.asarray(token_ids, dtype=np.int32).tobytes()


def decode_prompt_chunk(payload: bytes | memoryview) -> list[int]:
    if len(payload) % 4:
        raise CorruptPayload(f"APPEND_PROMPT payload of {len(payload)} bytes is not int32 ids")
    return np.frombuffer(payload, dtype=np.int32).tolist()
