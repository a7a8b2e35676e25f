"""y = x @ dequant(W).T for a few rows of x, W int8 or int4 as stored (Triton): the device's
MoE experts in cold_weights.expert_format int8 / int4 (experts/format.py).

An expert at decode sees one or a few tokens, so its time is the weight's bytes over the
memory bandwidth. Dequantizing the whole matrix to the model dtype first (torch ops) writes
and re-reads it several times over, about 40x the stored bytes for int4; these kernels read
the codes, scales and zeros once and dequantize in registers.

Layouts (expert_format.PackedMatrices):
    int8  q int8 [N, K], s fp32 [N]: w[n, k] = q[n, k] * s[n]
    int4  q uint8 [N, K / 2] in torch's CPU int4 layout (int4_layout.py): rows in blocks
          of R (64 on AVX-512 hosts, 32 on AVX2), block b a contiguous [K, R / 2] bytes,
          byte (k, j) = row R b + j's code (low nibble) and row R b + R / 2 + j's (high
          nibble); sz [K / GROUP, N, 2] (scale, zero) in the model dtype:
          w[n, k] = (code - 8) * scale + zero

int8: grid (cdiv(N, BLOCK_N), T), each program BLOCK_N rows of one row of x, streamed along K.
int4: grid (N / R, T, SPLIT), each program one block of R rows over a 1 / SPLIT share of K,
a contiguous run of bytes; narrow outputs (down_proj: 64 blocks for N = 4096) split K so that
every SM has work, and the SPLIT fp32 partials are summed after. Scales and zeros are loaded
once per group and broadcast in registers (a per-weight gather would issue GROUP times the
loads). The order of the fp32 additions depends only on the tiles, so results are
deterministic. Rows of x past MAX_ROWS would re-read the weight once per row; the caller
dequantizes instead (expert_format.PackedMatrices.linear).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from hybridgen.kernels import int4_layout
from hybridgen.kernels.triton_gemv import row_dots

MAX_ROWS = 16
"""Rows of x up to which the fused kernels beat dequantize-then-matmul."""
BLOCK_N = 16
BLOCK_K = 256
"""int8: inputs per K tile ([BLOCK_N, BLOCK_K] codes, as triton_gemv's tuned tiles)."""


@dataclass(frozen=True)
class Int4Config:
    """Tiles and launch shape of one int4 launch; `splits` None picks by `int4_splits`. The
    default is bench/quant_gemv_bench.py's best on the H200 for one mixtral-8x7b expert at
    one token (a [256, 32]-byte run per K tile, 4 warps, 2 stages): 134 us against 182 for
    the [128, 32] over 8 warps first chosen (bench/results/quant_gemv_h200.json, 32228df)."""

    block_k: int = 256
    num_warps: int = 4
    num_stages: int = 2
    splits: int | None = None


@triton.jit
def _int8_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    y_ptr,
    N,
    K,
    stride_x,
    stride_q,
    stride_y,
    EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    t = tl.program_id(1).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    rows_safe = tl.where(row_ok, rows, 0).to(tl.int64)  # out-of-range rows re-read row 0
    dots = row_dots(x_ptr + t * stride_x, q_ptr, rows_safe, stride_q, K, EVEN_K, BLOCK_N, BLOCK_K)
    y = dots * tl.load(s_ptr + rows_safe).to(tl.float32)
    tl.store(y_ptr + t * stride_y + rows, y.to(y_ptr.dtype.element_ty), mask=row_ok)


@triton.jit
def _int4_kernel(
    x_ptr,
    q_ptr,
    sz_ptr,
    part_ptr,
    N,
    K,
    K_SPLIT,
    stride_x,
    GROUP: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # part: [SPLIT, T, N], fp32 partials (or, with one split, y itself). K_SPLIT (a multiple
    # of BLOCK_K) inputs per split; HALF = R / 2.
    nb = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)  # int32 loop bounds; the pointers use int64 nb and t
    row_lo = nb * 2 * HALF + tl.arange(0, HALF)
    k_start = split * K_SPLIT
    lo, hi = int4_block_dots(
        x_ptr + t * stride_x,
        q_ptr + nb * K * HALF,
        sz_ptr,
        row_lo,
        N,
        K,
        k_start,
        tl.minimum(k_start + K_SPLIT, K),
        GROUP,
        HALF,
        BLOCK_K,
    )
    out = part_ptr + (split * tl.num_programs(1) + t) * N + row_lo
    tl.store(out, lo.to(part_ptr.dtype.element_ty))
    tl.store(out + HALF, hi.to(part_ptr.dtype.element_ty))


@triton.jit
def int4_block_dots(
    x_ptr,
    block,
    sz_ptr,
    row_lo,
    N,
    K,
    k_start,
    k_end,
    GROUP: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # -> two [HALF] fp32: rows row_lo and row_lo + HALF (one block of 2 HALF rows, its
    # [K, HALF] bytes at `block`; sz [K / GROUP, N, 2] at sz_ptr) dotted with x [K] over
    # inputs k_start..k_end (a multiple of BLOCK_K from 0). The grouped expert kernels take
    # the same loop.
    NG: tl.constexpr = BLOCK_K // GROUP
    j = tl.arange(0, HALF)
    kk = tl.arange(0, BLOCK_K)
    gg = tl.arange(0, NG)
    acc_lo = tl.zeros((BLOCK_K, HALF), dtype=tl.float32)
    acc_hi = tl.zeros((BLOCK_K, HALF), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        k = k0 + kk
        k_ok = k < K
        packed = tl.load(
            block + k[:, None] * HALF + j[None, :],
            mask=k_ok[:, None],
            other=136,
            eviction_policy="evict_first",
        )
        x = tl.load(x_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
        g = k0 // GROUP + gg
        g_ok = g < K // GROUP
        sz = sz_ptr + (g[:, None] * N + row_lo[None, :]) * 2  # [NG, HALF], the low rows
        s_lo = tl.load(sz, mask=g_ok[:, None], other=0.0).to(tl.float32)
        z_lo = tl.load(sz + 1, mask=g_ok[:, None], other=0.0).to(tl.float32)
        s_hi = tl.load(sz + 2 * HALF, mask=g_ok[:, None], other=0.0).to(tl.float32)
        z_hi = tl.load(sz + 2 * HALF + 1, mask=g_ok[:, None], other=0.0).to(tl.float32)
        w_lo = ((packed & 15).to(tl.float32) - 8.0) * _per_group(s_lo, NG, GROUP, HALF)
        w_hi = ((packed >> 4).to(tl.float32) - 8.0) * _per_group(s_hi, NG, GROUP, HALF)
        acc_lo += (w_lo + _per_group(z_lo, NG, GROUP, HALF)) * x[:, None]
        acc_hi += (w_hi + _per_group(z_hi, NG, GROUP, HALF)) * x[:, None]
    return tl.sum(acc_lo, axis=0), tl.sum(acc_hi, axis=0)


@triton.jit
def _per_group(m, NG: tl.constexpr, GROUP: tl.constexpr, HALF: tl.constexpr):
    # [NG, HALF] -> [NG * GROUP, HALF]: each group's row repeated over its GROUP inputs.
    return tl.reshape(tl.broadcast_to(m[:, None, :], (NG, GROUP, HALF)), (NG * GROUP, HALF))


def int8_linear(x: Tensor, q: Tensor, s: Tensor) -> Tensor:
    """x [T, K] (T <= MAX_ROWS), q int8 [N, K], s [N] -> [T, N] in x.dtype, fp32 sums."""
    n, k = q.shape
    t = x.shape[0]
    assert x.shape == (t, k) and t <= MAX_ROWS and q.stride(-1) == 1 and s.shape == (n,)
    x = x if x.stride(-1) == 1 else x.contiguous()
    y = torch.empty(t, n, dtype=x.dtype, device=x.device)
    _int8_kernel[(triton.cdiv(n, BLOCK_N), t)](
        x,
        q,
        s,
        y,
        n,
        k,
        x.stride(0),
        q.stride(0),
        y.stride(0),
        EVEN_K=k % BLOCK_K == 0,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        num_warps=4,
    )
    return y


def int4_splits(n: int, k: int, block_k: int = Int4Config.block_k, rows: int = 64) -> int:
    """K splits for an [n, k] int4 matrix in blocks of `rows`. One with fewer blocks than two
    per SM of the H200's 132 is split so that some 512 programs run: down_proj (n = 4096, 64
    blocks of 64) in 8, 44 us against 54 in 5 and 119 unsplit at one token
    (bench/quant_gemv_bench.py); gate_up's 448 blocks stay whole (81 us, 86 in 2). Never a
    split shorter than 4 tiles."""
    blocks = n // rows
    if blocks >= 264:
        return 1
    return max(1, min(-(-512 // blocks), k // (4 * block_k)))


def int4_linear(
    x: Tensor,
    q: Tensor,
    sz: Tensor,
    group: int,
    config: Int4Config | None = None,
    row_block: int | None = None,
) -> Tensor:
    """x [T, K] (T <= MAX_ROWS), q uint8 [N, K / 2] and sz [K / group, N, 2] in the int4 layout
    with rows in blocks of `row_block` (None: this machine's, int4_layout.row_block) -> [T, N]
    in x.dtype, fp32 sums. `config` overrides the default tiles."""
    cfg = config or Int4Config()
    rows = row_block or int4_layout.row_block()
    n, half = q.shape
    t, k = x.shape
    assert k == 2 * half and k % group == 0 and n % rows == 0 and cfg.block_k % group == 0
    assert sz.shape == (k // group, n, 2) and t <= MAX_ROWS and q.is_contiguous()
    assert sz.is_contiguous()
    x = x if x.stride(-1) == 1 else x.contiguous()
    splits = cfg.splits or int4_splits(n, k, cfg.block_k, rows)
    k_split = triton.cdiv(triton.cdiv(k, splits), cfg.block_k) * cfg.block_k
    # One split writes y directly; more leave fp32 partials to sum (two more launches).
    parts = torch.empty(
        splits, t, n, dtype=x.dtype if splits == 1 else torch.float32, device=x.device
    )
    _int4_kernel[(n // rows, t, splits)](
        x,
        q,
        sz,
        parts,
        n,
        k,
        k_split,
        x.stride(0),
        GROUP=group,
        HALF=rows // 2,
        BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return parts[0] if splits == 1 else parts.sum(0).to(x.dtype)


DEQUANT_BLOCK_K = 64
"""int4_dequantize: inputs per program (with a row block's R / 2 bytes each)."""


@triton.jit
def _int4_dequant_kernel(
    q_ptr, sz_ptr, w_ptr, N, K, GROUP: tl.constexpr, HALF: tl.constexpr, BLOCK_K: tl.constexpr
):
    b = tl.program_id(0)  # the row block: rows HALF * 2 * b + j (low) and + HALF (high)
    ks = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    js = tl.arange(0, HALF)
    ok = (ks < K)[:, None]
    codes = tl.load(q_ptr + b * K * HALF + ks[:, None] * HALF + js[None, :], mask=ok, other=0)
    codes = codes.to(tl.int32)
    groups = (ks // GROUP)[:, None]
    for h in tl.static_range(2):
        rows = (b * 2 + h) * HALF + js[None, :]
        code = ((codes >> (4 * h)) & 15).to(tl.float32) - 8.0
        at = sz_ptr + (groups * N + rows) * 2
        scale = tl.load(at, mask=ok, other=0.0).to(tl.float32)
        zero = tl.load(at + 1, mask=ok, other=0.0).to(tl.float32)
        w = code * scale + zero
        tl.store(w_ptr + rows * K + ks[:, None], w.to(w_ptr.dtype.element_ty), mask=ok)


def int4_dequantize(
    q: Tensor, sz: Tensor, group: int, dtype: torch.dtype, row_block: int | None = None
) -> Tensor:
    """q uint8 [N, K / 2] and sz [K / group, N, 2] in the int4 layout (rows in blocks of
    `row_block`, None: this machine's) -> the matrix [N, K] in `dtype`, in one launch that
    reads the codes once and writes each weight once: (code - 8) * scale + zero in fp32, as
    expert_format dequantizes with torch ops (some ten launches and fp32 temporaries of four
    bytes a weight, for the rows past MAX_ROWS: a prefill's experts)."""
    rows = row_block or int4_layout.row_block()
    n, half = q.shape
    k = 2 * half
    assert n % rows == 0 and k % group == 0 and sz.shape == (k // group, n, 2)
    assert q.is_contiguous() and sz.is_contiguous()
    w = torch.empty(n, k, dtype=dtype, device=q.device)
    grid = (n // rows, triton.cdiv(k, DEQUANT_BLOCK_K))
    _int4_dequant_kernel[grid](
        q, sz, w, n, k, GROUP=group, HALF=rows // 2, BLOCK_K=DEQUANT_BLOCK_K, num_warps=4
    )
    return w
