"""StopStringMatcher: the output is cut before the first stop string, whatever the deltas."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridgen.models.tokenizer import Tokenizer
from hybridgen.serving.detokenizer import IncrementalDetokenizer
from hybridgen.serving.stop_strings import (
    MAX_STOP_LENGTH,
    MAX_STOP_STRINGS,
    StopStringError,
    StopStringMatcher,
)

HYPOTHESIS = settings(deadline=None, max_examples=100)


def run(stops: list[str], deltas: list[str]) -> tuple[str, bool, list[str]]:
    """Feed `deltas`, flushing at the end: (emitted text, stopped, per-feed emissions)."""
    matcher = StopStringMatcher(stops)
    pieces: list[str] = []
    stopped = False
    for delta in deltas:
        text, now_stopped = matcher.feed(delta)
        assert not (stopped and text), "text emitted after the stop"
        assert stopped <= now_stopped, "a stop cannot be undone"
        pieces.append(text)
        stopped = now_stopped
    tail = matcher.flush()
    assert not (stopped and tail)
    return "".join(pieces) + tail, stopped, pieces


def expected(text: str, stops: list[str]) -> tuple[str, bool]:
    """Brute force: grow the text a character at a time; at the first length where any stop
    string occurs, cut before the earliest-starting occurrence."""
    for end in range(1, len(text) + 1):
        starts = [i for s in stops if (i := text[:end].find(s)) >= 0]
        if starts:
            return text[: min(starts)], True
    return text, False


def split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({min(c, len(text)) for c in cuts})
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]


def test_stop_spanning_deltas() -> None:
    emitted, stopped, pieces = run(["</end>"], ["abc</", "en", "d>xyz", "more"])
    assert (emitted, stopped) == ("abc", True)
    assert pieces == ["abc", "", "", ""]


def test_stop_spanning_many_single_character_deltas() -> None:
    emitted, stopped, _ = run(["STOP"], list("say STOP now"))
    assert (emitted, stopped) == ("say ", True)


def test_stop_at_first_character() -> None:
    assert run(["a"], ["abc"])[:2] == ("", True)
    assert run(["ab"], ["a", "b", "c"])[:2] == ("", True)


def test_overlapping_stops_earliest_wins() -> None:
    for deltas in (["abc"], ["a", "bc"], ["ab", "c"], ["a", "b", "c"]):
        assert run(["ab", "bc"], deltas)[:2] == ("", True)
        assert run(["bc", "ab"], ["x", *deltas])[:2] == ("x", True)
    # Completing together: the earlier start wins whatever the list order.
    assert run(["bc", "abc"], ["xab", "c"])[:2] == ("x", True)
    # A stop inside a longer one completes first and ends the output.
    assert run(["abcd", "bc"], ["abcd"])[:2] == ("a", True)


def test_incomplete_stop_is_emitted_at_flush() -> None:
    matcher = StopStringMatcher(["</end>"])
    assert matcher.feed("abc</en") == ("abc", False)
    assert matcher.feed("d") == ("", False)
    assert matcher.flush() == "</end"
    assert not matcher.stopped


def test_held_text_released_when_it_stops_matching() -> None:
    matcher = StopStringMatcher(["\n\n"])
    assert matcher.feed("line\n") == ("line", False)
    assert matcher.feed("next") == ("\nnext", False)
    assert matcher.feed("\n\nafter") == ("", True)
    assert matcher.matched == "\n\n"
    assert matcher.feed("more") == ("", True)
    assert matcher.flush() == ""


def test_no_stops_passes_through() -> None:
    assert run([], ["a", "b"])[:2] == ("ab", False)


def test_duplicates_are_harmless() -> None:
    assert run(["x", "x"], ["abxcd"])[:2] == ("ab", True)


@pytest.mark.parametrize(
    ("stops", "message"),
    [
        ([""], "non-empty"),
        (["ok", ""], r"stop\[1\]"),
        (["x" * (MAX_STOP_LENGTH + 1)], str(MAX_STOP_LENGTH)),
        ([str(i) for i in range(MAX_STOP_STRINGS + 1)], str(MAX_STOP_STRINGS)),
        ([1], "string"),
        ("abc", "list"),
    ],
)
def test_validation(stops: list[str], message: str) -> None:
    with pytest.raises(StopStringError, match=message) as info:
        StopStringMatcher(stops)
    assert str(info.value).startswith("stop")
    assert isinstance(info.value, ValueError)


def test_limits_are_inclusive() -> None:
    stops = ["x" * MAX_STOP_LENGTH] + [str(i) for i in range(MAX_STOP_STRINGS - 1)]
    assert StopStringMatcher(stops).feed("a") == ("a", False)


SMALL = st.text("ab\n ", max_size=4).filter(bool)


@HYPOTHESIS
@given(
    text=st.text("ab\n ", max_size=40),
    stops=st.lists(SMALL, max_size=4),
    cuts=st.lists(st.integers(0, 40), max_size=12),
)
def test_emitted_text_is_text_before_first_match(
    text: str, stops: list[str], cuts: list[int]
) -> None:
    assert run(stops, split(text, cuts))[:2] == expected(text, stops)


@HYPOTHESIS
@given(
    text=st.text(max_size=60),
    stops=st.lists(st.text(min_size=1, max_size=6), min_size=1, max_size=5),
    cuts=st.lists(st.integers(0, 60), max_size=12),
    data=st.data(),
)
def test_unicode_text_with_planted_stops(
    text: str, stops: list[str], cuts: list[int], data: st.DataObject
) -> None:
    at = data.draw(st.integers(0, len(text)))
    text = text[:at] + data.draw(st.sampled_from(stops)) + text[at:]
    assert run(stops, split(text, cuts))[:2] == expected(text, stops)


def test_with_detokenizer_deltas() -> None:
    tok = Tokenizer.synthetic(300)
    prompt = tok.encode("Q: ")
    detok = IncrementalDetokenizer(tok, prompt)
    matcher = StopStringMatcher(["🙂 END"])
    out, stopped = "", False
    for token in tok.encode("answer 42 🙂 END trailing", add_special_tokens=False):
        text, stopped = matcher.feed(detok.push([token]))
        out += text
        if stopped:
            break
    assert (out, stopped) == ("answer 42 ", True)
