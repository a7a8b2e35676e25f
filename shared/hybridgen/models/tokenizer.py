"""The engine's tokenizer: a `tokenizers` backend plus the checkpoint's tokenizer_config.

Behaviour is pinned to `transformers.AutoTokenizer` 5.x on the same directory, so prompts become
exactly the ids the reference feeds the model; transformers itself is not imported here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
from tokenizers import AddedToken, decoders, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend
from tokenizers.models import BPE

from hybridgen.models.chat_template import compile_chat_template, template_messages
from hybridgen.models.errors import ModelLoadError

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"
# Named special tokens, in the order transformers lists them in `all_special_ids`.
SPECIAL_TOKEN_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
# transformers saves an unset model_max_length as int(1e30); anything this large means no limit.
_UNSET_MAX_LENGTH = 1 << 60
# Model types for which transformers overrides a declared LlamaTokenizer with tokenizer.json as is.
_LLAMA_CLASS_IGNORED_FOR = frozenset({"phi3", "phi3_v", "phimoe", "qwen2", "jamba", "internlm2"})

SYNTHETIC_BOS = "<|begin_of_text|>"
SYNTHETIC_EOS = "<|end_of_text|>"
SYNTHETIC_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


class TokenizerFileNotFoundError(ModelLoadError, FileNotFoundError):
    """tokenizer.json is missing from the checkpoint directory."""


class ChatTemplateError(ValueError):
    """No chat template is available, or rendering it failed."""


def read_json_object(path: Path) -> dict[str, Any]:
    """Read a JSON object from `path`, raising ModelLoadError naming the file on any defect."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {path.name} in {path.parent}: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


@dataclass(frozen=True)
class TokenizerSettings:
    """What tokenizer_config.json (and the chat template files) say about the tokenizer."""

    special_tokens: dict[str, AddedToken]
    """Named special tokens (bos_token, ... and model-specific `*_token` keys) by key."""
    extra_special_tokens: tuple[AddedToken, ...] = ()
    """Unnamed special tokens (extra_special_tokens / additional_special_tokens)."""
    added_tokens: tuple[AddedToken, ...] = ()
    """`added_tokens_decoder` entries of older configs, by id."""
    add_bos_token: bool | None = None
    """As written; transformers 5 ignores it (tokenizer.json's post-processor adds the BOS)."""
    add_eos_token: bool | None = None
    """As written; ignored for the same reason."""
    model_max_length: int | None = None
    """Maximum sequence length, None when unset."""
    clean_up_tokenization_spaces: bool = False
    """Whether decode removes spaces before punctuation (skipped for BPE models)."""
    cleanup_bpe_anyway: bool = False
    """transformers' flag forcing that clean-up for BPE models too."""
    split_special_tokens: bool = False
    """Whether special-token text inside the input is tokenized as plain text."""
    chat_template: str | None = None
    """The default chat template source, None when the checkpoint has none."""
    tokenizer_class: str | None = None
    """tokenizer_class without the "Fast" suffix (LlamaTokenizer changes the pipeline)."""
    add_prefix_space: bool = True
    """LlamaTokenizer: prepend "▁" to the text, strip it again on decode."""
    legacy: bool = False
    """LlamaTokenizer: prepend "▁" after every special token, not only at the start."""


def _added_token(value: Any, key: str, path: Path) -> AddedToken | None:
    """A token given as a string or an AddedToken dict ({"content": ...}); None when null."""
    if value is None:
        return None
    if isinstance(value, str):
        return AddedToken(value, special=True, normalized=False)
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        flags = {k: bool(value[k]) for k in ("single_word", "lstrip", "rstrip") if k in value}
        special = bool(value.get("special", True))
        normalized = bool(value.get("normalized", not special))
        return AddedToken(value["content"], special=special, normalized=normalized, **flags)
    raise ModelLoadError(f"{path}: key {key!r} must be a string or an AddedToken object")


def _read_chat_template(directory: Path, cfg: dict[str, Any], cfg_path: Path) -> str | None:
    # transformers' precedence: template files, when any exist, replace the config entry.
    templates: dict[str, Any] = {}
    if (directory / CHAT_TEMPLATE_FILE).is_file():
        templates["default"] = (directory / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
    if (directory / CHAT_TEMPLATE_DIR).is_dir():
        for file in sorted((directory / CHAT_TEMPLATE_DIR).glob("*.jinja")):
            templates[file.name.removesuffix(".jinja")] = file.read_text(encoding="utf-8")
    if not templates:
        entry = cfg.get("chat_template")
        if entry is None or isinstance(entry, str):
            return entry
        if not isinstance(entry, list) or not all(
            isinstance(t, dict) and isinstance(t.get("name"), str) for t in entry
        ):
            raise ModelLoadError(f"{cfg_path}: key 'chat_template' must be a string or a list")
        templates = {t["name"]: t.get("template") for t in entry}
    # Only named templates (e.g. tool_use) and no default: chat is unavailable, the model is not.
    default = templates.get("default")
    return default if isinstance(default, str) else None


def _special_tokens(cfg: dict[str, Any], path: Path) -> tuple[dict[str, Any], list[Any]]:
    """Named special tokens (model-specific `*_token` keys included) and the unnamed extra ones."""
    named = {k: cfg.get(k) for k in SPECIAL_TOKEN_KEYS}
    named |= {k: v for k, v in cfg.items() if k.endswith("_token") and isinstance(v, str)}
    extra = cfg.get("extra_special_tokens") or cfg.get("additional_special_tokens") or []
    if isinstance(extra, dict):  # transformers 5 treats a dict as more named tokens
        named |= extra
        extra = []
    if not isinstance(extra, list):
        raise ModelLoadError(f"{path}: key 'extra_special_tokens' must be a list or an object")
    return named, extra


def read_tokenizer_settings(directory: Path) -> TokenizerSettings:
    """Parse tokenizer_config.json (optional) and the chat template files next to it."""
    path = directory / TOKENIZER_CONFIG_FILE
    cfg = read_json_object(path) if path.is_file() else {}
    named, extra = _special_tokens(cfg, path)
    special = {k: t for k, v in named.items() if (t := _added_token(v, k, path)) is not None}
    decoder = cfg.get("added_tokens_decoder") or {}
    added = [_added_token(decoder[i], f"added_tokens_decoder.{i}", path) for i in decoder]
    for key in ("add_bos_token", "add_eos_token"):
        if cfg.get(key) is not None and not isinstance(cfg[key], bool):
            raise ModelLoadError(f"{path}: key {key!r} must be true or false, got {cfg[key]!r}")
    max_length = cfg.get("model_max_length")
    if max_length is not None and (not isinstance(max_length, int | float) or max_length <= 0):
        raise ModelLoadError(f"{path}: key 'model_max_length' must be a positive number")
    return TokenizerSettings(
        special_tokens=special,
        extra_special_tokens=tuple(
            t
            for i, v in enumerate(extra)
            if (t := _added_token(v, f"extra_special_tokens.{i}", path))
        ),
        added_tokens=tuple(
            t for _, t in sorted(zip(map(int, decoder), added, strict=True)) if t is not None
        ),
        add_bos_token=cfg.get("add_bos_token"),
        add_eos_token=cfg.get("add_eos_token"),
        model_max_length=int(max_length) if max_length and max_length < _UNSET_MAX_LENGTH else None,
        clean_up_tokenization_spaces=bool(cfg.get("clean_up_tokenization_spaces", False)),
        cleanup_bpe_anyway=bool(
            cfg.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output")
        ),
        split_special_tokens=bool(cfg.get("split_special_tokens", False)),
        chat_template=_read_chat_template(directory, cfg, path),
        tokenizer_class=str(cfg.get("tokenizer_class") or "").removesuffix("Fast") or None,
        add_prefix_space=cfg.get("add_prefix_space") is not False,
        legacy=bool(cfg.get("legacy", False)),
    )


def _apply_llama_recipe(backend: Backend, settings: TokenizerSettings, model_type: Any) -> None:
    """Rebuild a SentencePiece-style LlamaTokenizer's pipeline the way transformers 5 does.

    For this class transformers 5 keeps only vocab, merges and post-processor of tokenizer.json
    and swaps in its own Metaspace normalizer/pre-tokenizer/decoder, which differ from the file on
    leading spaces and after special tokens (Llama 2, Mistral 7B v0.1). ByteLevel files (Llama 3
    declared as LlamaTokenizer) are used as they are.
    """
    if settings.tokenizer_class != "LlamaTokenizer" or model_type in _LLAMA_CLASS_IGNORED_FOR:
        return
    pipeline = json.loads(backend.to_str())
    if "ByteLevel" in json.dumps([pipeline.get("pre_tokenizer"), pipeline.get("decoder")]):
        return
    scheme = ("always" if settings.legacy else "first") if settings.add_prefix_space else "never"
    backend.normalizer = None
    backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme=scheme, split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if settings.add_prefix_space:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)


class Tokenizer:
    """Text <-> token ids and chat rendering for one checkpoint (or a synthetic byte vocabulary)."""

    def __init__(
        self,
        backend: Backend,
        settings: TokenizerSettings,
        *,
        source: Path | None = None,
        is_synthetic: bool = False,
    ) -> None:
        self._backend = backend
        self.settings = settings
        self.source = source
        self.is_synthetic = is_synthetic
        # transformers switches these off for every call that does not ask for them.
        backend.no_truncation()
        backend.no_padding()
        backend.encode_special_tokens = settings.split_special_tokens
        self._add_missing_special_tokens()
        self._special_ids = {
            k: backend.token_to_id(t.content) for k, t in settings.special_tokens.items()
        }
        self._longest_token_bytes: int | None = None  # max_text_bytes' vocabulary scan

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load tokenizer.json (required), tokenizer_config.json and the chat template files."""
        directory = Path(path)
        file = directory / TOKENIZER_FILE
        if not file.is_file():
            raise TokenizerFileNotFoundError(f"{TOKENIZER_FILE} not found in {directory}")
        try:
            backend = Backend.from_file(str(file))
        except Exception as exc:  # the Rust side raises a bare Exception on malformed files
            raise ModelLoadError(f"cannot parse {TOKENIZER_FILE} in {directory}: {exc}") from exc
        settings = read_tokenizer_settings(directory)
        config = directory / "config.json"
        model_type = read_json_object(config).get("model_type") if config.is_file() else None
        _apply_llama_recipe(backend, settings, model_type)
        return cls(backend, settings, source=directory)

    @classmethod
    def synthetic(cls, vocab_size: int) -> Tokenizer:
        """Byte tokenizer for synthetic presets: ids 0..255 are the bytes, 256 bos, 257 eos."""
        if vocab_size < 260:
            raise ValueError(f"synthetic tokenizer needs vocab_size >= 260, got {vocab_size}")
        byte_chars = bytes_to_unicode()
        # BPE without merges over the byte alphabet: every byte is its own token, so any UTF-8
        # text round-trips exactly and ids equal byte values.
        backend = Backend(BPE(vocab={byte_chars[b]: b for b in range(256)}, merges=[]))
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        backend.decoder = decoders.ByteLevel()
        names = [SYNTHETIC_BOS, SYNTHETIC_EOS]
        names += [f"<|reserved_special_token_{i}|>" for i in range(vocab_size - 258)]
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in names])
        backend.post_processor = processors.TemplateProcessing(
            single=f"{SYNTHETIC_BOS} $A",
            pair=f"{SYNTHETIC_BOS} $A {SYNTHETIC_BOS} $B",
            special_tokens=[(SYNTHETIC_BOS, 256)],
        )
        special = {
            "bos_token": AddedToken(SYNTHETIC_BOS, special=True, normalized=False),
            "eos_token": AddedToken(SYNTHETIC_EOS, special=True, normalized=False),
        }
        settings = TokenizerSettings(special_tokens=special, chat_template=SYNTHETIC_CHAT_TEMPLATE)
        return cls(backend, settings, is_synthetic=True)

    def save(self, path: str | Path) -> None:
        """Write tokenizer.json, tokenizer_config.json and chat_template.jinja (transformers 5)."""
        directory = Path(path)
        directory.mkdir(parents=True, exist_ok=True)
        self._backend.save(str(directory / TOKENIZER_FILE))
        config: dict[str, Any] = {"backend": "tokenizers", "tokenizer_class": "TokenizersBackend"}
        config.update({k: t.content for k, t in self.settings.special_tokens.items()})
        config["clean_up_tokenization_spaces"] = self.settings.clean_up_tokenization_spaces
        if self.settings.model_max_length is not None:
            config["model_max_length"] = self.settings.model_max_length
        (directory / TOKENIZER_CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        if self.settings.chat_template is not None:
            (directory / CHAT_TEMPLATE_FILE).write_text(self.settings.chat_template)

    def _add_missing_special_tokens(self) -> None:
        # transformers registers config-named special tokens the backend lacks as added tokens
        # (reusing the vocab id when the text is in the vocab), which changes encode and decode.
        known = {t.content for t in self._backend.get_added_tokens_decoder().values()}
        missing: list[AddedToken] = []
        for token in (
            *self.settings.added_tokens,
            *self.settings.special_tokens.values(),
            *self.settings.extra_special_tokens,
        ):
            if token.content not in known:
                known.add(token.content)
                missing.append(token)
        if missing:
            self._backend.add_tokens(missing)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids for `text`, with the post-processor's BOS/EOS when add_special_tokens."""
        # encode_batch releases the GIL while it works (encode holds it: seconds for
        # megabytes), so the daemons' heartbeat threads keep beating meanwhile.
        return self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def max_text_bytes(self, max_tokens: int) -> int | None:
        """UTF-8 bytes beyond which no text can encode to at most `max_tokens` tokens, so that
        a prompt too long for the context is refused before it is tokenized; None when one
        token can stand for text of any length (not BPE, or BPE fusing unknown characters).

        BPE never drops text: each token covers at most its own string's UTF-8 bytes of the
        normalized text (a byte-level token one byte per character, a byte-fallback or
        SentencePiece token fewer). A normalizer maps each character (at most 4 bytes) to at
        least one byte, so it can shrink text at most 4-fold.
        """
        model = self._backend.model
        if not isinstance(model, BPE) or (model.unk_token is not None and model.fuse_unk):
            return None
        if self._longest_token_bytes is None:
            vocab = self._backend.get_vocab(with_added_tokens=True)
            self._longest_token_bytes = max(len(t.encode()) for t in vocab)
        shrink = 1 if self._backend.normalizer is None else 4
        return max_tokens * self._longest_token_bytes * shrink

    def encode_offsets(
        self, text: str, add_special_tokens: bool = True
    ) -> tuple[list[int], list[tuple[int, int]]]:
        """encode's ids and each one's (start, end) character span in `text`."""
        encoding = self._backend.encode(text, add_special_tokens=add_special_tokens)
        return encoding.ids, encoding.offsets

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """Text for `ids`; clean-up follows tokenizer_config (and is skipped for BPE)."""
        text = self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        settings = self.settings
        is_bpe = type(self._backend.model).__name__ == "BPE"
        if settings.clean_up_tokenization_spaces and (not is_bpe or settings.cleanup_bpe_anyway):
            for before, after in _CLEAN_UP:
                text = text.replace(before, after)
        return text

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render `messages` with the chat template as transformers does with tokenize=False."""
        if self.settings.chat_template is None:
            where = self.source if self.source is not None else "this tokenizer"
            raise ChatTemplateError(
                f"no chat template in {where}: expected {CHAT_TEMPLATE_FILE} or a 'chat_template' "
                f"entry in {TOKENIZER_CONFIG_FILE}"
            )
        template = compile_chat_template(self.settings.chat_template)
        variables: dict[str, Any] = {"tools": None, "documents": None}
        variables |= {k: t.content for k, t in self.settings.special_tokens.items()}
        variables |= kwargs  # the caller's variables win over special tokens, as in transformers
        try:
            return template.render(
                messages=template_messages(messages),
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except jinja2.exceptions.TemplateError as exc:
            raise ChatTemplateError(f"chat template failed: {exc}") from exc

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included (transformers' len(tokenizer))."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        return self._special_ids.get("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._special_ids.get("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._special_ids.get("pad_token")

    @property
    def model_max_length(self) -> int | None:
        return self.settings.model_max_length

    @property
    def all_special_ids(self) -> list[int]:
        """Ids of the named, then the extra special tokens, without repeats (as transformers)."""
        tokens = [t.content for t in self.settings.special_tokens.values()]
        tokens += [t.content for t in self.settings.extra_special_tokens]
        ids = [self._backend.token_to_id(t) for t in dict.fromkeys(tokens)]
        return [i for i in ids if i is not None]

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)


# transformers' clean_up_tokenization, in its order.
_CLEAN_UP = (
    (" .", "."),
    (" ?", "?"),
    (" !", "!"),
    (" ,", ","),
    (" ' ", "'"),
    (" n't", "n't"),
    (" 'm", "'m"),
    (" 's", "'s"),
    (" 've", "'ve"),
    (" 're", "'re"),
)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, the alphabet of the ByteLevel pre-tokenizer."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    table = {b: chr(b) for b in printable}
    unprintable = [b for b in range(256) if b not in table]
    table |= {b: chr(256 + i) for i, b in enumerate(unprintable)}
    return table
