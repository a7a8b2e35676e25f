"""Errors raised while loading a model, each naming the file or key at fault."""

from __future__ import annotations

from pathlib import Path


class ModelLoadError(ValueError):
    """A model directory, file or config key is missing or invalid."""


GGUF_MAGIC = b"GGUF"
"""The first four bytes of every GGUF file."""


def bad_model_path(name: str) -> ModelLoadError | None:
    """The error for a model named by a path (it has a slash, or starts with . or ~) that is
    neither a folder nor a GGUF file; None otherwise. Torch-free, so that `hybridgen serve`
    says it at once (the loader checks the folder's or the file's contents)."""
    if not ("/" in name or name.startswith((".", "~"))):
        return None
    path = Path(name).expanduser()
    if path.is_dir() or (path.is_file() and _starts_with_gguf_magic(path)):
        return None
    what = "neither a folder nor a GGUF file" if path.exists() else "no such file or folder"
    return ModelLoadError(
        f"model {name!r}: {what}; give a checkpoint folder (config.json, *.safetensors, "
        "tokenizer.json), a GGUF file or a preset (hybridgen models lists them)"
    )


def _starts_with_gguf_magic(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(len(GGUF_MAGIC)) == GGUF_MAGIC
    except OSError:
        return False
