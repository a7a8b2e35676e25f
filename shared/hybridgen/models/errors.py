"""Errors raised while loading a model, each naming the file or key at fault."""

from __future__ import annotations

from pathlib import Path


class ModelLoadError(ValueError):
    """A model directory, file or config key is missing or invalid."""


def bad_model_path(name: str) -> ModelLoadError | None:
    """The error for a model named by a path (it has a slash, or starts with . or ~) that is not
    a folder; None otherwise. Torch-free, so that `hybridgen serve` says it at once."""
    if not ("/" in name or name.startswith((".", "~"))) or Path(name).expanduser().is_dir():
        return None
    what = "not a folder" if Path(name).expanduser().exists() else "no such folder"
    return ModelLoadError(
        f"model {name!r}: {what}; give a checkpoint folder (config.json, *.safetensors, "
        "tokenizer.json) or a preset (hybridgen models lists them)"
    )
