"""Errors raised while loading a model, each naming the file or key at fault."""

from __future__ import annotations


class ModelLoadError(ValueError):
    """A model directory, file or config key is missing or invalid."""
