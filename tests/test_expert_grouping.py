"""A MoE step's experts grouped with their tokens (SparseMoeBlock._group): on the host from
one read-back of the ids, copied to the device in one transfer."""

from __future__ import annotations

import pytest
import torch

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
