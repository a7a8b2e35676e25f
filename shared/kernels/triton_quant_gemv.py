"""y = x @ dequant(W).T for a few rows of x, W int8 or int4 as stored (Triton): the device's
MoE experts in cold_weights.expert_format int8 / int4 (models/expert_format.py).

An expert at decode sees one or a few tokens, so its time is the weight's bytes over the
memory bandwidth. Dequantizing the whole matrix to the model dtype first (torch ops) writes
and re-reads it several times over, about 40x the stored bytes for int4; these kernels read
the codes and scales once and dequantize in registers.

Layouts (expert_format.PackedMatrices):
    int8  q int8 [N, K], s fp32 [N]: w[n, k] = q[n, k] * s[n]
    int4  q uint8 [N, K / 2], s fp16 [N, K / GROUP]: byte b of row n holds code k = 2b in its
          low nibble and k = 2b + 1 in its high nibble, w[n, k] = (code - 8) * s[n, k // GROUP]

Grid (cdiv(N, BLOCK_N), T): each program owns BLOCK_N output rows of one row of x, streams
their codes along K once and reduces in fp32 registers; the order of the additions depends
only on the tiles, so results are deterministic. Rows of x past MAX_ROWS re-read the weight
once per row; the caller dequantizes instead (expert_format.PackedMatrices.linear).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

MAX_ROWS = 16
"""Rows of x up to which the fused kernels beat dequantize-then-matmul."""
BLOCK_N = 16
BLOCK_K = 256
"""Weights (not bytes) per K tile."""


@triton.jit
def _int8_kernel(
    x_ptr, q_ptr, s_ptr, y_ptr, N, K, stride_x, stride_q, stride_y,
    EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(1).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    rows_safe = tl.where(row_ok, rows, 0).to(tl.int64)  # out-of-range rows re-read row 0
    cols = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + cols
        q_ptrs = q_ptr + rows_safe[:, None] * stride_q + k[None, :]
        if EVEN_K:
            x = tl.load(x_ptr + t * stride_x + k)
            q = tl.load(q_ptrs, eviction_policy="evict_first")
        else:
            k_ok = k < K
            x = tl.load(x_ptr + t * stride_x + k, mask=k_ok, other=0.0)
            q = tl.load(q_ptrs, mask=k_ok[None, :], other=0, eviction_policy="evict_first")
        acc += q.to(tl.float32) * x.to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1) * tl.load(s_ptr + rows_safe).to(tl.float32)
    tl.store(y_ptr + t * stride_y + rows, y.to(y_ptr.dtype.element_ty), mask=row_ok)


@triton.jit
def _int4_kernel(
    x_ptr, q_ptr, s_ptr, y_ptr, N, K, stride_x, stride_q, stride_s, stride_y,
    GROUP: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr,
):  # fmt: skip
    # BLOCK_B bytes (2 * BLOCK_B weights) per K tile; K is a multiple of GROUP.
    t = tl.program_id(1).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    rows_safe = tl.where(row_ok, rows, 0).to(tl.int64)
    cols = tl.arange(0, BLOCK_B)
    acc = tl.zeros((BLOCK_N, BLOCK_B), dtype=tl.float32)
    x_row = x_ptr + t * stride_x
    for b0 in range(0, K // 2, BLOCK_B):
        b = b0 + cols
        q_ptrs = q_ptr + rows_safe[:, None] * stride_q + b[None, :]
        s_ptrs = s_ptr + rows_safe[:, None] * stride_s + (b // (GROUP // 2))[None, :]
        if EVEN_K:
            packed = tl.load(q_ptrs, eviction_policy="evict_first")
            scale = tl.load(s_ptrs)
            x_lo = tl.load(x_row + 2 * b)
            x_hi = tl.load(x_row + 2 * b + 1)
        else:
            b_ok = b < K // 2
            packed = tl.load(q_ptrs, mask=b_ok[None, :], other=0, eviction_policy="evict_first")
            scale = tl.load(s_ptrs, mask=b_ok[None, :], other=0.0)
            x_lo = tl.load(x_row + 2 * b, mask=b_ok, other=0.0)
            x_hi = tl.load(x_row + 2 * b + 1, mask=b_ok, other=0.0)
        lo = (packed & 15).to(tl.float32) - 8.0
        hi = (packed >> 4).to(tl.float32) - 8.0
        part = lo * x_lo.to(tl.float32)[None, :] + hi * x_hi.to(tl.float32)[None, :]
        acc += part * scale.to(tl.float32)
    y = tl.sum(acc, axis=1)
    tl.store(y_ptr + t * stride_y + rows, y.to(y_ptr.dtype.element_ty), mask=row_ok)


def int8_linear(x: Tensor, q: Tensor, s: Tensor) -> Tensor:
    """x [T, K] (T <= MAX_ROWS), q int8 [N, K], s [N] -> [T, N] in x.dtype, fp32 sums."""
    n, k = q.shape
    t = x.shape[0]
    assert x.shape == (t, k) and t <= MAX_ROWS and q.stride(-1) == 1 and s.shape == (n,)
    x = x if x.stride(-1) == 1 else x.contiguous()
    y = torch.empty(t, n, dtype=x.dtype, device=x.device)
    _int8_kernel[(triton.cdiv(n, BLOCK_N), t)](
        x, q, s, y, n, k, x.stride(0), q.stride(0), y.stride(0),
        EVEN_K=k % BLOCK_K == 0, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=4,
    )  # fmt: skip
    return y


def int4_linear(x: Tensor, q: Tensor, s: Tensor, group: int) -> Tensor:
    """x [T, K] (T <= MAX_ROWS), q uint8 [N, K / 2], s [N, K / group] -> [T, N] in x.dtype."""
    n, half = q.shape
    t, k = x.shape
    assert k == 2 * half and k % group == 0 and s.shape == (n, k // group)
    assert t <= MAX_ROWS and q.stride(-1) == 1 and s.stride(-1) == 1
    x = x if x.stride(-1) == 1 else x.contiguous()
    y = torch.empty(t, n, dtype=x.dtype, device=x.device)
    block_b = BLOCK_K // 2
    _int4_kernel[(triton.cdiv(n, BLOCK_N), t)](
        x, q, s, y, n, k, x.stride(0), q.stride(0), s.stride(0), y.stride(0),
        GROUP=group, EVEN_K=half % block_b == 0, BLOCK_N=BLOCK_N, BLOCK_B=block_b, num_warps=4,
    )  # fmt: skip
    return y
