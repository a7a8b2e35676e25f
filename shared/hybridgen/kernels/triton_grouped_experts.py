"""A layer's device-cached int8 / int4 experts in one launch per matrix (Triton): the MoE
block at decode, where a step of one token routes k experts (qwen3-30b-a3b: 8 of 128 in
each of 48 layers) and one call per expert per matrix costs far more in launches and host
bookkeeping than its weights take to read.

The work is a list of pairs (row of x, cache slot, row of the output table): every pair's
gate_up in one launch (grid: output blocks x pairs [x K splits]), each program reading its
pair's slot from the cache tensors in place, then SiLU-and-mul over all pairs in one, then
every pair's down in one, its result in its row of the output table Y [T * k, H]. Row
t * k + j of Y is token t's j-th expert in ascending id; `weighted_sum` then adds each
token's k rows up in that order, each weighted and cast to the model dtype before it is
added, as models/moe.py's combine (and HF) does. Pairs of one slot re-read its weights per
row, as triton_quant_gemv's kernels do for the rows of one expert (the second read mostly
hits L2).

Per pair the arithmetic is triton_quant_gemv's (the same loops, tiles and K splits), so a
pair's output is the per-expert path's for that row up to the split partials' summation.
Layouts: experts/format.py (int8 q [S, N, K], s [S, N]; int4 q [S, N, K / 2], sz
[S, K / GROUP, N, 2]).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from hybridgen.kernels import int4_layout, triton_activation
from hybridgen.kernels.triton_gemv import row_dots
from hybridgen.kernels.triton_quant_gemv import (
    BLOCK_K,
    BLOCK_N,
    Int4Config,
    int4_block_dots,
    int4_splits,
)

SUM_BLOCK = 1024
"""Hidden values per program of weighted_sum."""


@triton.jit(do_not_specialize_on_alignment=["in_ptr", "slot_ptr"])
def _int8_grouped_kernel(
    x_ptr,
    in_ptr,
    slot_ptr,
    q_ptr,
    s_ptr,
    y_ptr,
    N,
    K,
    stride_x,
    stride_qs,
    stride_q,
    stride_y,
    GATHER: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # Grid (cdiv(N, BLOCK_N), P): pair p's rows of x row in[p] (row p without GATHER) @
    # slot[p]'s [N, K] -> y[p].
    p = tl.program_id(1).to(tl.int64)
    row = tl.load(in_ptr + p).to(tl.int64) if GATHER else p
    slot = tl.load(slot_ptr + p).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    rows_safe = tl.where(row_ok, rows, 0).to(tl.int64)
    dots = row_dots(
        x_ptr + row * stride_x,
        q_ptr + slot * stride_qs,
        rows_safe,
        stride_q,
        K,
        EVEN_K,
        BLOCK_N,
        BLOCK_K,
    )
    y = dots * tl.load(s_ptr + slot * N + rows_safe).to(tl.float32)
    tl.store(y_ptr + p * stride_y + rows, y.to(y_ptr.dtype.element_ty), mask=row_ok)


@triton.jit(do_not_specialize_on_alignment=["in_ptr", "slot_ptr"])
def _int4_grouped_kernel(
    x_ptr,
    in_ptr,
    slot_ptr,
    q_ptr,
    sz_ptr,
    part_ptr,
    N,
    K,
    K_SPLIT,
    stride_x,
    GATHER: tl.constexpr,
    GROUP: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # Grid (N / R, P, SPLIT), R = 2 HALF rows a block: part [SPLIT, P, N] (y itself with one
    # split); x row in[p] (row p without GATHER).
    nb = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    row = tl.load(in_ptr + p).to(tl.int64) if GATHER else p
    slot = tl.load(slot_ptr + p).to(tl.int64)
    row_lo = nb * 2 * HALF + tl.arange(0, HALF)
    k_start = split * K_SPLIT
    block = q_ptr + slot * N * (K // 2) + nb * K * HALF
    lo, hi = int4_block_dots(
        x_ptr + row * stride_x,
        block,
        sz_ptr + slot * K * N * 2 // GROUP,
        row_lo,
        N,
        K,
        k_start,
        tl.minimum(k_start + K_SPLIT, K),
        GROUP,
        HALF,
        BLOCK_K,
    )
    out = part_ptr + (split * tl.num_programs(1) + p) * N + row_lo
    tl.store(out, lo.to(part_ptr.dtype.element_ty))
    tl.store(out + HALF, hi.to(part_ptr.dtype.element_ty))


@triton.jit(do_not_specialize_on_alignment=["widx_ptr", "w_ptr"])
def _weighted_sum_kernel(
    y_ptr, w_ptr, widx_ptr, out_ptr, H, TOP_K: tl.constexpr, BLOCK: tl.constexpr
):
    # Grid (T, cdiv(H, BLOCK)): out[t] = sum over j < TOP_K, in order, of
    # (Y[t * TOP_K + j] * w[widx[t * TOP_K + j]]) cast to the model dtype before each add.
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < H
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        r = t * TOP_K + j
        w = tl.load(w_ptr + tl.load(widx_ptr + r)).to(tl.float32)
        y = tl.load(y_ptr + r * H + cols, mask=ok, other=0.0).to(tl.float32)
        term = (y * w).to(out_ptr.dtype.element_ty).to(tl.float32)
        acc = (acc + term).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + t * H + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)


def grouped_linear(
    x: Tensor,
    fmt: str,
    parts: dict[str, Tensor],
    rows: Tensor | None,
    slots: Tensor,
    group: int,
    row_block: int | None = None,
) -> Tensor:
    """For each pair p: x[rows[p]] [K] (x[p] when rows is None) @ slot slots[p]'s matrix^T ->
    [P, N] in x.dtype, fp32 sums; `parts` are an ExpertCache stack's tensors (int8 q, s or
    int4 q, sz, its rows in blocks of `row_block`, None: this machine's), rows and slots
    int32 [P] on x's device."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    pairs = slots.shape[0]
    gather = rows is not None
    rows = rows if rows is not None else slots  # not read without GATHER
    if fmt == "int8":
        q, s = parts["q"], parts["s"]
        _, n, k = q.shape
        assert q.is_contiguous() and s.is_contiguous() and x.shape[1] == k
        y = torch.empty(pairs, n, dtype=x.dtype, device=x.device)
        _int8_grouped_kernel[(triton.cdiv(n, BLOCK_N), pairs)](
            x,
            rows,
            slots,
            q,
            s,
            y,
            n,
            k,
            x.stride(0),
            q.stride(0),
            q.stride(1),
            y.stride(0),
            GATHER=gather,
            EVEN_K=k % BLOCK_K == 0,
            BLOCK_N=BLOCK_N,
            BLOCK_K=BLOCK_K,
            num_warps=4,
        )
        return y
    q, sz = parts["q"], parts["sz"]
    _, n, half = q.shape
    k = 2 * half
    cfg, block = Int4Config(), row_block or int4_layout.row_block()
    assert q.is_contiguous() and sz.is_contiguous() and x.shape[1] == k and n % block == 0
    assert sz.shape[1:] == (k // group, n, 2) and cfg.block_k % group == 0
    splits = int4_splits(n, k, cfg.block_k, block)
    k_split = triton.cdiv(triton.cdiv(k, splits), cfg.block_k) * cfg.block_k
    part = torch.empty(
        splits, pairs, n, dtype=x.dtype if splits == 1 else torch.float32, device=x.device
    )
    _int4_grouped_kernel[(n // block, pairs, splits)](
        x,
        rows,
        slots,
        q,
        sz,
        part,
        n,
        k,
        k_split,
        x.stride(0),
        GATHER=gather,
        GROUP=group,
        HALF=block // 2,
        BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return part[0] if splits == 1 else part.sum(0).to(x.dtype)


def grouped_swiglu(
    x: Tensor,
    fmt: str,
    gate_up: dict[str, Tensor],
    down: dict[str, Tensor],
    rows: Tensor,
    slots: Tensor,
    group: int,
) -> Tensor:
    """Each pair's expert MLP (models.llama.MLP's math): x[rows[p]] through slot slots[p]'s
    gate_up and down -> [P, H] in x.dtype."""
    h = grouped_linear(x, fmt, gate_up, rows, slots, group)  # [P, 2I]
    act = triton_activation.silu_and_mul(h)  # [P, I]
    return grouped_linear(act, fmt, down, None, slots, group)


def weighted_sum(y: Tensor, weights: Tensor, widx: Tensor, top_k: int) -> Tensor:
    """y [T * top_k, H] (token t's experts in rows t * top_k.., ascending id), weights [T, k]
    (route()'s), widx int32 [T * top_k]: each row's flat index into weights -> [T, H] in
    y.dtype, each term cast to it before it is added, in row order."""
    t, h = y.shape[0] // top_k, y.shape[1]
    assert y.is_contiguous() and weights.is_contiguous() and widx.shape == (t * top_k,)
    out = torch.empty(t, h, dtype=y.dtype, device=y.device)
    block = min(triton.next_power_of_2(h), SUM_BLOCK)
    _weighted_sum_kernel[(t, triton.cdiv(h, block))](
        y, weights, widx, out, h, TOP_K=top_k, BLOCK=block, num_warps=4
    )
    return out
