"""Device dispatch for the model's hot ops.

Each op runs its Triton kernel when the input lives on CUDA and Triton imports, else the torch
reference (the CPU production path). The partial merge is torch on every device. Note the one
aliasing difference: on CUDA, add_rms_norm writes residual_out into the `residual` buffer; on
the CPU it allocates. Callers must treat `residual` as consumed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeAlias

import torch
import torch.nn.functional as F
from torch import Tensor

from hybridgen.kernels import reference
from hybridgen.kernels.kv_quant import QuantKvCache
from hybridgen.kernels.reference import merge_attention_partials, paged_prefill_attention
from hybridgen.kernels.rope_write import RopeWrite

try:
    from hybridgen.kernels import (
        triton_activation,
        triton_dense_quant,
        triton_gemv,
        triton_grouped_experts,
        triton_grouped_gemm,
        triton_norm,
        triton_paged_decode,
        triton_paged_prefill,
        triton_quant_gemv,
        triton_rope_cache,
    )

    HAS_TRITON = True
except ImportError:  # CPU-only installs ship without triton
    HAS_TRITON = False

if TYPE_CHECKING:
    from hybridgen.models.dense_quant import QuantWeight

__all__ = [
    "HAS_TRITON",
    "KvCache",
    "RopeWrite",
    "add_rms_norm",
    "decode_attention",
    "expert_weighted_sum",
    "grouped_expert_gemm_swiglu",
    "grouped_expert_swiglu",
    "grouped_expert_takes",
    "grouped_experts_usable",
    "grouped_gemm_block_m",
    "linear",
    "merge_attention_partials",
    "paged_decode_attention",
    "paged_prefill_attention",
    "prefill_attention",
    "quant_dense_linear",
    "quant_int4_linear",
    "quant_int8_linear",
    "rope_and_cache",
    "silu_and_mul",
    "write_kv",
]

KvCache: TypeAlias = tuple[Tensor, Tensor] | QuantKvCache
"""One layer's Hot-KV: native (k_cache, v_cache) [N, S, Hkv, D], or int8/int4 (kv_quant)."""


def _use_triton(t: Tensor) -> bool:
    return HAS_TRITON and t.is_cuda


USE_GEMV = True
"""One-row projections on CUDA take the Triton GEMV (False: cuBLAS for every shape; for
benchmarks that compare the two)."""


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    # x: [T, K]; weight: [N, K]; bias: [N] -> [T, N]
    if USE_GEMV and x.shape[0] == 1 and _use_triton(x):
        return triton_gemv.gemv(x, weight, bias)
    return F.linear(x, weight, bias)


def _quant_fused(x: Tensor) -> bool:
    return _use_triton(x) and x.shape[0] <= triton_quant_gemv.MAX_ROWS


def quant_int8_linear(x: Tensor, q: Tensor, s: Tensor) -> Tensor | None:
    """x [T, K] @ (q * s).T for int8 experts as stored (experts/format.py) by the fused
    Triton kernel, on CUDA for up to triton_quant_gemv.MAX_ROWS rows; else None, and the
    caller dequantizes and multiplies."""
    return triton_quant_gemv.int8_linear(x, q, s) if _quant_fused(x) else None


def quant_int4_linear(x: Tensor, q: Tensor, sz: Tensor, group: int) -> Tensor | None:
    """The same for int4 experts in expert_format's layout (codes q, scales and zeros sz)."""
    return triton_quant_gemv.int4_linear(x, q, sz, group) if _quant_fused(x) else None


def int4_matrix(q: Tensor, sz: Tensor, group: int, dtype: torch.dtype) -> Tensor:
    """An int4 expert matrix in expert_format's layout (codes q [N, K / 2], scales and zeros
    sz), dequantized to `dtype` [N, K]: one Triton launch on CUDA, torch's ops elsewhere."""
    if _use_triton(q):
        return triton_quant_gemv.int4_dequantize(q, sz, group, dtype)
    return reference.int4_dequantize(q, sz, group, dtype)


GROUPED_EXPERTS = True
"""A layer's device-cached int8 / int4 experts at decode run in one launch per matrix on CUDA
(False: one call per expert; for benchmarks that compare the two)."""


GROUPED_STEP_ROWS = 64
"""Most rows of an int8 step whose experts go through grouped_expert_swiglu. Its experts of
up to triton_quant_gemv.MAX_ROWS rows each join the launch (the per-expert kernels' range:
they too read an expert's weights once a row), those with more dequantize and multiply on
their own. A prompt's chunk beside decodes was past MAX_ROWS as a whole, so every expert of a
step with 16 prompt tokens ran alone, ~10 launches each (qwen3-30b-a3b: ~80 experts in each
of 48 layers); past 64 rows the host's grouping of T x k pairs (pack_step, in loops then)
cost more than the launches it saved, and few experts have so few rows. int4 steps have no
such limit: their experts with more rows go through grouped_expert_gemm_swiglu, one launch a
matrix."""


def grouped_experts_usable(x: Tensor, fmt: str) -> bool:
    """Whether the experts of a step on x [T, H], stored in `fmt`, go through the grouped
    launches (which take which: grouped_expert_takes): int8 / int4 on CUDA, int8 for up to
    GROUPED_STEP_ROWS rows."""
    return (
        GROUPED_EXPERTS
        and fmt in ("int8", "int4")
        and _use_triton(x)
        and (fmt == "int4" or x.shape[0] <= GROUPED_STEP_ROWS)
    )


GEMM_MAX_ROWS = 64
"""Most rows of an int4 expert that the grouped GEMM takes; one with more is dequantized and
multiplied by cuBLAS on its own. H200 at 08336d0 (bench/grouped_experts_bench.py
--prefill-only), one layer's block: qwen3-30b-a3b at T=256 (~16 rows an expert) 36.4 ms
per expert -> 4.7 ms grouped; mixtral-8x7b at T=1024 (~256 rows an expert) 4.1 ms per expert
-> 7.7 ms grouped, where cuBLAS's tiles beat the GEMM's [64, 2 x 32] ones."""


def grouped_expert_takes(tokens: int, fmt: str) -> str | None:
    """Which grouped launch an expert with `tokens` routed rows runs in: "gemv" for up to
    triton_quant_gemv.MAX_ROWS, "gemm" for up to GEMM_MAX_ROWS in int4 (triton_grouped_gemm),
    None: on its own (dequantized)."""
    if tokens <= triton_quant_gemv.MAX_ROWS:
        return "gemv"
    return "gemm" if fmt == "int4" and tokens <= GEMM_MAX_ROWS else None


def grouped_gemm_block_m(rows: int, experts: int) -> int:
    """The grouped GEMM's row block for `rows` (token, expert) pairs over `experts` experts."""
    return triton_grouped_gemm.block_m(rows, experts)


def grouped_expert_gemm_swiglu(
    x: Tensor,
    gate_up: dict[str, Tensor],
    down: dict[str, Tensor],
    layout: tuple[Tensor, Tensor, Tensor],
    group: int,
    y: Tensor,
) -> Tensor:
    """int4 experts with many rows each: layout (rows, outs, block_slots) as
    triton_grouped_gemm lays them out; each used position's expert MLP of x[rows[i]] into
    y[outs[i]] (returned)."""
    return triton_grouped_gemm.int4_grouped_swiglu(x, *layout, gate_up, down, group, y)


def grouped_expert_swiglu(
    x: Tensor,
    fmt: str,
    gate_up: dict[str, Tensor],
    down: dict[str, Tensor],
    rows: Tensor,
    slots: Tensor,
    group: int,
) -> Tensor:
    """Expert slot slots[p] of the device cache (its gate_up and down tensors) on x[rows[p]],
    for every pair p -> [P, H] (triton_grouped_experts; where grouped_experts_usable)."""
    return triton_grouped_experts.grouped_swiglu(x, fmt, gate_up, down, rows, slots, group)


def expert_weighted_sum(y: Tensor, weights: Tensor, widx: Tensor, top_k: int) -> Tensor:
    """Each token's top_k expert outputs (rows of y, ascending id), weighted and summed in the
    MoE block's order (triton_grouped_experts.weighted_sum)."""
    return triton_grouped_experts.weighted_sum(y, weights, widx, top_k)


def quant_dense_linear(
    x: Tensor,
    w: QuantWeight,
    bias: Tensor | None = None,
    tiles: triton_dense_quant.Tiles | None = None,
    swiglu: bool = False,
    rope: RopeWrite | None = None,
) -> Tensor:
    """x [T, K] @ dequant(w).T (+ bias) for a dense layer's int8 / int4 weight: the fused
    Triton kernel on CUDA (`tiles`: its tiles, else the kernels' default), else dequantize to
    x's dtype and multiply (the CPU path). `swiglu`: w is a fused [gate | up] projection and
    the result silu(gate) * up; `rope`: w is a fused qkv and the result q (RopeWrite)."""
    if _use_triton(x):
        return triton_dense_quant.quant_linear(
            x, w.fmt, w.codes, w.scale, w.zero, w.group, bias, tiles, swiglu, rope
        )
    y = F.linear(x, w.dequantize(x.dtype), bias)
    if swiglu:
        return reference.silu_and_mul(y)
    if rope is None:
        return y
    return rope.after(y, reference.rope_and_cache)


def add_rms_norm(
    x: Tensor, residual: Tensor | None, weight: Tensor, eps: float
) -> tuple[Tensor, Tensor]:
    # x, residual: [T, H]; weight: [H] -> (out [T, H], residual_out [T, H])
    if _use_triton(x):
        return triton_norm.add_rms_norm(x, residual, weight, eps)
    return reference.add_rms_norm(x, residual, weight, eps)


def silu_and_mul(x: Tensor) -> Tensor:
    # x: [T, 2I] -> [T, I]
    if _use_triton(x):
        return triton_activation.silu_and_mul(x)
    return reference.silu_and_mul(x)


def rope_and_cache(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    positions: Tensor,
    cos: Tensor,
    sin: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_mapping: Tensor,
) -> None:
    # q: [T, Hq, D]; k, v: [T, Hkv, D]; caches: [N, S, Hkv, D]; q and k are rotated in place.
    fn = triton_rope_cache.rope_and_cache if _use_triton(q) else reference.rope_and_cache
    fn(q, k, v, positions, cos, sin, k_cache, v_cache, slot_mapping)


def paged_decode_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    scale: float,
    sliding_window: int = 0,
    out: Tensor | None = None,
    return_lse: bool = False,
    num_splits: int | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    # q: [B, Hq, D]; caches: [N, S, Hkv, D]; block_tables: [B, M]; seq_lens: [B]
    fn = (
        triton_paged_decode.paged_decode_attention
        if _use_triton(q)
        else reference.paged_decode_attention
    )
    return fn(
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        scale,
        sliding_window=sliding_window,
        out=out,
        return_lse=return_lse,
        num_splits=num_splits,
    )


def write_kv(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    positions: Tensor,
    cos: Tensor,
    sin: Tensor,
    kv: KvCache,
    slot_mapping: Tensor,
) -> None:
    """RoPE on q and k in place, then k and v into the layer's cache, whatever its codec."""
    if not isinstance(kv, QuantKvCache):
        rope_and_cache(q, k, v, positions, cos, sin, kv[0], kv[1], slot_mapping)
        return
    fn = (
        triton_rope_cache.rope_and_cache_quant if _use_triton(q) else reference.rope_and_cache_quant
    )
    fn(q, k, v, positions, cos, sin, kv, slot_mapping)


def decode_attention(
    q: Tensor,
    kv: KvCache,
    block_tables: Tensor,
    seq_lens: Tensor,
    scale: float,
    sliding_window: int = 0,
    out: Tensor | None = None,
    return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """paged_decode_attention over the layer's cache; a quantized one is dequantized to
    q.dtype inside the kernel."""
    if not isinstance(kv, QuantKvCache):
        return paged_decode_attention(
            q, kv[0], kv[1], block_tables, seq_lens, scale, sliding_window, out, return_lse
        )
    fn = (
        triton_paged_decode.paged_decode_attention_quant
        if _use_triton(q)
        else reference.paged_decode_attention_quant
    )
    return fn(
        q,
        kv,
        block_tables,
        seq_lens,
        scale,
        sliding_window=sliding_window,
        out=out,
        return_lse=return_lse,
    )


def prefill_attention(
    q: Tensor,
    kv: KvCache,
    block_tables: Tensor,
    query_start_loc: list[int],
    seq_lens: list[int],
    scale: float,
    sliding_window: int = 0,
    prefixes: list[tuple[Tensor, Tensor] | None] | None = None,
) -> Tensor:
    """On CUDA one Triton launch for the step, reading the cache in place (a quantized one
    dequantized in registers); on the CPU the torch reference, where a quantized cache
    dequantizes only the blocks the queries see. `prefixes`: per sequence, dense K and V of
    its leading keys kept outside this cache (the Warm tier); its block table then starts
    after them."""
    if _use_triton(q):
        operands = (
            triton_paged_prefill.quant_kv(kv)
            if isinstance(kv, QuantKvCache)
            else triton_paged_prefill.native_kv(*kv)
        )
        return triton_paged_prefill.paged_prefill_attention(
            q, operands, block_tables, query_start_loc, seq_lens, scale, sliding_window, prefixes
        )
    if isinstance(kv, QuantKvCache):
        return reference.paged_prefill_attention_quant(
            q, kv, block_tables, query_start_loc, seq_lens, scale, sliding_window, prefixes
        )
    return paged_prefill_attention(
        q, kv[0], kv[1], block_tables, query_start_loc, seq_lens, scale, sliding_window, prefixes
    )
