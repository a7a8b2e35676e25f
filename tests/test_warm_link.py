"""attn_warm across the daemons: the GPU daemon's client and the CPU daemon's worker thread,
over real shared memory, give exactly what warm_decode_attention gives in one process; a
missing worker is a WarmLinkDown, not a hang."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import torch

from hybridgen.ipc import shm
from hybridgen.kvtiers.codec import get_codec
from hybridgen.kvtiers.warm_attention import WarmSpan, warm_decode_attention
from hybridgen.kvtiers.warm_link import WarmLinkClient, WarmLinkDown, WarmLinkWorker
from hybridgen.kvtiers.warm_pool import WarmPool

L, S, HKV, D, HQ = 2, 8, 2, 16, 4


@pytest.fixture
def pool() -> Iterator[WarmPool]:
    instance = f"wl{uuid.uuid4().hex[:8]}"
    warm = WarmPool.create(instance, get_codec("int8", S, HKV, D, torch.float32), L, 12)
    gen = torch.Generator().manual_seed(0)
    for slot in warm.alloc(12):
        k = torch.randn(L, S, HKV, D, generator=gen)
        warm.store(slot, k, torch.randn(L, S, HKV, D, generator=gen))
    yield warm
    warm.close()
    shm.unlink_all(instance)


def test_worker_answers_like_the_local_call(pool: WarmPool) -> None:
    client = WarmLinkClient(pool.instance)
    worker = WarmLinkWorker(pool.instance)
    worker.start()
    try:
        q = torch.randn(3, HQ, D, generator=torch.Generator().manual_seed(1))
        spans = [
            WarmSpan([0, 1, 2], 0, S, 40),
            WarmSpan([], 0, S, 10),  # no Warm keys: out 0, lse -inf
            WarmSpan([3, 4, 5, 6], 16, 5, 60),  # a partial last block, not from position 0
        ]
        for layer in range(L):
            got = client.partial(layer, q, spans, 0.25)
            want = warm_decode_attention(pool, layer, q, spans, 0.25)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert worker.answered == L
    finally:
        worker.stop()
        client.close()


def test_no_worker_is_link_down_not_a_hang(pool: WarmPool) -> None:
    client = WarmLinkClient(pool.instance, timeout_s=0.2)
    try:
        with pytest.raises(WarmLinkDown):
            client.partial(0, torch.zeros(1, HQ, D), [WarmSpan([0], 0, S, 8)], 0.25)
    finally:
        client.close()
