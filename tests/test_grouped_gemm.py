"""The grouped int4 expert GEMM (kernels/triton_grouped_gemm.py) against float64 references on
fresh random weights: rows laid out expert by expert in padded blocks, each block one cache
slot. Under TRITON_INTERPRET=1 (conftest.py) on CPU tensors without a GPU."""

from __future__ import annotations

import pytest
import torch

from hybridgen.experts.format import GROUP, PackedMatrices
from hybridgen.kernels import reference
from hybridgen.kernels import triton_grouped_gemm as gemm
from tests.kernel_helpers import DEVICE, randn, rel_err, tol

SLOTS = 4


def _stack(gen: torch.Generator, n: int, k: int, dtype: torch.dtype) -> PackedMatrices:
    w = randn(gen, SLOTS, n, k, dtype=torch.float64, device="cpu")
    w[:, :, 5] *= 20  # an outlier input channel
    packed = PackedMatrices.pack(w.to(dtype), "int4")
    return PackedMatrices("int4", {k: t.to(DEVICE) for k, t in packed.parts.items()}, dtype)


def _i32(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


def _layout(experts: list[tuple[int, list[int]]], bm: int) -> tuple[list[int], list[int]]:
    """(slot, its rows of x) per expert -> (rows, block_slots) padded to blocks of bm."""
    rows: list[int] = []
    slots: list[int] = []
    for slot, xs in experts:
        blocks = -(-len(xs) // bm)
        rows += xs + [-1] * (blocks * bm - len(xs))
        slots += [slot] * blocks
    return rows, slots


@pytest.mark.usefixtures("poison_empty")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bm", [16, 32])
def test_int4_grouped_gemm(dtype: torch.dtype, bm: int) -> None:
    """Experts of 1, bm and bm + 3 rows (a padded block, a whole one, two blocks), a slot
    used twice, rows of x read by several experts, outputs scattered out of order: each used
    position against its slot's dequantized matrix in float64; rows of y no position writes
    keep what they held."""
    gen = torch.Generator().manual_seed(bm + (dtype == torch.float32))
    n, k = 128, 192
    stack = _stack(gen, n, k, dtype)
    x = randn(gen, 40, k, dtype=dtype)
    perm = torch.randperm(40, generator=gen).tolist()
    experts = [(2, perm[:1]), (0, perm[1 : 1 + bm]), (3, perm[: bm + 3]), (2, perm[5:9])]
    rows, block_slots = _layout(experts, bm)
    used = [i for i, r in enumerate(rows) if r >= 0]
    targets = torch.randperm(len(used) + 7, generator=gen).tolist()
    outs = [-1] * len(rows)
    for i, t in zip(used, targets, strict=False):
        outs[i] = t
    y = torch.full((len(used) + 7, n), 7.0, dtype=dtype, device=DEVICE)
    out = gemm.int4_grouped_gemm(
        x, _i32(rows), _i32(outs), _i32(block_slots), stack.parts, GROUP, y
    )
    assert out is y
    written = set()
    for i in used:
        slot = block_slots[i // bm]
        ref = x[rows[i]].double() @ stack.matrix(slot).double().T
        assert rel_err(y[outs[i]], ref) < tol(dtype)
        written.add(outs[i])
    for t in set(range(y.shape[0])) - written:
        assert bool((y[t] == 7.0).all())


@pytest.mark.usefixtures("poison_empty")
def test_int4_grouped_swiglu() -> None:
    """gate_up, SiLU-and-mul and down of every used position against float64 SwiGLU on the
    dequantized weights."""
    gen = torch.Generator().manual_seed(11)
    hidden, inter = 128, 192
    gate_up = _stack(gen, 2 * inter, hidden, torch.float32)
    down = _stack(gen, hidden, inter, torch.float32)
    x = randn(gen, 20, hidden)
    rows, block_slots = _layout([(1, list(range(20))), (3, [4, 0, 9])], 16)
    outs = [i if r >= 0 else -1 for i, r in enumerate(rows)]
    y = torch.empty(len(rows), hidden, device=DEVICE)
    gemm.int4_grouped_swiglu(
        x, _i32(rows), _i32(outs), _i32(block_slots), gate_up.parts, down.parts, GROUP, y
    )
    for i, r in enumerate(rows):
        if r < 0:
            continue
        slot = block_slots[i // 16]
        h = x[r].double() @ gate_up.matrix(slot).double().T
        act = reference.silu_and_mul(h[None])[0]
        assert rel_err(y[i], act @ down.matrix(slot).double().T) < 1e-5


def test_block_m_keeps_padding_under_half_a_block_an_expert() -> None:
    assert gemm.block_m(256 * 8, 128) == 16  # qwen3-30b-a3b, a 256-token prompt: 16 an expert
    assert gemm.block_m(256 * 2, 8) == 64  # mixtral: 64 an expert
    assert gemm.block_m(20 * 8, 8) == 32
    assert gemm.block_m(4096, 8) == 64  # past the largest block: several blocks an expert
