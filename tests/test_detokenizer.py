"""IncrementalDetokenizer: streamed deltas concatenate to the in-context decode, hold back
incomplete UTF-8, keep SentencePiece spacing after the prompt, and stay O(1) per token."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tests.checkpoints as ck
from hybridgen.models.tokenizer import Tokenizer
from hybridgen.serving.detokenizer import IncrementalDetokenizer

STYLES = ("llama3", "qwen2", "llama2", "synthetic")
FFFD = "\ufffd"
HYPOTHESIS = settings(deadline=None, max_examples=100, suppress_health_check=[HealthCheck.too_slow])

# Pieces that stress the tokenizers: spaces and newlines (SentencePiece "▁", byte-level "Ġ"),
# multi-byte characters that are in the trained vocabularies and ones that are not (byte
# fallback / split bytes), emoji with modifiers and ZWJ sequences, combining accents.
PIECES = (
    "Hello",
    " world",
    "the",
    " ",
    "  ",
    "\n",
    "\n\n",
    "\t",
    ".",
    "!",
    "don't",
    "3.14",
    "café",
    "naïve",
    "Zürich",
    "e\u0301",
    "ß",
    "Ω",
    "日本語",
    "中文",
    "한국어",
    "ありがとう",
    "🙂",
    "🚀",
    "🦀",
    "👍🏽",
    "❤️",
    "👨‍👩‍👧‍👦",
    "🏳️‍🌈",
    "∑",
    "→",
    "\u00a0",
    "𝔘𝔫𝔦",
)
TEXTS = st.lists(
    st.sampled_from(PIECES)
    | st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=4),
    max_size=16,
).map("".join)


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Tokenizer]:
    built = {"synthetic": Tokenizer.synthetic(512)}
    for style in ("llama3", "qwen2", "llama2"):
        directory: Path = tmp_path_factory.mktemp(f"tok-{style}")
        ck.build_tokenizer(directory, style)
        built[style] = Tokenizer.from_dir(directory)
    return built


def reference(tok: Tokenizer, prompt: list[int], output: list[int], skip: bool) -> str:
    """The output decoded in the context of the prompt (the detokenizer's contract)."""
    return tok.decode(prompt + output, skip)[len(tok.decode(prompt, skip)) :]


def stream(
    tok: Tokenizer, prompt: list[int], output: list[int], sizes: list[int], skip: bool = True
) -> list[str]:
    """Push `output` in chunks of the given sizes (cycled, then one by one); deltas + flush."""
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    deltas, i = [], 0
    for size in sizes:
        deltas.append(detok.push(output[i : i + size]))
        i += size
    deltas += [detok.push([t]) for t in output[i:]]
    return [*deltas, detok.flush()]


class CountingTokenizer:
    """Forwards to a Tokenizer and counts how many ids all decode calls covered."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok
        self.decoded = 0

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        self.decoded += len(ids)
        return self.tok.decode(ids, skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self.tok.id_to_token(token_id)


@pytest.mark.parametrize("style", STYLES)
def test_text_streams_to_reference(style: str, tokenizers: dict[str, Tokenizer]) -> None:
    tok = tokenizers[style]

    @HYPOTHESIS
    @given(
        text=TEXTS,
        split=st.floats(0, 1),
        sizes=st.lists(st.integers(0, 4), max_size=8),
        eos=st.booleans(),
    )
    def check(text: str, split: float, sizes: list[int], eos: bool) -> None:
        ids = tok.encode(text)
        k = round(split * len(ids))
        prompt, output = ids[:k], ids[k:] + ([tok.eos_token_id] if eos else [])
        deltas = stream(tok, prompt, output, sizes)
        expected = reference(tok, prompt, output, True)
        assert "".join(deltas) == expected
        if FFFD not in text:
            assert not any(FFFD in d for d in deltas)
        # Appending the stream to the displayed prompt gives the displayed whole: the spacing
        # after the prompt is right (whenever the prompt itself ends on a whole character).
        shown = tok.decode(prompt, True)
        if FFFD not in shown:
            assert shown + "".join(deltas) == tok.decode(prompt + output, True)

    check()


@pytest.mark.parametrize("style", STYLES)
def test_text_output_matches_plain_decode(style: str, tokenizers: dict[str, Tokenizer]) -> None:
    """After a text prompt, byte-level output is exactly decode(output); SentencePiece output
    differs only by the leading space that decode(output) alone strips."""
    tok = tokenizers[style]

    @HYPOTHESIS
    @given(prompt_text=TEXTS, text=TEXTS)
    def check(prompt_text: str, text: str) -> None:
        prompt = tok.encode(prompt_text)
        output = tok.encode(text, add_special_tokens=False)
        streamed = "".join(stream(tok, prompt, output, []))
        plain = tok.decode(output, True)
        if style == "llama2":
            assert streamed in (plain, " " + plain)
        else:
            assert streamed == plain

    check()


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("skip", [True, False])
def test_random_ids_stream_to_reference(
    style: str, skip: bool, tokenizers: dict[str, Tokenizer]
) -> None:
    """Arbitrary ids (invalid byte runs, specials anywhere): U+FFFD only where the reference
    decode has it, because the deltas concatenate to exactly that decode."""
    tok = tokenizers[style]
    ids = st.lists(st.integers(0, tok.vocab_size - 1), max_size=40)

    @HYPOTHESIS
    @given(prompt=ids, output=ids, sizes=st.lists(st.integers(0, 4), max_size=8))
    def check(prompt: list[int], output: list[int], sizes: list[int]) -> None:
        deltas = stream(tok, prompt, output, sizes, skip)
        assert "".join(deltas) == reference(tok, prompt, output, skip)

    check()


@pytest.mark.parametrize("style", STYLES)
def test_spacing_after_prompt(style: str, tokenizers: dict[str, Tokenizer]) -> None:
    tok = tokenizers[style]
    prompt = tok.encode("Hello")
    ids = tok.encode("Hello world, and more")
    assert ids[: len(prompt)] == prompt
    deltas = stream(tok, prompt, ids[len(prompt) :], [])
    assert "".join(deltas) == " world, and more"
    assert deltas[0].startswith(" ")  # the first token already carries its space
    # Without a prompt, SentencePiece strips the first space, exactly as decode does.
    alone = "".join(stream(tok, [], tok.encode(" world", add_special_tokens=False), []))
    assert alone == tok.decode(tok.encode(" world", add_special_tokens=False), True)


def test_spacing_after_chat_prompt_ending_in_special(tokenizers: dict[str, Tokenizer]) -> None:
    tok = tokenizers["llama2"]
    prompt = [*tok.encode("[INST] Hi [/INST]"), tok.eos_token_id or 0]
    output = tok.encode(" Sure", add_special_tokens=False)
    # Skipped specials are not context: the space is kept after the prompt's last text.
    assert "".join(stream(tok, prompt, output, [])) == " Sure"
    shown = "".join(stream(tok, prompt, output, [], skip=False))
    assert shown == reference(tok, prompt, output, False)


@pytest.mark.parametrize("style", STYLES)
def test_incomplete_character_is_held_back(style: str, tokenizers: dict[str, Tokenizer]) -> None:
    tok = tokenizers[style]
    output = tok.encode("a🦀b", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, tok.encode("x"))
    deltas = [detok.push([t]) for t in output] + [detok.flush()]
    # SentencePiece encodes a standalone text with a leading "▁", which shows after a prompt.
    assert "".join(deltas) == ("a🦀b" if style != "llama2" else " a🦀b")
    assert any("🦀" in d for d in deltas)  # emitted whole, never as U+FFFD pieces
    assert not any(FFFD in d for d in deltas)


def test_bytes_that_never_complete_flush_as_replacement(tokenizers: dict[str, Tokenizer]) -> None:
    tok = tokenizers["synthetic"]  # ids are bytes
    detok = IncrementalDetokenizer(tok, tok.encode("x"))
    assert detok.push([0xF0, 0x9F]) == ""
    assert detok.flush() == FFFD
    detok = IncrementalDetokenizer(tok, tok.encode("x"))
    assert detok.push([0xF0]) == ""
    assert detok.push([ord("a")]) == FFFD + "a"  # broken sequence: permanent, emitted
    assert detok.flush() == ""


def test_byte_fallback_run_is_held_until_closed(tokenizers: dict[str, Tokenizer]) -> None:
    tok = tokenizers["llama2"]
    crab = [tok.token_to_id(f"<0x{b:02X}>") or 0 for b in "🦀".encode()]
    detok = IncrementalDetokenizer(tok, tok.encode("Hi"))
    # tokenizers' ByteFallback turns a whole run into U+FFFDs if any later byte breaks it, so a
    # complete character inside an open run is not final yet.
    assert [detok.push([t]) for t in crab] == ["", "", "", ""]
    assert detok.push([tok.token_to_id("!") or 0]) == "🦀!"
    assert detok.flush() == ""


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(skip: bool, tokenizers: dict[str, Tokenizer]) -> None:
    tok = tokenizers["llama3"]
    assert tok.eos_token_id is not None
    output = [*tok.encode(" there", add_special_tokens=False), tok.eos_token_id]
    deltas = stream(tok, tok.encode("Hi"), output, [], skip)
    assert "".join(deltas) == " there" + ("" if skip else "<|end_of_text|>")


def test_push_after_flush_raises(tokenizers: dict[str, Tokenizer]) -> None:
    detok = IncrementalDetokenizer(tokenizers["synthetic"], [])
    assert detok.flush() == ""
    with pytest.raises(RuntimeError):
        detok.push([65])


@pytest.mark.parametrize("style", STYLES)
def test_work_per_token_is_constant(style: str, tokenizers: dict[str, Tokenizer]) -> None:
    """Total ids decoded stays a small multiple of the output length: a sliding window, not
    the whole text per token."""
    tok = tokenizers[style]
    text = "The quick brown fox 🦊 jumps over 日本語 and naïve café. " * 40
    output = tok.encode(text, add_special_tokens=False)
    counting = CountingTokenizer(tok)
    detok = IncrementalDetokenizer(counting, tok.encode("Once upon a time"))
    streamed = "".join(detok.push([t]) for t in output) + detok.flush()
    assert streamed == reference(tok, tok.encode("Once upon a time"), output, True)
    assert counting.decoded < 40 * len(output)


@pytest.mark.parametrize("style", ["synthetic", "llama2"])
def test_long_undecodable_run_is_linear(style: str, tokenizers: dict[str, Tokenizer]) -> None:
    """A long run of bytes that never form a character is held with O(1) work per token."""
    tok = tokenizers[style]
    stray = 0x80 if style == "synthetic" else tok.token_to_id("<0x80>")
    assert stray is not None
    n = 3000
    output = [stray] * n + tok.encode("ok", add_special_tokens=False) + [stray] * n
    counting = CountingTokenizer(tok)
    detok = IncrementalDetokenizer(counting, tok.encode("x"))
    streamed = "".join(detok.push([t]) for t in output) + detok.flush()
    assert streamed == reference(tok, tok.encode("x"), output, True)
    assert counting.decoded < 20 * len(output)


@pytest.mark.parametrize(
    ("prompt_bytes", "output_bytes"),
    [("日本".encode(), "語".encode()), (b"\x80" + "日".encode(), "日".encode())],
)
def test_byte_run_across_the_prompt_end(
    prompt_bytes: bytes, output_bytes: bytes, tokenizers: dict[str, Tokenizer]
) -> None:
    """A byte-fallback run that starts in the prompt and continues in the output decodes as one
    run (valid or all U+FFFD): the prompt context must not start inside it."""
    tok = tokenizers["llama2"]

    def as_byte_tokens(data: bytes) -> list[int]:
        return [tok.token_to_id(f"<0x{b:02X}>") or 0 for b in data]

    prompt = tok.encode("x") + as_byte_tokens(prompt_bytes)
    output = [*as_byte_tokens(output_bytes), tok.token_to_id("!") or 0]
    for sizes in ([], [len(output)]):
        streamed = "".join(stream(tok, prompt, output, sizes))
        assert streamed == reference(tok, prompt, output, True)
