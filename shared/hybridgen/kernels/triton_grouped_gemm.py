"""A layer's device-cached int4 experts with many rows each in one tensor-core launch per
matrix (Triton): the MoE block on a prompt's step, where each expert of a layer sees some
tens to hundreds of tokens (qwen3-30b-a3b: 256 tokens x top-8 over 128 experts, ~16 each).

triton_grouped_experts' kernels read an expert's weights once per row (a GEMV per pair);
past triton_quant_gemv.MAX_ROWS rows an expert was dequantized to the model dtype on its own
and multiplied by torch (~10 launches an expert, ~60,000 a qwen3 prompt step). Here the rows
are laid out expert by expert in blocks of BLOCK_M (each block one cache slot, the last
block of an expert padded with -1), and each program multiplies one block of rows by one
block of R weight rows: it reads the R rows' codes once per BLOCK_K inputs, dequantizes them
in registers exactly as triton_quant_gemv.int4_dequantize does ((code - 8) * scale + zero in
fp32, cast to x's dtype), and accumulates tl.dot in fp32.

Per padded position i: `rows[i]` is the row of x it reads (-1: zeros), `outs[i]` the row of
y it writes (-1: nothing), `block_slots[i // BLOCK_M]` its cache slot. SwiGLU in between is
triton_activation's; the gate_up launch writes positions in order, the down launch reads them
in order and scatters into the step's output table.
Layouts: experts/format.py (int4 q [S, N, K / 2] in int4_layout's row blocks of R, sz [S, K /
GROUP, N, 2]).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from hybridgen.kernels import int4_layout, triton_activation
from hybridgen.kernels.triton_dense_quant import INTERPRETED

BLOCK_MS = (16, 32, 64)
"""The row blocks a launch may use; `block_m` picks by the rows an expert has on average."""


def block_m(rows: int, experts: int) -> int:
    """The row block for `rows` (token, expert) pairs over `experts` experts: the smallest of
    BLOCK_MS at least their average, so that padding stays under half a block an expert."""
    mean = rows / max(experts, 1)
    return next((m for m in BLOCK_MS if m >= mean), BLOCK_MS[-1])


@triton.jit(do_not_specialize_on_alignment=["rows_ptr", "outs_ptr", "block_slot_ptr"])
def _int4_grouped_gemm_kernel(
    x_ptr,
    rows_ptr,
    outs_ptr,
    block_slot_ptr,
    q_ptr,
    sz_ptr,
    y_ptr,
    N,
    K,
    stride_x,
    stride_y,
    GROUP: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
):
    m = tl.program_id(0)  # a block of BLOCK_M positions, all of one slot
    b = tl.program_id(1)  # a block of 2 HALF weight rows: 2 HALF b + j (low), + HALF (high)
    slot = tl.load(block_slot_ptr + m).to(tl.int64)
    ms = m * BLOCK_M + tl.arange(0, BLOCK_M)
    xr = tl.load(rows_ptr + ms)
    x_ok = (xr >= 0)[:, None]
    js = tl.arange(0, HALF)
    kk = tl.arange(0, BLOCK_K)
    block = q_ptr + slot * N * (K // 2) + b * K * HALF
    sz_slot = sz_ptr + slot * (K // GROUP) * N * 2
    row_lo = 2 * b * HALF + js
    acc_lo = tl.zeros((BLOCK_M, HALF), dtype=tl.float32)
    acc_hi = tl.zeros((BLOCK_M, HALF), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + kk
        xt = tl.load(x_ptr + xr[:, None].to(tl.int64) * stride_x + k[None, :], mask=x_ok, other=0.0)
        codes = tl.load(block + k[:, None] * HALF + js[None, :]).to(tl.int32)  # [BLOCK_K, HALF]
        at = sz_slot + ((k0 // GROUP) * N + row_lo) * 2  # BLOCK_K == GROUP: one group a tile
        s_lo = tl.load(at).to(tl.float32)
        z_lo = tl.load(at + 1).to(tl.float32)
        s_hi = tl.load(at + 2 * HALF).to(tl.float32)
        z_hi = tl.load(at + 2 * HALF + 1).to(tl.float32)
        w_lo = ((codes & 15).to(tl.float32) - 8.0) * s_lo[None, :] + z_lo[None, :]
        w_hi = ((codes >> 4).to(tl.float32) - 8.0) * s_hi[None, :] + z_hi[None, :]
        acc_lo += _dot(xt, w_lo.to(x_ptr.dtype.element_ty), UPCAST)
        acc_hi += _dot(xt, w_hi.to(x_ptr.dtype.element_ty), UPCAST)
    out = tl.load(outs_ptr + ms)
    at_y = y_ptr + out[:, None].to(tl.int64) * stride_y + row_lo[None, :]
    y_ok = (out >= 0)[:, None]
    tl.store(at_y, acc_lo.to(y_ptr.dtype.element_ty), mask=y_ok)
    tl.store(at_y + HALF, acc_hi.to(y_ptr.dtype.element_ty), mask=y_ok)


@triton.jit
def _dot(x, w, UPCAST: tl.constexpr):
    # x [M, BK] @ w [BK, N] in fp32 (ieee: no tf32 for fp32 inputs). UPCAST: as fp32 (the
    # same rounded inputs), for Triton's CPU interpreter, whose bf16 tl.dot returns garbage.
    if UPCAST:
        return tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
    return tl.dot(x, w, input_precision="ieee")


def int4_grouped_gemm(
    x: Tensor,
    rows: Tensor,
    outs: Tensor,
    block_slots: Tensor,
    parts: dict[str, Tensor],
    group: int,
    y: Tensor,
    row_block: int | None = None,
) -> Tensor:
    """For each padded position i with rows[i] >= 0 and outs[i] >= 0: y[outs[i]] = x[rows[i]]
    @ the int4 matrix of slot block_slots[i // BLOCK_M]^T (BLOCK_M = len(rows) /
    len(block_slots)), fp32 sums, in y (returned). `parts`: an ExpertCache stack's int4
    tensors (q, sz), its rows in blocks of `row_block` (None: this machine's); rows, outs and
    block_slots int32 on x's device."""
    q, sz = parts["q"], parts["sz"]
    _, n, half = q.shape
    k = 2 * half
    block = row_block or int4_layout.row_block()
    positions, blocks = rows.shape[0], block_slots.shape[0]
    bm = positions // max(blocks, 1)
    assert bm in BLOCK_MS and positions == bm * blocks and outs.shape == rows.shape
    assert q.is_contiguous() and sz.is_contiguous() and x.shape[1] == k and n % block == 0
    assert sz.shape[1:] == (k // group, n, 2) and k % group == 0 and y.shape[1] == n
    assert y.stride(-1) == 1
    x = x if x.stride(-1) == 1 else x.contiguous()
    if blocks == 0:
        return y
    _int4_grouped_gemm_kernel[(blocks, n // block)](
        x,
        rows,
        outs,
        block_slots,
        q,
        sz,
        y,
        n,
        k,
        x.stride(0),
        y.stride(0),
        GROUP=group,
        HALF=block // 2,
        BLOCK_M=bm,
        BLOCK_K=group,
        UPCAST=INTERPRETED and x.dtype != torch.float32,
        num_warps=4,
        num_stages=3,
    )
    return y


def int4_grouped_swiglu(
    x: Tensor,
    rows: Tensor,
    outs: Tensor,
    block_slots: Tensor,
    gate_up: dict[str, Tensor],
    down: dict[str, Tensor],
    group: int,
    y: Tensor,
) -> Tensor:
    """Each used position's expert MLP (models.llama.MLP's math): x[rows[i]] through its
    block's slot's gate_up and down, into y[outs[i]] (returned); the rest of y untouched."""
    positions = rows.shape[0]
    inter2 = gate_up["q"].shape[1]
    h = torch.empty(positions, inter2, dtype=x.dtype, device=x.device)
    order = torch.arange(positions, dtype=torch.int32, device=x.device)
    int4_grouped_gemm(x, rows, order, block_slots, gate_up, group, h)
    act = triton_activation.silu_and_mul(h)  # [positions, I]
    return int4_grouped_gemm(act, order, outs, block_slots, down, group, y)
