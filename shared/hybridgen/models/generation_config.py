"""A checkpoint's generation defaults: stop ids and sampling settings of generation_config.json."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridgen.models.tokenizer import ModelLoadError, read_json_object

GENERATION_CONFIG_FILE = "generation_config.json"
MODEL_CONFIG_FILE = "config.json"


@dataclass(frozen=True)
class GenerationDefaults:
    """What the checkpoint asks for when a request leaves a setting unset (None: not given)."""

    eos_token_ids: tuple[int, ...] = ()
    """Ids that end a sequence; empty when no file names one."""
    bos_token_id: int | None = None
    """Beginning-of-sequence id."""
    pad_token_id: int | None = None
    """Padding id."""
    do_sample: bool | None = None
    """Whether the checkpoint samples by default (False: greedy)."""
    temperature: float | None = None
    """Default sampling temperature."""
    top_p: float | None = None
    """Default nucleus-sampling mass."""
    top_k: int | None = None
    """Default top-k cut-off."""
    repetition_penalty: float | None = None
    """Default repetition penalty (1.0: none)."""
    max_new_tokens: int | None = None
    """Default number of new tokens."""
    max_length: int | None = None
    """Default total length, prompt included."""


def _int(value: Any, key: str, path: Path) -> int | None:
    # bool is an int subclass; `true` as a token id is a broken file, not id 1.
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ModelLoadError(f"{path}: key {key!r} must be an integer, got {value!r}")
    return value


def _token_id(value: Any, key: str, path: Path) -> int | None:
    # Some old Llama conversions write pad_token_id = -1 to mean "none".
    value = _int(value, key, path)
    return None if value is None or value < 0 else value


def _float(value: Any, key: str, path: Path) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ModelLoadError(f"{path}: key {key!r} must be a number, got {value!r}")
    return float(value)


def _bool(value: Any, key: str, path: Path) -> bool | None:
    if value is not None and not isinstance(value, bool):
        raise ModelLoadError(f"{path}: key {key!r} must be true or false, got {value!r}")
    return value


def _eos_ids(value: Any, path: Path) -> tuple[int, ...] | None:
    """eos_token_id as an int or a list of ints; None when absent or null."""
    if value is None:
        return None
    items = value if isinstance(value, list) else [value]
    ids = [_int(v, "eos_token_id", path) for v in items]
    valid = tuple(i for i in ids if i is not None and i >= 0)
    if len(valid) != len(ids):
        raise ModelLoadError(f"{path}: key 'eos_token_id' must hold non-negative integers")
    return valid or None  # an empty list names no stop id: fall back like a missing key


def load_generation_defaults(
    directory: str | Path, tokenizer_eos: int | None
) -> GenerationDefaults:
    """Read generation_config.json (optional) with fallbacks to config.json and the tokenizer.

    Stop ids come from generation_config.json, else config.json, else `tokenizer_eos`; bos and pad
    fall back to config.json the same way.
    """
    directory = Path(directory)
    gen_path = directory / GENERATION_CONFIG_FILE
    gen = read_json_object(gen_path) if gen_path.is_file() else {}
    model_path = directory / MODEL_CONFIG_FILE
    model = read_json_object(model_path) if model_path.is_file() else {}

    eos = _eos_ids(gen.get("eos_token_id"), gen_path)
    if eos is None:
        eos = _eos_ids(model.get("eos_token_id"), model_path)
    if eos is None:
        eos = () if tokenizer_eos is None else (tokenizer_eos,)

    def with_fallback(key: str) -> int | None:
        value = _token_id(gen.get(key), key, gen_path)
        return value if value is not None else _token_id(model.get(key), key, model_path)

    return GenerationDefaults(
        eos_token_ids=eos,
        bos_token_id=with_fallback("bos_token_id"),
        pad_token_id=with_fallback("pad_token_id"),
        do_sample=_bool(gen.get("do_sample"), "do_sample", gen_path),
        temperature=_float(gen.get("temperature"), "temperature", gen_path),
        top_p=_float(gen.get("top_p"), "top_p", gen_path),
        top_k=_int(gen.get("top_k"), "top_k", gen_path),
        repetition_penalty=_float(gen.get("repetition_penalty"), "repetition_penalty", gen_path),
        max_new_tokens=_int(gen.get("max_new_tokens"), "max_new_tokens", gen_path),
        max_length=_int(gen.get("max_length"), "max_length", gen_path),
    )
