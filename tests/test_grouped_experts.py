"""The grouped expert kernels (kernels/triton_grouped_experts.py) against float64 references
on fresh random weights, and against the per-expert kernels (triton_quant_gemv) they replace.
Under TRITON_INTERPRET=1 (conftest.py) on CPU tensors without a GPU."""

from __future__ import annotations

import pytest
import torch

from hybridgen.experts.format import GROUP, PackedMatrices
from hybridgen.kernels import reference
from hybridgen.kernels import triton_grouped_experts as grouped
from hybridgen.kernels import triton_quant_gemv as t_qgemv
from tests.kernel_helpers import DEVICE, randn, rel_err, tol

SLOTS = 5


def _stack(gen: torch.Generator, n: int, k: int, fmt: str, dtype: torch.dtype) -> PackedMatrices:
    w = randn(gen, SLOTS, n, k, dtype=torch.float64, device="cpu")
    w[:, :, 3] *= 20  # an outlier input channel
    packed = PackedMatrices.pack(w.to(dtype), fmt)  # type: ignore[arg-type]
    return PackedMatrices(fmt, {k: t.to(DEVICE) for k, t in packed.parts.items()}, dtype)  # type: ignore[arg-type]


def _i32(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


@pytest.mark.slow
@pytest.mark.usefixtures("poison_empty")
@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("n", "k"),
    [
        (128, 320),  # K not a multiple of the K tiles
        (64, 2048),  # one int4 row block: K splits in 8 (partials summed)
    ],
)
def test_grouped_linear(fmt: str, dtype: torch.dtype, n: int, k: int) -> None:
    """Pairs with repeated rows and slots, out of order: each pair's row of x times its
    slot's dequantized matrix in float64, and the per-expert kernel's result for that row."""
    gen = torch.Generator().manual_seed(n + k)
    stack = _stack(gen, n, k, fmt, dtype)
    x = randn(gen, 3, k, dtype=dtype)
    rows, slots = [2, 0, 0, 1, 2], [4, 4, 1, 0, 1]
    out = grouped.grouped_linear(x, fmt, stack.parts, _i32(rows), _i32(slots), GROUP)
    assert out.shape == (len(rows), n) and out.dtype == dtype
    pairs = list(zip(rows, slots, strict=True))
    ref = torch.stack([x[r].double() @ stack.matrix(s).double().T for r, s in pairs])
    assert rel_err(out, ref) < tol(dtype)
    for p, (r, s) in enumerate(pairs):
        if fmt == "int8":
            one = t_qgemv.int8_linear(x[r : r + 1], stack.parts["q"][s], stack.parts["s"][s])
        else:
            one = t_qgemv.int4_linear(
                x[r : r + 1], stack.parts["q"][s], stack.parts["sz"][s], GROUP
            )
        assert torch.allclose(out[p].float(), one[0].float(), rtol=1e-5, atol=1e-5)


@pytest.mark.usefixtures("poison_empty")
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_grouped_swiglu(fmt: str) -> None:
    """gate_up, SiLU-and-mul and down of every pair against float64 SwiGLU on the
    dequantized weights (the activation rounded as HF's in fp32 is exact anyway)."""
    gen = torch.Generator().manual_seed(7)
    hidden, inter = 128, 192
    gate_up = _stack(gen, 2 * inter, hidden, fmt, torch.float32)
    down = _stack(gen, hidden, inter, fmt, torch.float32)
    x = randn(gen, 2, hidden)
    rows, slots = [0, 1, 1], [3, 3, 0]
    out = grouped.grouped_swiglu(x, fmt, gate_up.parts, down.parts, _i32(rows), _i32(slots), GROUP)
    for p, (r, s) in enumerate(zip(rows, slots, strict=True)):
        h = x[r].double() @ gate_up.matrix(s).double().T
        act = reference.silu_and_mul(h[None])[0]
        ref = act @ down.matrix(s).double().T
        assert rel_err(out[p], ref) < 1e-5


@pytest.mark.usefixtures("poison_empty")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weighted_sum(dtype: torch.dtype) -> None:
    """Each token's rows, weighted through the index table and cast before each add, summed
    in row order: the same values as combine()'s loop in torch."""
    gen = torch.Generator().manual_seed(3)
    tokens, top_k, hidden = 3, 4, 1500  # hidden past one block
    y = randn(gen, tokens * top_k, hidden, dtype=dtype)
    weights = torch.rand(tokens, top_k, generator=gen).to(DEVICE)
    order = torch.argsort(torch.rand(tokens, top_k, generator=gen), dim=1)
    widx = (order + torch.arange(tokens)[:, None] * top_k).flatten()
    out = grouped.weighted_sum(y, weights, widx.to(torch.int32).to(DEVICE), top_k)
    flat = weights.flatten()
    expected = None
    for j in range(top_k):
        rows = torch.arange(tokens) * top_k + j
        term = (y[rows] * flat[widx[rows].to(DEVICE), None]).to(dtype)
        expected = term if expected is None else expected + term
    assert expected is not None
    if dtype == torch.float32 and DEVICE.type == "cpu":
        assert torch.equal(out, expected)
    elif dtype == torch.float32:  # compiled, the multiply and the add fuse into one FMA (one
        assert rel_err(out, expected) < 1e-6  # rounding fewer than torch's): seen on the H200
    else:  # the interpreter truncates fp32 -> bf16 casts (tests/test_kernels.py)
        assert rel_err(out, expected) < 2e-2
