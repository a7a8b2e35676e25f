"""Incremental detokenization: output token ids -> streamed text deltas.

Reference semantics (what the deltas of one request concatenate to):

    decode(prompt + output)[len(decode(prompt)):]        (both with the same skip_special_tokens)

i.e. the output decoded *in the context of the prompt*. For byte-level BPE (Llama 3, Qwen2) this
equals `decode(output)` whenever the prompt ends on a character boundary (always, for a prompt
that was text). For SentencePiece-style tokenizers (Llama 2, Mistral) it differs on purpose: their
decoder strips the leading space of the first token of a decode, so `decode(output)` turns
"Hello" + " world" into "Helloworld" once appended to the prompt; in context the first delta is
" world". transformers' text-generation pipeline (decode everything, cut off the decoded prompt)
and vLLM's detokenizer (decode from a few prompt tokens) both use this rule.

Algorithm (vLLM's prefix_offset/read_offset): the window `ids[prefix_offset:]` is decoded, the
text of `ids[prefix_offset:read_offset]` (already emitted, kept as context) is cut off, and the
rest is the delta. The window starts as a short tail of the prompt and slides to the last emitted
chunk, so each decode covers a handful of tokens: O(1) amortised per token.

Text is held back (not emitted yet) while it may still change:
- it ends in U+FFFD: an incomplete UTF-8 sequence decodes as U+FFFD until its bytes complete;
- the last token is a byte-fallback token (`<0xE6>`): tokenizers' ByteFallback decoder turns a
  whole run of byte tokens into one U+FFFD per byte as soon as the run is invalid UTF-8, so even
  a completed character can still change until a non-byte token closes the run.
`flush()` releases everything, U+FFFD included where the bytes never completed.

Limitation: tokenizer_config's clean_up_tokenization_spaces (applied to WordPiece/Unigram
models, never to BPE) rewrites text across token boundaries; deltas then follow the window's
clean-up, which can differ from the full decode's at chunk boundaries.
"""

from __future__ import annotations

import re
import weakref
from dataclasses import dataclass, field
from typing import Protocol

REPLACEMENT = "\ufffd"
# Prompt context: at least this many visible tokens ahead of the output, and at most this many
# searched for a start that decodes cleanly (vLLM searches the last 4..24 prompt tokens too).
_MIN_CONTEXT = 4
_MAX_CONTEXT = 24
# Windows up to this many tokens are decoded on every push; longer ones (only after a long
# hold-back, e.g. a run of invalid bytes) first check a short probe of their last tokens, so a
# long hold costs O(1) per token instead of one O(window) decode per token.
_PROBE_FREE_WINDOW = 16
_PROBE_TOKENS = 4
# Tokens before prefix_offset are never decoded again; drop them once this many pile up.
_TRIM_AT = 256
# tokenizers' ByteFallback decoder recognises exactly this token shape as a raw byte.
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


class TokenizerLike(Protocol):
    """What the detokenizer needs of `hybridgen.models.tokenizer.Tokenizer`."""

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str: ...

    def id_to_token(self, token_id: int) -> str | None: ...


@dataclass
class _TokenFacts:
    """Per-tokenizer, per-id facts, shared by every request on that tokenizer (values never
    change, so concurrent fills from several threads only repeat work)."""

    invisible: dict[bool, dict[int, bool]] = field(default_factory=lambda: {True: {}, False: {}})
    """By skip_special_tokens: ids that decode drops outright."""
    byte_token: dict[int, bool] = field(default_factory=dict)
    """Ids whose token is a byte-fallback token."""


_FACTS: weakref.WeakKeyDictionary[TokenizerLike, _TokenFacts] = weakref.WeakKeyDictionary()


def _facts(tokenizer: TokenizerLike) -> _TokenFacts:
    try:
        return _FACTS[tokenizer]
    except TypeError:  # not weak-referenceable: keep the facts per request
        return _TokenFacts()
    except KeyError:
        return _FACTS.setdefault(tokenizer, _TokenFacts())


class IncrementalDetokenizer:
    """Streams the text of one request's output ids; see the module docstring for semantics.

    `push(ids)` returns the text those ids complete (possibly ""), `flush()` the held-back rest
    once the output is finished. Concatenated deltas equal
    `decode(prompt + output)[len(decode(prompt)):]`, and no delta from `push` ends in a U+FFFD
    that later bytes could still turn into a character.
    """

    def __init__(
        self, tokenizer: TokenizerLike, prompt_ids: list[int], skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        facts = _facts(tokenizer)
        self._invisible = facts.invisible[skip_special_tokens]
        self._byte_token = facts.byte_token
        self._finished = False
        # Invariants: ids[prefix_offset:read_offset] decodes to prefix_text, all of which (beyond
        # the prompt context) has been emitted; read_offset sits where the decoded text was
        # stable, so the context starts on a character (and byte-run) boundary.
        self._ids = self._prompt_context(prompt_ids)
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids)

    def push(self, token_ids: list[int]) -> str:
        """Append output ids; return the newly completed text ("" while it is held back)."""
        if self._finished:
            raise RuntimeError("IncrementalDetokenizer.push after flush")
        visible = [t for t in token_ids if not self._is_invisible(t)]
        if not visible:
            return ""
        self._ids.extend(visible)
        if not self._worth_decoding():
            return ""
        text = self._decode(self._ids[self._prefix_offset :])
        if text.endswith(REPLACEMENT) or len(text) <= len(self._prefix_text):
            return ""
        return self._advance(text)

    def flush(self) -> str:
        """The held-back rest at the end of the output (U+FFFD for bytes that never completed)."""
        if self._finished:
            return ""
        self._finished = True
        text = self._decode(self._ids[self._prefix_offset :])
        return text[len(self._prefix_text) :]

    def _advance(self, text: str) -> str:
        """Emit `text` beyond the context and slide the window onto the tokens just emitted."""
        delta = text[len(self._prefix_text) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        if self._prefix_offset >= _TRIM_AT:
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        return delta

    def _worth_decoding(self) -> bool:
        """False when the window's text certainly cannot be emitted yet (cheap checks only).

        Holding back is always safe for the concatenation invariant (a later push or flush emits
        the same text), so these checks may err towards False but never towards a wrong emit.
        """
        if self._is_byte_token(self._ids[-1]):
            return False  # an open byte-fallback run may still turn into U+FFFD
        if len(self._ids) - self._prefix_offset <= _PROBE_FREE_WINDOW:
            return True
        # A character is at most 4 bytes, so if the last few tokens decode to a trailing U+FFFD
        # the whole window almost surely does too (zero-byte tokens aside, which only delay).
        probe = self._decode(self._ids[-_PROBE_TOKENS:])
        return not probe.endswith(REPLACEMENT)

    def _prompt_context(self, prompt_ids: list[int]) -> list[int]:
        """The shortest visible prompt tail that decodes as it does inside the whole prompt.

        A start is clean when the tail's text does not begin with U+FFFD (not mid-character)
        and it does not split a run of byte-fallback tokens. Any start works for the leading
        space of SentencePiece decoders: the window's first token loses its space in both the
        context text and the window text, which are cut against each other.
        """
        tail: list[int] = []
        for token in reversed(prompt_ids):
            if not self._is_invisible(token):
                tail.append(token)
                if len(tail) > _MAX_CONTEXT:
                    break
        tail.reverse()
        for start in range(len(tail) - _MIN_CONTEXT, 0, -1):
            if self._clean_start(tail, start):
                return tail[start:]
        if len(tail) <= _MAX_CONTEXT:
            return tail  # the whole visible prompt: trivially exact
        # No clean start among the last tokens (e.g. a long invalid byte run): one O(prompt)
        # decode per push until the first emission, exact in every case.
        return [t for t in prompt_ids if not self._is_invisible(t)]

    def _clean_start(self, ids: list[int], start: int) -> bool:
        """Whether ids[start:] (start >= 1) decodes as the same text does after ids[:start]."""
        if self._is_byte_token(ids[start - 1]) and self._is_byte_token(ids[start]):
            return False
        text = self._decode(ids[start:])
        return bool(text) and not text.startswith(REPLACEMENT)

    def _is_invisible(self, token: int) -> bool:
        """Whether decode drops `token` outright: unknown ids, and special tokens when skipping.

        Dropping them from the window is exact (decode filters them before its decoder runs,
        so byte runs even join across them) and keeps runs of skipped specials from growing
        the window.
        """
        cached = self._invisible.get(token)
        if cached is None:
            if self._tokenizer.id_to_token(token) is None:
                cached = True
            elif self._skip:
                shown = self._tokenizer.decode([token], skip_special_tokens=False)
                cached = bool(shown) and not self._decode([token])
            else:
                cached = False
            self._invisible[token] = cached
        return cached

    def _is_byte_token(self, token: int) -> bool:
        cached = self._byte_token.get(token)
        if cached is None:
            name = self._tokenizer.id_to_token(token)
            cached = name is not None and _BYTE_TOKEN.fullmatch(name) is not None
            self._byte_token[token] = cached
        return cached

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)
