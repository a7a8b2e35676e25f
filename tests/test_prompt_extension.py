"""Streaming input in the engine: a prompt that grows while its KV is computed
(Engine.add_request with prompt_open, Engine.extend_prompt) gives exactly the tokens of the
same prompt sent whole, including when a chunk replaces tokens already computed."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from hybridgen.config.engine import EngineConfig
from hybridgen.engine.engine import Engine
from hybridgen.engine.validation import InvalidRequest, UncheckedRequest
from hybridgen.sampling.params import SamplingParams

NEW = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    config = EngineConfig(
        model="tiny-llama",
        device="cpu",
        dtype="float32",
        block_size=8,
        max_model_len=192,
        max_num_batched_tokens=64,
        max_num_seqs=4,
    )
    eng = Engine(config)
    yield eng
    eng.release()


def prompt(n: int, salt: int = 0) -> list[int]:
    return [(37 * i + 11 * salt) % 250 + 1 for i in range(n)]


def run(engine: Engine, request_id: str) -> list[int]:
    tokens: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            assert out.request_id == request_id
            tokens += out.new_token_ids
    return tokens


def whole(engine: Engine, ids: list[int]) -> list[int]:
    engine.add_request("whole", ids, GREEDY)
    return run(engine, "whole")


def settle(engine: Engine) -> None:
    """Step until the open prompt has computed all it can (no token may come out)."""
    while engine.has_unfinished():
        assert engine.step() == []


def test_chunks_give_the_tokens_of_the_whole_prompt(engine: Engine) -> None:
    ids = prompt(100)
    expected = whole(engine, ids)
    engine.add_request("s", ids[:10], GREEDY, prompt_open=True)
    settle(engine)
    seq = engine.seqs["s"]
    assert seq.num_computed_tokens == 9  # the last token waits: computing it would sample
    assert not engine.has_unfinished()  # nothing to do until more prompt comes
    for start in range(10, 90, 13):
        end = min(start + 13, 90)
        engine.extend_prompt("s", start, ids[start:end], last=False)
        settle(engine)
        assert seq.num_computed_tokens == end - 1
    engine.extend_prompt("s", 90, ids[90:], last=True)
    assert run(engine, "s") == expected
    assert engine.pool.num_used == 0


def test_an_empty_start_then_chunks(engine: Engine) -> None:
    ids = prompt(40, salt=1)
    expected = whole(engine, ids)
    engine.add_request("s", [], GREEDY, prompt_open=True)
    assert not engine.has_unfinished()
    settle(engine)
    engine.extend_prompt("s", 0, ids[:1], last=False)
    assert not engine.has_unfinished()  # one token: it is the last, not computed yet
    engine.extend_prompt("s", 1, ids[1:], last=True)
    assert run(engine, "s") == expected


@pytest.mark.parametrize("keep", [3, 17, 30])
def test_a_chunk_that_replaces_computed_tokens(engine: Engine, keep: int) -> None:
    """Re-tokenizing a tail can change a token already computed: its KV is recomputed."""
    final = prompt(60, salt=2)
    expected = whole(engine, final)
    wrong = [*final[:keep], *prompt(40 - keep, salt=3)]
    engine.add_request("s", wrong, GREEDY, prompt_open=True)
    settle(engine)
    assert engine.seqs["s"].num_computed_tokens == 39
    engine.extend_prompt("s", keep, final[keep:], last=True)
    seq = engine.seqs["s"]
    assert seq.num_computed_tokens == keep // 8 * 8  # back to a block boundary
    assert run(engine, "s") == expected
    assert engine.pool.num_used == 0


def test_a_cached_prefix_is_not_overwritten_by_a_rewind(engine: Engine) -> None:
    """A sequence that shares cached blocks with another and rewinds into them leaves them
    intact: a third request with the first prompt still gets the first one's tokens."""
    first = prompt(48, salt=4)
    expected = whole(engine, first)
    engine.add_request("s", first[:40], GREEDY, prompt_open=True)
    settle(engine)
    other = [*first[:20], *prompt(30, salt=5)]
    engine.extend_prompt("s", 20, other[20:], last=True)
    assert run(engine, "s") == whole(engine, other)
    assert whole(engine, first) == expected


def test_bad_chunks_name_the_field_and_leave_the_request(engine: Engine) -> None:
    engine.add_request("s", prompt(10), GREEDY, prompt_open=True)
    cases = [
        ("ghost", 0, [1], False, "request_id"),
        ("s", 11, [1], False, "keep"),
        ("s", 10, [10**6], False, "chunk.token_ids"),
        ("s", 10, prompt(180 - 10 + 1), False, "chunk"),
        ("s", 0, [], True, "prompt"),
    ]
    for rid, keep, ids, last, field in cases:
        # An unknown request is a state the engine reports; a bad chunk is one the edge
        # (stream_input.PromptFeed) should have refused: an internal error naming the field.
        expected = InvalidRequest if rid == "ghost" else UncheckedRequest
        with pytest.raises(expected) as err:
            engine.extend_prompt(rid, keep, ids, last)
        error = err.value if rid == "ghost" else err.value.__cause__
        assert isinstance(error, InvalidRequest) and error.field == field
    engine.extend_prompt("s", 10, [], last=True)
    assert len(run(engine, "s")) == NEW
    with pytest.raises(InvalidRequest, match="no open prompt"):
        engine.add_request("t", prompt(5), GREEDY)
        engine.extend_prompt("t", 5, [1], last=True)
    engine.abort("t")


def test_abort_while_the_prompt_is_open_frees_its_blocks(engine: Engine) -> None:
    engine.add_request("s", prompt(50), GREEDY, prompt_open=True)
    settle(engine)
    assert engine.pool.num_used > 0
    engine.abort("s")
    assert engine.pool.num_used == 0 and not engine.has_unfinished()
