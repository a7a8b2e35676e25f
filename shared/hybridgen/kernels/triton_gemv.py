"""y = x @ W.T (+ bias) for one row of x: the batch-1 decode projections (Triton).

At batch 1 a projection reads its whole weight once, so its time is the weight's bytes over
the memory bandwidth. cuBLAS picks split-K kernels for the narrow projections of an 8B model
(o_proj 4096x4096, qkv 6144x4096) that reach about 3.1 TB/s plus a separate reduce kernel;
this kernel gives each program BLOCK_N whole output rows, streams their weights along K once,
and reduces in registers, so there is one kernel and no fp32 workspace.

Rows of W are contiguous (nn.Linear's [N, K] layout), so a [BLOCK_N, BLOCK_K] tile is
BLOCK_N coalesced runs of BLOCK_K elements. Each program keeps a [BLOCK_N, BLOCK_K] fp32
partial sum and reduces it over K once at the end. The order of the fp32 additions depends
only on the tile sizes, never on the launch, so results are deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor


@dataclass(frozen=True)
class GemvConfig:
    """Tile sizes and launch shape of one GEMV launch."""

    block_n: int = 8
    block_k: int = 512
    num_warps: int = 4
    num_stages: int = 4


def tiles_for(n: int) -> GemvConfig:
    """The H200 sweep's best tiles by output width (bench/gemv_bench.py, bench/NOTES.md).

    Narrow outputs (o_proj, down_proj: N 4096) have few rows to spread over 132 SMs and
    want long K tiles with more warps; wide ones (gate_up, lm_head) want short K tiles and
    many programs; qkv (N 6144) sits between.
    """
    if n <= 4096:
        return GemvConfig(16, 1024, 8, 4)
    if n >= 16384:
        return GemvConfig(16, 256, 4, 4)
    return GemvConfig()


@triton.jit
def row_dots(
    x_ptr,
    w_ptr,
    rows,
    stride_w,
    K,
    EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # -> [BLOCK_N] fp32: rows `rows` (int64, in range) of w [., K] (unit stride along K), each
    # dotted with x [K], streamed in [BLOCK_N, BLOCK_K] tiles; w is read once (evict first).
    # The int8 expert kernel (triton_quant_gemv) takes the same loop over its codes.
    cols = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + cols
        w_ptrs = w_ptr + rows[:, None] * stride_w + k[None, :]
        if EVEN_K:
            x = tl.load(x_ptr + k)
            w = tl.load(w_ptrs, eviction_policy="evict_first")
        else:
            k_ok = k < K
            x = tl.load(x_ptr + k, mask=k_ok, other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[None, :], other=0, eviction_policy="evict_first")
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    return tl.sum(acc, axis=1)


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    N,
    K,
    stride_w,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # Grid (cdiv(N, BLOCK_N),); x: [K]; w: [N, K] rows contiguous; y: [N].
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    rows_safe = tl.where(row_ok, rows, 0).to(tl.int64)  # out-of-range rows re-read row 0
    y = row_dots(x_ptr, w_ptr, rows_safe, stride_w, K, EVEN_K, BLOCK_N, BLOCK_K)
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=row_ok)


def gemv(
    x: Tensor, weight: Tensor, bias: Tensor | None = None, config: GemvConfig | None = None
) -> Tensor:
    """x: [1, K] or [K]; weight: [N, K] with unit stride along K; bias: [N] or None.

    Returns [1, N] (or [N]) in x.dtype, accumulated in fp32, like F.linear. `config`
    overrides the tiles `tiles_for` picks.
    """
    n, k = weight.shape
    cfg = config or tiles_for(n)
    assert x.shape[-1] == k and x.numel() == k, "gemv takes one row of x"
    assert weight.stride(-1) == 1, "weight rows must be contiguous"
    x1 = x.reshape(k)
    if x1.stride(0) != 1:
        x1 = x1.contiguous()
    y = torch.empty(n, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, cfg.block_n),)](
        x1,
        weight,
        bias if bias is not None else y,  # never read without HAS_BIAS
        y,
        n,
        k,
        weight.stride(0),
        HAS_BIAS=bias is not None,
        EVEN_K=k % cfg.block_k == 0,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return y.view(*x.shape[:-1], n)
