"""The tokenizer a model name stands for: a checkpoint directory's, a GGUF file's, or a
preset's byte-level one.

Kept apart from the loader because it imports no torch: the gateway loads the served model's
tokenizer before it reports ready, and torch's import alone takes ~2.5 s on 2 cores.
"""

from __future__ import annotations

from pathlib import Path

from hybridgen.models.default_model import resolve_model
from hybridgen.models.gguf_reader import is_gguf, read_gguf
from hybridgen.models.gguf_tokenizer import gguf_tokenizer
from hybridgen.models.tokenizer import Tokenizer


def load_tokenizer(model: str) -> Tokenizer:
    """The tokenizer of a checkpoint directory or GGUF file, or the byte-level one of a
    preset."""
    model = resolve_model(model)
    path = Path(model)
    if path.is_dir():
        return Tokenizer.from_dir(path)
    if is_gguf(model):
        return gguf_tokenizer(read_gguf(model))
    from hybridgen.models.presets import preset_spec  # torch: presets are benchmarks' models

    return Tokenizer.synthetic(preset_spec(model).vocab_size)
