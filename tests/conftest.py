"""Shared test setup.

Triton kernels run on the CPU through Triton's interpreter when no GPU is present, so CI
covers them numerically. The variable must be set before any kernel module is imported.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


import pytest

from hybridgen.ipc import shm
from tests.checkpoints import build_checkpoint

KINDS = ("llama3", "qwen2", "mistral", "llama2_linear")


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """checkpoint(kind, **options) -> Path, built once per distinct arguments per session."""
    built: dict[tuple, object] = {}

    def get(kind: str, **options: object):  # type: ignore[no-untyped-def]
        key = (kind, tuple(sorted(options.items())))
        if key not in built:
            name = "-".join([kind, *(f"{k}{v}" for k, v in sorted(options.items()))])
            built[key] = build_checkpoint(kind, tmp_path_factory.mktemp(name), **options)
        return built[key]

    return get


@pytest.fixture
def poison_empty(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Make torch.empty / empty_like return NaN-filled floating tensors."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def _fill(t: Tensor) -> Tensor:
        return t.fill_(float("nan")) if t.is_floating_point() else t.fill_(-(2**30))

    def empty(*args: Any, **kwargs: Any) -> Tensor:
        return _fill(real_empty(*args, **kwargs))

    def empty_like(*args: Any, **kwargs: Any) -> Tensor:
        return _fill(real_empty_like(*args, **kwargs))

    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch, "empty_like", empty_like)
    yield


@pytest.fixture
def instance() -> Iterator[str]:
    """A unique shared-memory instance name; everything of it is unlinked afterwards."""
    name = "t" + uuid.uuid4().hex[:16]
    try:
        yield name
    finally:
        shm.unlink_all(name)
