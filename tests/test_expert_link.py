"""The Cold-Weights link between the daemons, in one process: the shared expert arena holds
the very tensors the loader built, and the CPU daemon's worker answers EXPERT_RUN with what
the GPU daemon would compute itself."""

from __future__ import annotations

import resource
import time
import uuid

import numpy as np
import pytest
import torch

from hybridgen.experts.arena import ExpertArena
from hybridgen.experts.link import (
    ExpertLinkClient,
    ExpertLinkWorker,
    decode_request,
    encode_request,
)
from hybridgen.ipc import shm
from hybridgen.models.loader import load_model
from hybridgen.models.moe import SparseMoeBlock


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_request_round_trips(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    jobs = [
        (3, torch.randn(2, 16, generator=g).to(dtype)),
        (5, torch.randn(1, 16, generator=g).to(dtype)),
    ]
    layer, back = decode_request(encode_request(7, jobs))
    assert layer == 7 and [e for e, _ in back] == [3, 5]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(jobs, back, strict=True))


def test_worker_computes_from_the_shared_arena() -> None:
    instance = f"t{uuid.uuid4().hex[:12]}"
    loaded = load_model("tiny-mixtral", torch.device("cpu"), None, 0, "int4", instance)
    arena = loaded.expert_arena
    assert arena is not None
    blocks = [m for m in loaded.model.modules() if isinstance(m, SparseMoeBlock)]
    stores = ExpertArena.attach(instance)  # what the CPU daemon sees
    for block, seen in zip(blocks, stores, strict=True):
        assert block.store is not None
        for mine, theirs in ((block.store.gate_up, seen.gate_up), (block.store.down, seen.down)):
            assert mine.fmt == theirs.fmt == "int4"
            assert all(torch.equal(mine.parts[k], theirs.parts[k]) for k in mine.parts)

    worker, client = ExpertLinkWorker(instance), ExpertLinkClient(instance)
    worker.start()
    try:
        x = torch.randn(3, loaded.spec.hidden_size, generator=torch.Generator().manual_seed(1))
        jobs = [(1, x[:1]), (6, x[1:])]
        sent = time.monotonic()
        ys = client.wait(client.submit(2, jobs), jobs)
        assert sent < client.answered_at < time.monotonic()  # one clock for both sides
        assert blocks[2].store is not None
        for (expert, rows), y in zip(jobs, ys, strict=True):
            assert torch.equal(y, blocks[2].store.run_cpu(expert, rows))
        assert worker.answered == 1 and client.cpu_s > 0
    finally:
        worker.stop()
        client.close()
        arena.close()
        shm.unlink_all(instance)
    assert shm.list_instance(instance) == []


def _faults_reading(mm: object) -> int:
    """Minor page faults taken reading every byte of `mm` once (no temporaries)."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    np.frombuffer(mm, dtype=np.uint8).max()  # type: ignore[call-overload]
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def test_a_populated_mapping_reads_without_faults(instance: str) -> None:
    """attach_segment(populate=True) maps every page at attach: the first read of the 4,096
    pages of a 16 MB segment then takes no page faults, where a plain mapping takes one per
    page or per fault-around batch of them."""
    name = shm.segment_name(instance, "faults")
    owner = shm.create_segment(name, 16 << 20)
    try:
        owner[:] = b"\x01" * len(owner)
        plain = shm.attach_segment(name)
        assert _faults_reading(plain) > 100
        populated = shm.attach_segment(name, populate=True)
        assert _faults_reading(populated) < 20
        plain.close()
        populated.close()
    finally:
        owner.close()
        shm.unlink_segment(name)


def test_the_cpu_daemon_maps_the_expert_arena_populated(monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker's stores come from a populated mapping (the header is read first, from a
    plain one: the segment may not be published yet)."""
    instance = f"t{uuid.uuid4().hex[:12]}"
    loaded = load_model("tiny-mixtral", torch.device("cpu"), None, 0, "int4", instance)
    assert loaded.expert_arena is not None
    calls: list[bool] = []
    attach = shm.attach_segment

    def recorded(name: str, populate: bool = False) -> object:
        calls.append(populate)
        return attach(name, populate)

    monkeypatch.setattr(shm, "attach_segment", recorded)
    try:
        ExpertArena.attach(instance)
        assert calls == [False, True]
    finally:
        loaded.expert_arena.close()
        shm.unlink_all(instance)
