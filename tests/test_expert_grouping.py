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
