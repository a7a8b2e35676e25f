"""Fused residual add + RMSNorm (Triton)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    H,
    stride_x,
    stride_res,
    stride_out,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # One program per row; the whole row lives in registers (BLOCK >= H).
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        # Round the sum to the model dtype first: HF adds the residual in that dtype.
        s = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(res_ptr + row * stride_res + cols, s, mask=mask)
    else:
        s = x
    s32 = s.to(tl.float32)
    var = tl.sum(s32 * s32, axis=0) / H
    rstd = 1.0 / tl.sqrt(var + eps)
    # HF order: normalize in fp32, cast to the model dtype, then scale by the weight.
    normed = (s32 * rstd).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    out = (w * normed).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_out + cols, out, mask=mask)


def _rows(t: Tensor) -> Tensor:
    # [..., H] -> [R, H] with unit stride along H (the kernel indexes columns contiguously).
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def add_rms_norm(
    x: Tensor, residual: Tensor | None, weight: Tensor, eps: float
) -> tuple[Tensor, Tensor]:
    """Returns (out, residual_out); see reference.add_rms_norm for the math.

    When `residual` is given, residual_out = x + residual is written IN PLACE into `residual`
    (or into a contiguous copy when `residual` has no unit stride along H) and returned: callers
    must treat the `residual` argument as consumed. With residual None, residual_out is `x`.
    """
    # x, residual: [T, H]; weight: [H]
    hidden = x.shape[-1]
    x2 = _rows(x)
    res2 = None if residual is None else _rows(residual)
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(x2.shape, dtype=out_dtype, device=x.device)
    block = triton.next_power_of_2(hidden)
    num_warps = 4 if block <= 2048 else (8 if block <= 8192 else 16)
    n_rows = x2.shape[0]
    if n_rows > 0:
        _add_rms_norm_kernel[(n_rows,)](
            x2,
            x2 if res2 is None else res2,
            weight.contiguous(),
            out,
            hidden,
            x2.stride(0),
            x2.stride(0) if res2 is None else res2.stride(0),
            out.stride(0),
            eps,
            HAS_RESIDUAL=res2 is not None,
            BLOCK=block,
            num_warps=num_warps,
        )
    out = out.view(x.shape)
    if residual is None or res2 is None:
        return out, x
    return out, res2.view(residual.shape)
