"""Shared test setup.

Triton kernels run on the CPU through Triton's interpreter when no GPU is present, so CI
covers them numerically. The variable must be set before any kernel module is imported.
"""

from __future__ import annotations

import gc
import os
import uuid
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


import pytest
import structlog

from hybridgen.ipc import shm
from tests.checkpoints import build_checkpoint

KINDS = ("llama3", "qwen2", "mistral", "llama2_linear")


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """checkpoint(kind, **options) -> Path, built once per distinct arguments per session."""
    built: dict[tuple, object] = {}

    def get(kind: str, **options: object):  # type: ignore[no-untyped-def]
        key = (kind, repr(sorted(options.items())))  # list options (mlp_only_layers) too
        if key not in built:
            name = "-".join([kind, *(f"{k}{v}" for k, v in sorted(options.items()))])
            built[key] = build_checkpoint(kind, tmp_path_factory.mktemp(name), **options)
        return built[key]

    return get


@pytest.fixture(autouse=True)
def _log_config_restored() -> Iterator[None]:
    """Each test ends with structlog configured as it began: a script's main run in process
    (bench/profile_prefill.py sets warning level) must not hide the info events a later
    test captures."""
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


@pytest.fixture(autouse=True)
def _cuda_released() -> Iterator[None]:
    """On CUDA, each test starts and ends with the caching allocator emptied and no memory
    cap, so that what one test leaves (an engine's cap after a failure, cached blocks) cannot
    make the next run out of memory: the whole CUDA suite runs in one process."""
    if not torch.cuda.is_available():
        yield
        return
    _release_cuda()
    yield
    _release_cuda()


def _release_cuda() -> None:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    for i in range(torch.cuda.device_count()):
        torch.cuda.set_per_process_memory_fraction(1.0, i)


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
