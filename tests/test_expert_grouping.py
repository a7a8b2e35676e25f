"""A MoE step's experts grouped with their tokens (SparseMoeBlock._group): on the host from
one read-back of the ids, copied to the device in one transfer."""

from __future__ import annotations

import pytest
import torch

from hybridgen.experts import grouped
from hybridgen.models.moe import SparseMoeBlock
from tests.kernel_helpers import DEVICE


@pytest.mark.parametrize("tokens", [2, 5, 64])
def test_experts_group_as_torch_where_finds_them(tokens: int) -> None:
    """A step's experts, grouped on the host and copied to the device in one transfer: each
    expert's rows and top-k slots are exactly torch.where's (ascending, row-major), so the
    outputs add up in the same order, for fresh random picks."""
    gen = torch.Generator().manual_seed(tokens)
    top_k, experts = 8, 64
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    routed = SparseMoeBlock._group(ids.to(DEVICE), torch.device(DEVICE))
    assert [r.expert for r in routed] == torch.unique(ids).tolist()
    for r in routed:
        rows, slot = torch.where(ids == r.expert)
        assert isinstance(r.rows, torch.Tensor) and isinstance(r.slot, torch.Tensor)
        assert r.rows.device.type == torch.device(DEVICE).type
        assert r.rows.cpu().tolist() == rows.tolist() and r.slot.cpu().tolist() == slot.tolist()
        assert r.tokens == len(rows)


def test_rows_reach_the_device_once_and_only_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """Grouping copies nothing to the device: the grouped launch reads its cache hits' rows
    from its own table, so a step whose experts all hit makes no copy here. The first expert
    whose rows are asked for brings every expert's in one copy."""
    import hybridgen.models.moe as moe

    copies: list[torch.Tensor] = []
    real = moe.upload

    def counted(host: torch.Tensor, device: torch.device) -> torch.Tensor:
        copies.append(host)
        return real(host, device)

    monkeypatch.setattr(moe, "upload", counted)
    ids = torch.tensor([[3, 1], [1, 7], [7, 3]])
    routed = SparseMoeBlock._group(ids.to(DEVICE), torch.device(DEVICE))
    assert [(r.expert, r.tokens) for r in routed] == [(1, 2), (3, 2), (7, 2)]
    assert not copies
    assert routed[1].rows.tolist() == [0, 2] and routed[1].slot.tolist() == [0, 1]  # type: ignore[union-attr]
    assert routed[2].rows.tolist() == [1, 2] and routed[0].slot.tolist() == [1, 0]  # type: ignore[union-attr]
    assert len(copies) == 1


@pytest.mark.parametrize(
    ("tokens", "top_k", "experts"), [(1, 8, 128), (3, 2, 8), (40, 8, 64), (300, 2, 8)]
)
def test_a_steps_table_packs_the_same_in_loops_and_in_arrays(
    tokens: int, top_k: int, experts: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """pack_step's two ways (Python loops for few pairs, numpy from NUMPY_PAIRS on) give the
    same table, byte for byte, for fresh random picks with cache hits, many-row experts and
    the others in a shuffled order; a large step takes the arrays."""
    for seed in range(3):
        gen = torch.Generator().manual_seed(seed)
        ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
        step = torch.unique(ids)[torch.randperm(len(torch.unique(ids)), generator=gen)].tolist()
        hits = {e: 2 * i for i, e in enumerate(step[0::3])}
        many = {e: 2 * i + 1 for i, e in enumerate(step[1::3])}
        others = step[2::3]
        loop = grouped._pack_loop(ids, hits, others, many, 16)
        assert loop == grouped._pack_arrays(ids, hits, others, many, 16)
        assert loop.pairs == sum(int((ids == e).sum()) for e in hits)
        every = {e: i for i, e in enumerate(step)}  # a decode step all in the cache
        assert grouped._pack_loop(ids, every, [], {}, 16) == grouped._pack_arrays(
            ids, every, [], {}, 16
        )
    if ids.numel() >= grouped.NUMPY_PAIRS:

        def no_loop(*args: object) -> None:
            raise AssertionError("a large step packed in loops")

        monkeypatch.setattr(grouped, "_pack_loop", no_loop)
    assert grouped.pack_step(ids, hits, others, many, 16) == loop
