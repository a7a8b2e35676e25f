"""y = x @ dequant(W).T (+ bias) for a dense layer's int8 / int4 weight (Triton), decode and
prefill alike: models/dense_quant.py's formats.

One kernel per format, grid (cdiv(T, BLOCK_M), cdiv(N, BLOCK_N)): each program streams its
BLOCK_N weight rows along K once, dequantizes each [BLOCK_N, BLOCK_K] tile in registers to
x's dtype and multiplies it with the matching [BLOCK_M, BLOCK_K] tile of x on the tensor
cores (tl.dot, fp32 accumulation). At decode T is 1 to a few rows, padded to BLOCK_M = 16 in
registers: the time is the weight's bytes over the memory bandwidth, a quarter of bf16's for
int4. A prefill re-reads each weight tile once per BLOCK_M rows of x, like a plain GEMM.

int4 splits each tile into its low and high nibbles: byte j of a 32-input run holds inputs j
and j + 16, so the low nibbles of a tile are the inputs [32c, 32c + 16) of every run c and
the high ones [32c + 16, 32c + 32); x is loaded in the same two halves and the tile costs two
dots of BLOCK_K / 2, with no shuffle of the codes. Scales (and zeros) are per run of 32 (a
group is a whole number of runs), loaded once per run and broadcast over its 16 inputs.
fp32 activations multiply in IEEE fp32 (no TF32; bf16 and fp16 ones are unaffected), so the
CPU interpreter and a float64 reference agree to fp32 rounding.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
"""Running in Triton's CPU interpreter (the tests without a GPU)."""
BLOCK_M = 16
BLOCK_N = 64
BLOCK_K = 128


@triton.jit
def _int8_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    b_ptr,
    y_ptr,
    T,
    N,
    K,
    GROUPS,
    GROUP,
    HAS_BIAS: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, BLOCK_K)
    m_ok, n_ok = rm < T, rn < N
    rn64 = tl.where(n_ok, rn, 0).to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + kk
        k_ok = k < K
        x = tl.load(
            x_ptr + rm[:, None].to(tl.int64) * K + k[None, :],
            mask=m_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        q = tl.load(
            q_ptr + rn64[:, None] * K + k[None, :],
            mask=k_ok[None, :],
            other=0,
            eviction_policy="evict_first",
        )
        s = tl.load(
            s_ptr + rn64[:, None] * GROUPS + (k // GROUP)[None, :], mask=k_ok[None, :], other=0.0
        )
        w = (q.to(tl.float32) * s).to(x.dtype)  # [BLOCK_N, BLOCK_K]
        acc += _dot(x, w, UPCAST)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out = y_ptr + rm[:, None].to(tl.int64) * N + rn[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _int4_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    z_ptr,
    b_ptr,
    y_ptr,
    T,
    N,
    K,
    GROUPS,
    RUNS_PER_GROUP,
    HAS_BIAS: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    HALF: tl.constexpr = BLOCK_K // 2
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = rm < T, rn < N
    rn64 = tl.where(n_ok, rn, 0).to(tl.int64)
    # Position h of a half-tile: run h // 16, byte h % 16; its low input is 32 * run + byte.
    h = tl.arange(0, HALF)
    run_of, byte_of = h // 16, h % 16
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        run = k0 // 32 + run_of  # [HALF]
        k_lo = 32 * run + byte_of
        ok = k_lo < K
        packed = tl.load(
            q_ptr + rn64[:, None] * (K // 2) + (16 * run + byte_of)[None, :],
            mask=ok[None, :],
            other=0,
            eviction_policy="evict_first",
        )
        g = (run // RUNS_PER_GROUP)[None, :]
        s = tl.load(s_ptr + rn64[:, None] * GROUPS + g, mask=ok[None, :], other=0.0)
        z = tl.load(z_ptr + rn64[:, None] * GROUPS + g, mask=ok[None, :], other=0.0)
        s, z = s.to(tl.float32), z.to(tl.float32)
        xrow = x_ptr + rm[:, None].to(tl.int64) * K
        x_mask = m_ok[:, None] & ok[None, :]
        x_lo = tl.load(xrow + k_lo[None, :], mask=x_mask, other=0.0)
        x_hi = tl.load(xrow + (k_lo + 16)[None, :], mask=x_mask, other=0.0)
        w_lo = ((packed & 15).to(tl.float32) * s + z).to(x_lo.dtype)
        w_hi = ((packed >> 4).to(tl.float32) * s + z).to(x_lo.dtype)
        acc += _dot(x_lo, w_lo, UPCAST) + _dot(x_hi, w_hi, UPCAST)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out = y_ptr + rm[:, None].to(tl.int64) * N + rn[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _dot(x, w, UPCAST: tl.constexpr):
    # x [M, BK] @ w [N, BK]^T in fp32. UPCAST: multiply as fp32 (the same rounded inputs), for
    # Triton's CPU interpreter, whose bf16 tl.dot returns garbage (numpy has no bfloat16).
    if UPCAST:
        return tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
    return tl.dot(x, tl.trans(w), input_precision="ieee")


def quant_linear(
    x: Tensor,
    fmt: str,
    codes: Tensor,
    scale: Tensor,
    zero: Tensor | None,
    group: int,
    bias: Tensor | None = None,
) -> Tensor:
    """x [T, K] -> [T, N] in x.dtype for an int8 / int4 weight (dense_quant.QuantWeight's
    tensors, contiguous)."""
    x = x.contiguous()
    t, k = x.shape
    n, groups = scale.shape
    assert groups * group == k and k % 32 == 0 and codes.is_contiguous() and scale.is_contiguous()
    y = torch.empty(t, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(t, BLOCK_M), triton.cdiv(n, BLOCK_N))
    b = bias if bias is not None else y  # never read without HAS_BIAS
    flags = dict(
        HAS_BIAS=bias is not None,
        UPCAST=INTERPRETED and x.dtype != torch.float32,
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        num_warps=4,
        num_stages=3,
    )
    if fmt == "int8":
        _int8_kernel[grid](x, codes, scale, b, y, t, n, k, groups, group, **flags)
    else:
        assert zero is not None and group % 32 == 0
        _int4_kernel[grid](x, codes, scale, zero, b, y, t, n, k, groups, group // 32, **flags)
    return y
