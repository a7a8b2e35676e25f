"""Ticket payloads between the daemons round-trip exactly."""

from __future__ import annotations

import numpy as np

from hybridgen.engine.request_output import RequestOutput
from hybridgen.engine.sequence import FinishReason
from hybridgen.engine.step_errors import ErrorCode, StepFailed
from hybridgen.ipc.messages import (
    CANDIDATES,
    decode_append,
    decode_new_seq,
    decode_prompt_chunk,
    decode_step_result,
    encode_append,
    encode_new_seq,
    encode_prompt_chunk,
    encode_step_result,
)
from hybridgen.sampling.candidates import Candidates
from hybridgen.sampling.params import SamplingParams


def round_trip(result: RequestOutput) -> RequestOutput:
    payload, flags, shape = encode_step_result(result)
    return decode_step_result(int(result.request_id), flags, shape, payload)


def out(
    rid: int,
    ids: list[int],
    logprobs: list[float] | None,
    reason: FinishReason | None,
    prompt: int,
    output: int,
    top_logprobs: list[list[tuple[int, float]]] | None = None,
    candidates: Candidates | None = None,
) -> RequestOutput:
    """An engine output as the GPU daemon sends it."""
    finished = reason is not None
    return RequestOutput(
        str(rid), ids, finished, reason, logprobs, top_logprobs, prompt, output, candidates
    )


def test_new_seq_round_trip() -> None:
    params = SamplingParams(temperature=0.7, top_k=5, seed=9, stop_token_ids=(3, 4), logprobs=2)
    ids, back = decode_new_seq(encode_new_seq([1, 2, 2**31 - 1], params))
    assert ids == [1, 2, 2**31 - 1] and back == params


def test_step_results_round_trip() -> None:
    tokens = out(7, [5, 6], [-0.5, -1.25], FinishReason.LENGTH, 10, 12)
    assert round_trip(tokens) == tokens
    refusal = StepFailed(ErrorCode.INVALID_ARGUMENT, "prompt_token_ids: token id 9 is outside")
    back = round_trip(RequestOutput.failed("8", refusal, 3))
    assert back.error is not None and str(back.error) == str(refusal)
    assert back.error.code is ErrorCode.INVALID_ARGUMENT and back.finished
    assert back.finish_reason is FinishReason.CANCELLED
    for reason in FinishReason:  # every reason crosses the ring as itself
        assert round_trip(out(3, [1], None, reason, 2, 1)).finish_reason is reason
    cands = Candidates(
        np.array([4, 9, 1], np.int32), np.array([3.5, 2.0, -1.0], np.float32), 4.25, 5.5
    )
    back = round_trip(out(9, [], None, None, 3, 1, candidates=cands))
    assert back.candidates is not None and back.finish_reason is None
    assert back.candidates.ids.tolist() == [4, 9, 1]
    assert back.candidates.logits.tolist() == [3.5, 2.0, -1.0]
    assert (back.candidates.lse, back.candidates.lse_t) == (4.25, 5.5)
    assert encode_step_result(out(9, [], None, None, 3, 1, candidates=cands))[1] & CANDIDATES


def test_append_round_trip() -> None:
    assert decode_append(encode_append(12345, -0.25)) == (12345, -0.25)


def test_top_logprobs_round_trip() -> None:
    top = [[(4, -0.5), (9, -1.5)], [(2, -0.25), (7, -3.0)]]
    result = out(7, [4, 2], [-0.5, -0.25], None, 10, 2, top_logprobs=top)
    assert round_trip(result) == result
    no_top = out(7, [4, 2], [-0.5, -0.25], None, 10, 2, top_logprobs=[[], []])
    assert round_trip(no_top).top_logprobs is None


def test_prompt_chunk_round_trip() -> None:
    assert decode_prompt_chunk(encode_prompt_chunk([0, 7, 2**31 - 1])) == [0, 7, 2**31 - 1]
    assert decode_prompt_chunk(encode_prompt_chunk([])) == []
