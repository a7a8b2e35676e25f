"""Whole KV blocks of a paged cache gathered into one dense buffer, dequantized (Triton).

The prefill reads a sequence's Warm prefix at every layer of every chunk (gpu_daemon
.warm_device). On CUDA the cache is the Warm pool's registered host memory, so this kernel
reads the records over PCIe once, straight into the buffer the attention takes::

    cache, any strides (unit along D):  [N, S, Hkv, D]   model dtype, or int8 / int4 codes
                                                         + scales (+ zeros)
    slots:                              [n]              block ids, in token order
    out (k and v, contiguous):          [n * S, Hkv, D]  out[i * S + s, h] = cache[slots[i], s, h]

`gather_rows` moves whole records as they are (an int8 / int4 Hot cache's blocks, loaded
back from Warm into Hot): rows [N, R] bytes, any row stride -> out [n, R], as 4-byte words.

Grid (n, Hkv, cdiv(S, BLOCK_S)): one program moves K and V of one head of BLOCK_S tokens of
one block. Its rows are D contiguous elements, 256 B for bf16 and D = 128, each at least one
whole 128-byte line. The dequantization is kvcodec.quant's: int8 fp32 code * fp32 scale of
the channel's group, int4 (the Warm pool's KIVI records: key scales per block and channel)
that product rounded to fp32 before its zero is added (no fused multiply-add), then one
rounding to the output dtype, so the result is the codec's `decode_blocks` bit for bit; a
native cache's values are only cast (a no-op in the model dtype).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from hybridgen.kernels.kv_quant import QuantKvCache

_TILE_ELEMS = 4096  # elements of one [BLOCK_S, BLOCK_D] tile: 16 per thread at 4 warps


@triton.jit
def _round_bf16(x):
    # fp32 -> bf16 rounded half to even on the bit pattern: torch's cast, bit for bit, on every
    # backend (Triton's interpreter truncates). A NaN stays a NaN; its bits are unspecified
    # (torch's CPU and CUDA casts differ there too), where the rounding would wrap it to -0.0.
    b = x.to(tl.uint32, bitcast=True)
    b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    b = tl.where(x != x, 0x7FC0, b)
    return b.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _move_tile(
    src_ptr,
    scale_ptr,
    zero_ptr,
    dst_ptr,
    src_off,
    meta_off,
    dst_off,
    shift,
    mask,
    QUANT: tl.constexpr,
    ROUND_BF16: tl.constexpr,
):
    # src_off / dst_off: [BLOCK_S, BLOCK_D] element offsets (int4: of each channel's byte, and
    # `shift` its nibble); meta_off: the same tile's offsets into the scales (and zeros), only
    # read when QUANT.
    x = tl.load(src_ptr + src_off, mask=mask, other=0)
    if QUANT == 4:
        x = (x.to(tl.int32) >> shift) & 15
    if QUANT != 0:
        scale = tl.load(scale_ptr + meta_off, mask=mask, other=0.0)
        x = x.to(tl.float32) * scale.to(tl.float32)
    if QUANT == 4:
        x = x + tl.load(zero_ptr + meta_off, mask=mask, other=0.0).to(tl.float32)
    if ROUND_BF16:
        x = _round_bf16(x)
    tl.store(dst_ptr + dst_off, x.to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize_on_alignment=["slots_ptr"])
def _gather_kernel(
    slots_ptr,
    k_ptr,
    v_ptr,
    ks_ptr,
    vs_ptr,
    kz_ptr,
    vz_ptr,
    ko_ptr,
    vo_ptr,
    block_size,
    head_dim,
    sk_n,
    sk_s,
    sk_h,
    sv_n,
    sv_s,
    sv_h,
    ksm_n,
    ksm_s,
    ksm_h,
    vsm_n,
    vsm_s,
    vsm_h,
    so_t,
    so_h,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    KGROUP: tl.constexpr,
    VGROUP: tl.constexpr,
    QUANT: tl.constexpr,
    ROUND_BF16: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.program_id(2) * BLOCK_S + tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    slot = tl.load(slots_ptr + i).to(tl.int64)  # int64: a pool of many GiB overflows int32
    mask = (s < block_size)[:, None] & (d < head_dim)[None, :]
    row = s[:, None]
    dst = (i * block_size + row) * so_t + h * so_h + d[None, :]
    # int4: channel 2j is byte j's low nibble, 2j + 1 its high one.
    col = d[None, :] // 2 if QUANT == 4 else d[None, :]
    shift = (d[None, :] % 2) * 4
    k_meta = slot * ksm_n + row * ksm_s + h * ksm_h + d[None, :] // KGROUP
    k_src = slot * sk_n + row * sk_s + h * sk_h + col
    _move_tile(k_ptr, ks_ptr, kz_ptr, ko_ptr, k_src, k_meta, dst, shift, mask, QUANT, ROUND_BF16)
    v_meta = slot * vsm_n + row * vsm_s + h * vsm_h + d[None, :] // VGROUP
    v_src = slot * sv_n + row * sv_s + h * sv_h + col
    _move_tile(v_ptr, vs_ptr, vz_ptr, vo_ptr, v_src, v_meta, dst, shift, mask, QUANT, ROUND_BF16)


def gather_blocks(
    cache: tuple[Tensor, Tensor] | QuantKvCache, slots: Tensor, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """cache: [N, S, Hkv, D] (native, or a QuantKvCache: int8, or int4 with its keys grouped
    per channel or per token), on the device or in host memory it can read; slots: [n]
    integer block ids on the device -> k, v [n * S, Hkv, D] in `dtype` on slots' device."""
    if isinstance(cache, QuantKvCache):
        k, v, ks, vs = cache.k, cache.v, cache.k_scale, cache.v_scale
        kz = ks if cache.k_zero is None else cache.k_zero  # int8: never read
        vz = vs if cache.v_zero is None else cache.v_zero
        quant, k_group, v_group, dim = cache.bits, cache.k_group, cache.v_group, cache.head_dim
    else:
        (k, v), quant, k_group, v_group = cache, 0, 1, 1
        ks = vs = kz = vz = k  # not read: QUANT is off
        dim = k.shape[-1]
    _, size, heads, _ = k.shape
    if k.stride(-1) != 1 or v.stride(-1) != 1 or ks.stride(-1) != 1 or vs.stride(-1) != 1:
        raise ValueError("gather_blocks: the cache needs unit stride along head_dim")
    n = slots.shape[0]
    ko = torch.empty(n * size, heads, dim, dtype=dtype, device=slots.device)
    vo = torch.empty_like(ko)
    if n == 0:
        return ko, vo
    block_d = triton.next_power_of_2(dim)
    block_s = min(triton.next_power_of_2(size), max(1, _TILE_ELEMS // block_d))
    round_bf16 = dtype == torch.bfloat16 and (quant != 0 or k.dtype == torch.float32)
    grid = (n, heads, triton.cdiv(size, block_s))
    _gather_kernel[grid](
        slots,
        k,
        v,
        ks,
        vs,
        kz,
        vz,
        ko,
        vo,
        size,
        dim,
        *k.stride()[:3],
        *v.stride()[:3],
        *ks.stride()[:3],
        *vs.stride()[:3],
        ko.stride(0),
        ko.stride(1),
        BLOCK_S=block_s,
        BLOCK_D=block_d,
        KGROUP=k_group,
        VGROUP=v_group,
        QUANT=quant,
        ROUND_BF16=round_bf16,
        num_warps=4,
        enable_fp_fusion=False,
    )
    return ko, vo


_ROW_WORDS = 1024  # 4 KiB of a row per program


@triton.jit(do_not_specialize_on_alignment=["index_ptr"])
def _rows_kernel(index_ptr, src_ptr, dst_ptr, row_stride, words, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    w = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    row = tl.load(index_ptr + i).to(tl.int64)
    mask = w < words
    x = tl.load(src_ptr + row * row_stride + w, mask=mask)
    tl.store(dst_ptr + i * words + w, x, mask=mask)


def gather_rows(rows: Tensor, index: Tensor) -> Tensor:
    """rows: [N, R] uint8 (unit stride along R, R and the row stride multiples of 4), on the
    device or in host memory it can read; index: [n] integer row ids on the device ->
    [n, R] uint8 on index's device: out[i] = rows[index[i]]."""
    n, nbytes = index.shape[0], rows.shape[1]
    if rows.stride(1) != 1 or nbytes % 4 or rows.stride(0) % 4 or rows.data_ptr() % 4:
        raise ValueError("gather_rows: rows need unit stride and 4-byte aligned rows")
    out = torch.empty(n, nbytes, dtype=torch.uint8, device=index.device)
    if n == 0 or nbytes == 0:
        return out
    words = nbytes // 4
    src = rows.view(torch.int32)  # [N, R / 4], row stride / 4
    grid = (n, triton.cdiv(words, _ROW_WORDS))
    _rows_kernel[grid](index, src, out.view(torch.int32), src.stride(0), words, BLOCK=_ROW_WORDS)
    return out
