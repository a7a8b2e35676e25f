"""PromptStream: text chunks in, the prompt's ids out, and at the last chunk exactly the ids of
tokenizing the joined text, for every tokenizer style the tests build (byte-level BPE with the
Llama 3 and the Qwen2 regex, SentencePiece-style BPE) and the presets' byte tokenizer."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridgen.models.prompt_stream import PromptStream
from hybridgen.models.tokenizer import Tokenizer
from tests.checkpoints import TOKENIZER_STYLES, build_tokenizer

WORDS = (
    "the",
    "cat",
    "sat",
    "on",
    "mat",
    "speaking",
    "into",
    "microphone",
    "don't",
    "it's",
    "12345",
    "3.14",
    "2024-06-01",
    "é",
    "e\u0301",
    "naïve",
    "日本語",
    "中文字",
    "🙂",
    "👍🏽",
    "...",
    "!!",
    "?",
    "(",
    ")",
    '"',
    "'",
    "-",
    "_",
    "<|begin_of_text|>",
    "def",
    "x_1",
)
SEPARATORS = (" ", " ", " ", "  ", "\n", "\n\n", "\t", ", ", ". ", "")


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Tokenizer]:
    built = {"bytes": Tokenizer.synthetic(512)}
    for style in TOKENIZER_STYLES:
        directory = Path(tmp_path_factory.mktemp(f"tok-{style}"))
        build_tokenizer(directory, style)
        built[style] = Tokenizer.from_dir(directory)
    return built


texts = st.lists(
    st.tuples(st.sampled_from(WORDS), st.sampled_from(SEPARATORS)), min_size=0, max_size=60
).map(lambda parts: "".join(w + s for w, s in parts))


def chunked(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts})
    bounds = [0, *points, len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


def stream(tok: Tokenizer, chunks: list[str], add_special: bool) -> tuple[list[int], int]:
    """The ids after the last chunk, checking the keep/new contract at every step; and how
    many tokens were committed before the last chunk."""
    ps = PromptStream(tok, add_special)
    ids = list(ps.token_ids)
    before = 0
    for i, chunk in enumerate(chunks):
        last = i == len(chunks) - 1
        keep, new = ps.push(chunk, last)
        assert 0 <= keep <= len(ids)
        ids = ids[:keep] + new
        assert ids == ps.token_ids
        assert len(ids) <= ps.num_tokens
        if not last:
            before = len(ids)
    return ids, before


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=texts, cuts=st.lists(st.integers(0, 10**6), max_size=12), special=st.booleans())
def test_chunked_equals_the_joined_text(
    tokenizers: dict[str, Tokenizer], text: str, cuts: list[int], special: bool
) -> None:
    chunks = chunked(text, cuts) or [""]
    for name, tok in tokenizers.items():
        ids, _ = stream(tok, chunks, special)
        assert ids == tok.encode(text, add_special_tokens=special), name


@pytest.mark.parametrize("style", ["bytes", *TOKENIZER_STYLES])
def test_a_long_text_in_small_chunks_commits_as_it_goes(
    tokenizers: dict[str, Tokenizer], style: str
) -> None:
    tok = tokenizers[style]
    text = " ".join(WORDS[i % 14] for i in range(600)) + "."
    chunks = [text[i : i + 37] for i in range(0, len(text), 37)]
    ps = PromptStream(tok, True)
    rewound = 0
    for i, chunk in enumerate(chunks):
        before = len(ps.token_ids)
        keep, _ = ps.push(chunk, i == len(chunks) - 1)
        rewound += before - keep
    assert ps.token_ids == tok.encode(text)
    assert rewound == 0  # the held tail is never committed, so nothing committed changes
    full = len(ps.token_ids)
    ps2 = PromptStream(tok, True)
    for chunk in chunks[:-1]:
        ps2.push(chunk, False)
    assert len(ps2.token_ids) > full - 40  # all but the last chunk's tokens were committed


def test_nothing_is_pushed_after_the_last_chunk(tokenizers: dict[str, Tokenizer]) -> None:
    ps = PromptStream(tokenizers["bytes"], True)
    ps.push("hello", True)
    with pytest.raises(AssertionError):
        ps.push(" again", True)
