"""Fused SiLU(gate) * up (Triton)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,
    out_ptr,
    inter,
    stride_x,
    stride_out,
    BLOCK: tl.constexpr,
):
    # Grid (rows, cdiv(inter, BLOCK)); x row = [gate (inter) | up (inter)].
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0)
    g32 = gate.to(tl.float32)
    # HF rounds silu(gate) to the model dtype before multiplying by up (also in that dtype).
    act = (g32 / (1.0 + tl.exp(-g32))).to(gate.dtype).to(tl.float32)
    out = (act * up.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_out + cols, out, mask=mask)


def silu_and_mul(x: Tensor) -> Tensor:
    # x: [..., 2I] -> [..., I]
    inter = x.shape[-1] // 2
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape[0], inter, dtype=x.dtype, device=x.device)
    block = min(triton.next_power_of_2(inter), 1024)
    if x2.shape[0] > 0 and inter > 0:
        grid = (x2.shape[0], triton.cdiv(inter, block))
        _silu_and_mul_kernel[grid](
            x2, out, inter, x2.stride(0), out.stride(0), BLOCK=block, num_warps=4
        )
    return out.view(*x.shape[:-1], inter)
