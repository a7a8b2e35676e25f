"""Paged prefill attention, varlen and causal, GQA-aware (Triton): one launch per step.

A step's prefill chunks are packed [T, Hq, D] (query_start_loc); their keys, the chunk's own
and the sequence's cached context, sit in the paged cache [N, S, Hkv, D] and are read there in
place, through the block table: no gathered copy of the context, and no K/V repeated per query
head. Grid (query tiles, Hkv): a tile is up to BLOCK_M consecutive queries of one sequence,
and its program serves all G = Hq / Hkv query heads of one kv head, as BLOCK_M x BLOCK_G rows
(row r: query r // BLOCK_G, head r % BLOCK_G) against each K/V tile, loaded once. So the work
is bounded by the chunk (max_num_batched_tokens) whatever the context, and the memory by the
output.

Keys are indexed in cache space: key j of a sequence with `hot` keys in the cache, the last n
of them the chunk's, is visible to chunk query m when j <= hot - n + m (causal) and, with a
sliding window W, hot - n + m - j < W. A Warm prefix of P keys outside the cache (its block
table starts after them) takes a second, non-causal launch over those keys (every query sees
all of them), and the two partials merge by log-sum-exp.

Quantized caches (int8 / int4, kv_quant.QuantKvCache) are dequantized in registers by the
decode kernel's tile loader, to q's dtype, as the torch reference does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from hybridgen.kernels.kv_quant import QuantKvCache
from hybridgen.kernels.reference import merge_attention_partials
from hybridgen.kernels.triton_paged_decode import (
    _LOG2E,
    _NO_WINDOW,
    _Kv,
    _load_kv_tile,
    _natural_lse,
    key_tile,
)
from hybridgen.runtime.upload import upload

_ROWS = 128
"""Query rows (queries x query heads of one kv head) per program."""
_TILE_KEYS = 64
_NUM_WARPS = 8
_NUM_STAGES = 2


@triton.jit(
    do_not_specialize=["s_bt"], do_not_specialize_on_alignment=["bt_ptr", "tiles_ptr", "meta_ptr"]
)
def _prefill_kernel(
    q_ptr,
    kc_ptr,
    vc_ptr,
    bt_ptr,
    tiles_ptr,
    meta_ptr,
    out_ptr,
    lse_ptr,
    qk_scale,
    window,
    n_q_heads,
    group,
    head_dim,
    sq_t,
    sq_h,
    skc_n,
    skc_s,
    skc_h,
    svc_n,
    svc_s,
    svc_h,
    s_bt,
    so_t,
    so_h,
    ks_ptr,
    kz_ptr,
    vs_ptr,
    vz_ptr,
    ksm_n,
    ksm_s,
    ksm_h,
    vsm_n,
    vsm_s,
    vsm_h,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr,
    WRITE_LSE: tl.constexpr,
    DOT_FP32: tl.constexpr,
    QUANT: tl.constexpr,
    KGROUP: tl.constexpr,
    VGROUP: tl.constexpr,
):
    # q: [T, Hq, D]; caches: [N, S, Hkv, D] (or codes, see _load_kv_tile); bt: [B, M];
    # tiles: [num_tiles, 2] (sequence, first query); meta: [B, 3] (q_start, n, hot keys)
    R: tl.constexpr = BLOCK_M * BLOCK_G
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    seq = tl.load(tiles_ptr + 2 * tile).to(tl.int64)
    m0 = tl.load(tiles_ptr + 2 * tile + 1)
    q_start = tl.load(meta_ptr + 3 * seq)
    n = tl.load(meta_ptr + 3 * seq + 1)
    hot = tl.load(meta_ptr + 3 * seq + 2)

    r = tl.arange(0, R)
    m = m0 + r // BLOCK_G  # [R] query index within the chunk
    g = r % BLOCK_G
    row_ok = (m < n) & (g < group)
    heads = kvh * group + g
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    tok = (q_start + m).to(tl.int64)
    q = tl.load(
        q_ptr + tok[:, None] * sq_t + heads[:, None] * sq_h + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    kv_ty = kc_ptr.dtype.element_ty if QUANT == 0 else q_ptr.dtype.element_ty
    q = q.to(tl.float32) if DOT_FP32 else q.to(kv_ty)

    if CAUSAL:
        last = hot - n + m  # [R] last key each row sees
        m_hi = tl.minimum(m0 + BLOCK_M, n) - 1
        k_hi = hot - n + m_hi + 1
        k_lo = tl.maximum(hot - n + m0 - window + 1, 0)
    else:
        last = hot - 1 + m * 0
        k_hi = hot
        k_lo = 0

    m_i = tl.zeros([R], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([R], dtype=tl.float32)
    acc = tl.zeros([R, BLOCK_D], dtype=tl.float32)
    for start in range((k_lo // BLOCK_N) * BLOCK_N, k_hi, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        key_ok = (j >= k_lo) & (j < k_hi)
        phys = tl.load(bt_ptr + seq * s_bt + j // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
        off = j % BLOCK_SIZE
        k = _load_kv_tile(
            kc_ptr,
            ks_ptr,
            kz_ptr,
            phys * skc_n + off * skc_s + kvh * skc_h,
            phys * ksm_n + off * ksm_s + kvh * ksm_h,
            key_ok,
            head_dim,
            kv_ty,
            BLOCK_N,
            BLOCK_D,
            KGROUP,
            QUANT,
        )
        if DOT_FP32:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale  # [R, BLOCK_N]
        seen = key_ok[None, :] & (j[None, :] <= last[:, None])
        if CAUSAL:
            seen &= (last[:, None] - j[None, :]) < window
        s = tl.where(seen, s, float("-inf"))
        # A row may see no key of this tile (or none yet): its max stays -inf, and the
        # exponentials then use 0 as the reference so that no -inf - -inf occurs.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(s - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = _load_kv_tile(
            vc_ptr,
            vs_ptr,
            vz_ptr,
            phys * svc_n + off * svc_s + kvh * svc_h,
            phys * vsm_n + off * vsm_s + kvh * vsm_h,
            key_ok,
            head_dim,
            kv_ty,
            BLOCK_N,
            BLOCK_D,
            VGROUP,
            QUANT,
        )
        if DOT_FP32:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new

    has_keys = l_i > 0
    o = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    o_ptrs = out_ptr + tok[:, None] * so_t + heads[:, None] * so_h + d[None, :]
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    if WRITE_LSE:
        tl.store(lse_ptr + tok * n_q_heads + heads, _natural_lse(m_i, l_i), mask=row_ok)


_plan_cache: dict[tuple[object, ...], tuple[Tensor, Tensor, int]] = {}


def _plan(
    query_start_loc: list[int], hot: list[int], block_m: int, device: torch.device
) -> tuple[Tensor, Tensor, int]:
    """(tiles [num_tiles, 2], meta [B, 3]) int32 on the device, and the number of tiles. Every
    layer of a step asks with the same arguments, so the last plan is kept."""
    key = (tuple(query_start_loc), tuple(hot), block_m, device)
    cached = _plan_cache.get(key)
    if cached is not None:
        return cached
    tiles, meta = [], []
    for i, h in enumerate(hot):
        lo, n = query_start_loc[i], query_start_loc[i + 1] - query_start_loc[i]
        meta += [lo, n, h]
        tiles += [x for m0 in range(0, n, block_m) for x in (i, m0)]
    packed = upload(torch.tensor(meta + tiles, dtype=torch.int32), device)
    plan = (packed[len(meta) :].view(-1, 2), packed[: len(meta)].view(-1, 3), len(tiles) // 2)
    _plan_cache.clear()
    _plan_cache[key] = plan
    return plan


def _tile_sizes(head_dim: int, group: int) -> tuple[int, int, int, int]:
    # (BLOCK_D, BLOCK_G, BLOCK_M, BLOCK_N): BLOCK_M * BLOCK_G = _ROWS rows a program.
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_g = triton.next_power_of_2(group)
    # Wider than 512 (an MLA latent), 16 query rows: their [rows, BLOCK_D] tile beside a K
    # and a V tile must fit shared memory too.
    block_m = max((_ROWS if block_d <= 512 else 16) // block_g, 1)
    block_n = key_tile(block_d, _TILE_KEYS)
    return block_d, block_g, block_m, block_n


def _launch(
    q: Tensor,
    kv: _Kv,
    block_tables: Tensor,
    query_start_loc: list[int],
    hot: list[int],
    scale: float,
    window: int,
    causal: bool,
    out: Tensor,
    lse: Tensor | None,
) -> None:
    _, n_q_heads, head_dim = q.shape
    block_size, n_kv_heads = kv.k.shape[1], kv.k.shape[2]
    group = n_q_heads // n_kv_heads
    block_d, block_g, block_m, block_n = _tile_sizes(head_dim, group)
    tiles, meta, num_tiles = _plan(query_start_loc, hot, block_m, q.device)
    if num_tiles == 0:
        return
    dot_dtype = kv.k.dtype if kv.quant == 0 else q.dtype
    dot_fp32 = not q.is_cuda and dot_dtype == torch.bfloat16  # the interpreter's bf16 dots
    lse_arg = lse if lse is not None else out
    _prefill_kernel[(num_tiles, n_kv_heads)](
        q,
        kv.k,
        kv.v,
        block_tables,
        tiles,
        meta,
        out,
        lse_arg,
        scale * _LOG2E,
        window if window > 0 else _NO_WINDOW,
        n_q_heads,
        group,
        head_dim,
        q.stride(0),
        q.stride(1),
        *kv.cache_strides(),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        *kv.scale_operands(),
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_G=block_g,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        CAUSAL=causal,
        WRITE_LSE=lse is not None,
        DOT_FP32=dot_fp32,
        QUANT=kv.quant,
        KGROUP=kv.k_group,
        VGROUP=kv.v_group,
        num_warps=_NUM_WARPS,
        num_stages=_NUM_STAGES,
    )


def native_kv(k_cache: Tensor, v_cache: Tensor) -> _Kv:
    """A native cache as the kernels' operands (its own tensors as the unused scales)."""
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    return _Kv(k_cache, v_cache, k_cache, k_cache, v_cache, v_cache, 0, 1, 1)


def quant_kv(cache: QuantKvCache) -> _Kv:
    """An int8 / int4 cache as the kernels' operands."""
    kz = cache.k_scale if cache.k_zero is None else cache.k_zero  # int8: never read
    vz = cache.v_scale if cache.v_zero is None else cache.v_zero
    return _Kv(
        cache.k,
        cache.v,
        cache.k_scale,
        kz,
        cache.v_scale,
        vz,
        cache.bits,
        cache.k_group,
        cache.v_group,
    )


def paged_prefill_attention(
    q: Tensor,
    kv: _Kv,
    block_tables: Tensor,
    query_start_loc: list[int],
    seq_lens: list[int],
    scale: float,
    sliding_window: int = 0,
    prefixes: list[tuple[Tensor, Tensor] | None] | None = None,
) -> Tensor:
    """Causal attention of each sequence's chunk over its keys, as the torch reference's
    paged_prefill_attention (same arguments; the cache given as kernel operands, see
    native_kv and quant_kv). Rows past query_start_loc[-1] are zero."""
    # q: [T, Hq, D] packed; block_tables: [B, M]; query_start_loc: host [B + 1];
    # seq_lens: host [B] keys per sequence (a Warm prefix included); prefixes[i]: K, V
    # [P, Hkv, D] of sequence i's first P keys (P a multiple of the block size; no window)
    q = q if q.stride(-1) == 1 else q.contiguous()
    out = torch.empty_like(q)
    if query_start_loc[-1] < q.shape[0]:
        out[query_start_loc[-1] :].zero_()
    warm = [i for i, p in enumerate(prefixes or []) if p is not None]
    plen = [0] * len(seq_lens)
    for i in warm:
        prefix = (prefixes or [])[i]
        assert prefix is not None and sliding_window <= 0
        plen[i] = prefix[0].shape[0]
    hot = [s - p for s, p in zip(seq_lens, plen, strict=True)]
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device) if warm else None
    _launch(q, kv, block_tables, query_start_loc, hot, scale, sliding_window, True, out, lse)
    for i in warm:
        assert prefixes is not None and lse is not None
        prefix = prefixes[i]
        assert prefix is not None
        _merge_prefix(q, prefix, i, query_start_loc, scale, kv.k.shape[1], out, lse)
    return out


def _merge_prefix(
    q: Tensor,
    prefix: tuple[Tensor, Tensor],
    i: int,
    query_start_loc: list[int],
    scale: float,
    block_size: int,
    out: Tensor,
    lse: Tensor,
) -> None:
    """Sequence i's chunk attends its Warm prefix (every key visible), merged into out."""
    lo, hi = query_start_loc[i], query_start_loc[i + 1]
    if hi == lo:
        return
    k, v = prefix  # [P, Hkv, D], P a multiple of block_size
    p, hkv, dim = k.shape
    paged = (p // block_size, block_size, hkv, dim)
    kv = native_kv(k.reshape(paged), v.reshape(paged))
    table = torch.arange(paged[0], dtype=torch.int32, device=q.device).unsqueeze(0)
    part = torch.empty_like(q[lo:hi])
    part_lse = torch.empty(part.shape[:2], dtype=torch.float32, device=q.device)
    _launch(q[lo:hi], kv, table, [0, hi - lo], [p], scale, 0, False, part, part_lse)
    merged, _ = merge_attention_partials(out[lo:hi], lse[lo:hi], part, part_lse)
    out[lo:hi] = merged
