"""The Cold-Weights link between the daemons, in one process: the shared expert arena holds
the very tensors the loader built, and the CPU daemon's worker answers EXPERT_RUN with what
the GPU daemon would compute itself."""

from __future__ import annotations

import time
import uuid

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
