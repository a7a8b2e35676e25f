"""The tokenizer a GGUF file describes, built into a `tokenizers` pipeline with no network.

A GGUF has no tokenizer.json: it stores the vocabulary, the merges (or SentencePiece scores),
token types and special ids under llama.cpp's `tokenizer.ggml.*` keys, and the chat template
under `tokenizer.chat_template`. The pipelines below are the ones transformers 5 builds from
the same keys (GPT2Tokenizer for `gpt2`, LlamaTokenizer for `llama`), so prompts become the
ids the reference feeds the model:

    gpt2   byte-level BPE; the split regex picked by `tokenizer.ggml.pre` (GPT-2's by default)
    llama  SentencePiece-style BPE with byte fallback and "▁" for spaces (Llama 2, Mistral);
           merges from the file or, when it has none, derived from the scores

Control tokens (type 3) become special added tokens, user-defined ones (type 4) plain added
tokens, so neither is ever cut into pieces.
"""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Regex, decoders, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend
from tokenizers.models import BPE

from hybridgen.models.errors import ModelLoadError
from hybridgen.models.gguf_reader import GgufReader
from hybridgen.models.tokenizer import Tokenizer, TokenizerSettings, bytes_to_unicode

_CONTROL, _USER_DEFINED = 3, 4
_SPECIAL_IDS = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "unk_token": "unknown_token_id",
    "pad_token": "padding_token_id",
}
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> the split regex its merges were learned with (transformers' table, for
# the families this server loads); anything else keeps GPT-2's ByteLevel regex.
PRE_TOKENIZER_SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "dbrx": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}
TOKENIZER_MODELS = ("gpt2", "llama")


def gguf_tokenizer(f: GgufReader) -> Tokenizer:
    """The file's tokenizer, with its special tokens and chat template."""
    model = f.get("tokenizer.ggml.model")
    tokens = f.get("tokenizer.ggml.tokens")
    if model not in TOKENIZER_MODELS or not tokens:
        raise ModelLoadError(
            f"{f.path}: tokenizer.ggml.model={model!r} is not supported (or the file has no "
            f"tokenizer.ggml.tokens); supported: {', '.join(TOKENIZER_MODELS)}"
        )
    types = list(f.get("tokenizer.ggml.token_type") or [])
    add_bos = f.get("tokenizer.ggml.add_bos_token", model == "llama")
    if model == "gpt2":
        backend = _byte_level(tokens, f.get("tokenizer.ggml.merges") or [], f)
    else:
        backend = _sentencepiece(tokens, f, bool(f.get("tokenizer.ggml.add_space_prefix", True)))
    _add_typed_tokens(backend, tokens, types, byte_level=model == "gpt2")
    special = _special_tokens(f, tokens)
    bos = special.get("bos_token")
    if add_bos and bos is not None:
        bos_id = backend.token_to_id(bos.content)
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos.content} $A",
            pair=f"{bos.content} $A {bos.content} $B",
            special_tokens=[(bos.content, bos_id)],
        )
    else:
        backend.post_processor = processors.TemplateProcessing(single="$A", pair="$A $B:1")
    settings = TokenizerSettings(
        special_tokens=special,
        add_bos_token=bool(add_bos),
        chat_template=f.get("tokenizer.chat_template"),
    )
    return Tokenizer(backend, settings, source=f.path)


def _byte_level(tokens: list[str], merges: list[str], f: GgufReader) -> Backend:
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    # Tokens outside the byte alphabet (a mislabelled control token) are respelled byte by byte.
    vocab = {
        t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
        for i, t in enumerate(tokens)
    }
    backend = Backend(BPE(vocab=vocab, merges=_pairs(merges), fuse_unk=False))
    split = PRE_TOKENIZER_SPLITS.get(str(f.get("tokenizer.ggml.pre", "")))
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece(tokens: list[str], f: GgufReader, prefix_space: bool) -> Backend:
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = f.get("tokenizer.ggml.merges")
    if merges:
        pairs = _pairs(merges)
    else:
        pairs = _merges_from_scores(vocab, f.get("tokenizer.ggml.scores") or [], f)
    backend = Backend(BPE(vocab=vocab, merges=pairs, fuse_unk=True, byte_fallback=True))
    backend.normalizer = None
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if prefix_space else "never", split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix_space:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    return backend


def _pairs(merges: list[str]) -> list[tuple[str, str]]:
    """ "a b" merges as pairs."""
    out = []
    for m in merges:
        a, _, b = m.partition(" ")
        out.append((a, b))
    return out


def _merges_from_scores(
    vocab: dict[str, int], scores: list[float], f: GgufReader
) -> list[tuple[str, str]]:
    """SentencePiece pieces -> BPE merges, best score first: each piece's splits into two
    known pieces (transformers' generate_merges, with the scores)."""
    if len(scores) != len(vocab):
        raise ModelLoadError(
            f"{f.path}: tokenizer.ggml.scores has {len(scores)} entries for {len(vocab)} tokens"
        )
    found: list[tuple[str, str, float]] = []
    for piece, score in zip(vocab, scores, strict=True):
        local = [
            (piece[:i], piece[i:], score)
            for i in range(1, len(piece))
            if piece[:i] in vocab and piece[i:] in vocab
        ]
        found += sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]]))
    found.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(a, b) for a, b, _ in found]


def _add_typed_tokens(
    backend: Backend, tokens: list[str], types: list[int], byte_level: bool
) -> None:
    alphabet = set(bytes_to_unicode().values()) if byte_level else None
    control = [
        AddedToken(t, special=True, normalized=False)
        for t, kind in zip(tokens, types, strict=False)
        if kind == _CONTROL and (alphabet is None or set(t) <= alphabet)
    ]
    backend.add_special_tokens(control)
    vocab = backend.get_vocab()
    user = [
        AddedToken(t, special=False, normalized=False)
        for t, kind in zip(tokens, types, strict=False)
        if kind == _USER_DEFINED and t in vocab
    ]
    backend.add_tokens(user)


def _special_tokens(f: GgufReader, tokens: list[str]) -> dict[str, AddedToken]:
    out: dict[str, AddedToken] = {}
    for name, key in _SPECIAL_IDS.items():
        token_id: Any = f.get(f"tokenizer.ggml.{key}")
        if token_id is None:
            continue
        if not 0 <= int(token_id) < len(tokens):
            raise ModelLoadError(
                f"{f.path}: tokenizer.ggml.{key}={token_id} is outside the {len(tokens)} tokens"
            )
        out[name] = AddedToken(tokens[int(token_id)], special=True, normalized=False)
    return out
