"""Shared by the kernel tests: device, error measures, random inputs with outliers, and a
fixture that poisons torch.empty so unwritten outputs show up as NaN."""

from __future__ import annotations

import torch
from torch import Tensor

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
FP32_TOL = 1e-5
LOW_TOL = {torch.bfloat16: 2e-2, torch.float16: 2e-3}


def rel_err(out: Tensor, ref: Tensor) -> float:
    out, ref = out.cpu().double(), ref.cpu().double()
    return ((out - ref).norm() / ref.norm()).item()


def tol(dtype: torch.dtype) -> float:
    return FP32_TOL if dtype == torch.float32 else LOW_TOL[dtype]


def randn(
    gen: torch.Generator,
    *shape: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = DEVICE,
) -> Tensor:
    """Standard normal with ~1% outliers scaled by 8 (drawn on the CPU for reproducibility)."""
    x = torch.randn(*shape, generator=gen)
    outliers = torch.rand(*shape, generator=gen) < 0.01
    return torch.where(outliers, x * 8.0, x).to(device=device, dtype=dtype)
