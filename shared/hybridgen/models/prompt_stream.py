"""Streaming input: a prompt's text arriving in chunks, tokenized as it comes, so that its KV
can be computed while the client still speaks; at the end, exactly the ids of tokenizing the
joined text.

A chunk can merge with the text before it ("wor" + "ld", "12" + "3", "\\n" + "\\n"), so the
tokens of the text's trailing word and the whitespace before it are held back, not committed,
and each chunk re-tokenizes a window: the last committed tokens (context) and everything
after them. Where the window's tokens line up again with the committed ones (a token with
the same character start and id), the window's tokens replace the committed tail; a window that
never lines up (its first tokens differ, as a SentencePiece prefix space does) is given up
for tokenizing the whole text. A committed token that the window changed is reported through
`keep` (the caller drops what was built on it), so the result never depends on the chunking:

    committed = committed[:keep] + new          (after every push)
    committed == tokenizer.encode(joined text)  (after the push with last=True)

Special tokens that the tokenizer's post-processor adds around a text (a BOS) are measured
once, on a probe, and put around the body: the body is tokenized without them.
"""

from __future__ import annotations

from hybridgen.models.tokenizer import Tokenizer

CONTEXT_TOKENS = 8
"""Committed tokens each window starts before the held tail, to line up on."""
_TAIL_CHARS = 4096
"""How far back the held tail is looked for; a longer last word is held from there on."""
_PROBE = "x"


class PromptStream:
    """One streamed text prompt's token ids, chunk by chunk."""

    def __init__(self, tokenizer: Tokenizer, add_special_tokens: bool) -> None:
        self._tokenizer = tokenizer
        self._prefix, self._suffix = _special_ends(tokenizer, add_special_tokens)
        self._text = ""
        self._body: list[int] = []
        """Tokens of the text so far, held ones included (no special tokens)."""
        self._starts: list[int] = []
        """Character start of each body token in the text."""
        self._committed: list[int] = list(self._prefix)
        self.closed = False

    @property
    def token_ids(self) -> list[int]:
        """The committed prompt: what the engine has been sent."""
        return self._committed

    @property
    def num_tokens(self) -> int:
        """Tokens of the whole text so far, held ones included: the prompt's length if the
        text ended here."""
        return len(self._prefix) + len(self._body) + len(self._suffix)

    def push(self, text: str, last: bool) -> tuple[int, list[int]]:
        """Add a chunk of text; returns (keep, new): the committed prompt is now its first
        `keep` tokens then `new`. After `last`, it is the tokenization of the joined text."""
        assert not self.closed, "push after the last chunk"
        self._text += text
        same = self._retokenize()
        self.closed = last
        stable = len(self._body) if last else self._stable_count()
        ids = [*self._prefix, *self._body[:stable], *(self._suffix if last else ())]
        keep = _common_prefix(self._committed, ids, len(self._prefix) + min(same, stable))
        new = ids[keep:]
        self._committed = ids
        return keep, new

    def _retokenize(self) -> int:
        """Tokenize the whole text into body and starts: the committed tokens up to where a
        window over the tail lines up with them, the window's after; or the whole text anew.
        Returns how many body tokens are known to be unchanged."""
        committed = len(self._committed) - len(self._prefix)
        first = committed - CONTEXT_TOKENS
        if first > 0:
            at = self._starts[first]
            ids, offsets = self._tokenizer.encode_offsets(self._text[at:], False)
            starts = [at + start for start, _ in offsets]
            joint = _line_up(self._body[:committed], self._starts[:committed], ids, starts, first)
            if joint is not None:
                k, j = joint
                self._body[k:], self._starts[k:] = ids[j:], starts[j:]
                return k
        ids, offsets = self._tokenizer.encode_offsets(self._text, False)
        self._body, self._starts = ids, [start for start, _ in offsets]
        return 0

    def _stable_count(self) -> int:
        """Body tokens that no later text can change: those that end before the text's
        trailing word and the whitespace before it."""
        text, hold = self._text, len(self._text)
        tail = max(0, hold - _TAIL_CHARS)
        while hold > tail and not text[hold - 1].isspace():
            hold -= 1
        while hold > tail and text[hold - 1].isspace():
            hold -= 1
        n = len(self._body)
        while n and self._end(n - 1) > hold:
            n -= 1
        return n

    def _end(self, i: int) -> int:
        """Character end of body token i (the next token's start; the text's end for the
        last)."""
        return self._starts[i + 1] if i + 1 < len(self._starts) else len(self._text)


def _line_up(
    body: list[int], starts: list[int], ids: list[int], w_starts: list[int], first: int
) -> tuple[int, int] | None:
    """(k, j): the first window token j (j >= 1: the window's first token may be cut short)
    that starts where committed token k starts, with its id; None when there is none."""
    where: dict[int, int] = {}
    for i in range(len(body) - 1, first, -1):
        where[starts[i]] = i  # the first token of a character wins
    for j in range(1, len(ids)):
        k = where.get(w_starts[j])
        if k is not None and ids[j] == body[k]:
            return k, j
    return None


def _special_ends(tokenizer: Tokenizer, add_special_tokens: bool) -> tuple[list[int], list[int]]:
    """The ids the post-processor puts before and after a text's own."""
    if not add_special_tokens:
        return [], []
    bare = tokenizer.encode(_PROBE, add_special_tokens=False)
    full = tokenizer.encode(_PROBE, add_special_tokens=True)
    for i in range(len(full) - len(bare) + 1):
        if full[i : i + len(bare)] == bare:
            return full[:i], full[i + len(bare) :]
    raise ValueError("the tokenizer's special tokens change the text's own tokens")


def _common_prefix(a: list[int], b: list[int], start: int) -> int:
    """Length of the common prefix of `a` and `b`, which agree on their first `start`."""
    n = min(len(a), len(b))
    for i in range(start, n):
        if a[i] != b[i]:
            return i
    return n
