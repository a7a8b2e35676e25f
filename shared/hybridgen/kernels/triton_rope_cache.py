"""Fused NeoX-style RoPE (in place on q and k) + paged KV-cache write (Triton).

Two cache forms: native (the model dtype) and quantized (kv_quant.QuantKvCache, int8 or int4
per token and group of channels), quantized on write with the exact rounding of
kvcodec.quant, so the codes match the torch reference bit for bit.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from hybridgen.kernels.kv_quant import QuantKvCache


@triton.jit
def _rotate_heads(
    base_ptr,
    n_heads,
    stride_h,
    stride_d,
    c1,
    c2,
    s1,
    s2,
    cache_ptr,
    stride_ch,
    slot_ok,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    WRITE_CACHE: tl.constexpr,
):
    # Rotates heads [0, n_heads) of one token in place; with WRITE_CACHE also stores them to
    # the cache row at cache_ptr where slot_ok ([BLOCK_H, 1]).
    # c1, s1 / c2, s2: [1, BLOCK_HALF] cos and sin of the first / second half of the head.
    d = tl.arange(0, BLOCK_HALF)[None, :]
    d_ok = d < HALF
    for h0 in range(0, n_heads, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)[:, None]  # [BLOCK_H, 1]
        m = (h < n_heads) & d_ok
        p1 = base_ptr + h * stride_h + d * stride_d
        p2 = p1 + HALF * stride_d
        x1 = tl.load(p1, mask=m, other=0.0)
        x2 = tl.load(p2, mask=m, other=0.0)
        a = x1.to(tl.float32)
        b = x2.to(tl.float32)
        # rotate_half(x) = [-x2, x1]
        o1 = (a * c1 - b * s1).to(x1.dtype)
        o2 = (b * c2 + a * s2).to(x1.dtype)
        tl.store(p1, o1, mask=m)
        tl.store(p2, o2, mask=m)
        if WRITE_CACHE:
            cp = cache_ptr + h * stride_ch + d
            cm = m & slot_ok
            tl.store(cp, o1.to(cache_ptr.dtype.element_ty), mask=cm)
            tl.store(cp + HALF, o2.to(cache_ptr.dtype.element_ty), mask=cm)


@triton.jit
def _cos_sin(cos_ptr, sin_ptr, pos, s_cos, s_sin, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr):
    # -> c1, c2, s1, s2: [1, BLOCK_HALF] fp32 cos and sin of the two halves at position pos.
    d = tl.arange(0, BLOCK_HALF)[None, :]
    d_ok = d < HALF
    c1 = tl.load(cos_ptr + pos * s_cos + d, mask=d_ok, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + pos * s_cos + HALF + d, mask=d_ok, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + pos * s_sin + d, mask=d_ok, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + pos * s_sin + HALF + d, mask=d_ok, other=0.0).to(tl.float32)
    return c1, c2, s1, s2


@triton.jit(do_not_specialize_on_alignment=["pos_ptr", "slot_ptr"])
def _rope_and_cache_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    pos_ptr,
    cos_ptr,
    sin_ptr,
    kc_ptr,
    vc_ptr,
    slot_ptr,
    n_q_heads,
    n_kv_heads,
    sq_t,
    sq_h,
    sq_d,
    sk_t,
    sk_h,
    sk_d,
    sv_t,
    sv_h,
    sv_d,
    s_cos,
    s_sin,
    skc_n,
    skc_s,
    skc_h,
    svc_n,
    svc_s,
    svc_h,
    BLOCK_SIZE: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    # One program per token. Cache rows have unit stride along D (checked by the wrapper).
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    c1, c2, s1, s2 = _cos_sin(cos_ptr, sin_ptr, pos, s_cos, s_sin, HALF, BLOCK_HALF)

    slot = tl.load(slot_ptr + t).to(tl.int64)
    # Padding tokens (slot < 0) get a harmless in-bounds address; their cache stores are masked.
    # The mask is broadcast to [BLOCK_H, 1] explicitly: the interpreter rejects scalar masks.
    slot_ok = (tl.zeros([BLOCK_H, 1], dtype=tl.int64) + slot) >= 0
    safe = tl.maximum(slot, 0)
    blk = safe // BLOCK_SIZE
    off = safe % BLOCK_SIZE
    kc_row = kc_ptr + blk * skc_n + off * skc_s
    vc_row = vc_ptr + blk * svc_n + off * svc_s

    _rotate_heads(
        q_ptr + t * sq_t,
        n_q_heads,
        sq_h,
        sq_d,
        c1,
        c2,
        s1,
        s2,
        kc_row,
        skc_h,
        slot_ok,
        HALF,
        BLOCK_H,
        BLOCK_HALF,
        False,
    )
    _rotate_heads(
        k_ptr + t * sk_t,
        n_kv_heads,
        sk_h,
        sk_d,
        c1,
        c2,
        s1,
        s2,
        kc_row,
        skc_h,
        slot_ok,
        HALF,
        BLOCK_H,
        BLOCK_HALF,
        True,
    )

    dv = tl.arange(0, 2 * BLOCK_HALF)[None, :]
    for h0 in range(0, n_kv_heads, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)[:, None]
        m = (h < n_kv_heads) & (dv < 2 * HALF)
        v = tl.load(v_ptr + t * sv_t + h * sv_h + dv * sv_d, mask=m, other=0.0)
        tl.store(vc_row + h * svc_h + dv, v.to(vc_ptr.dtype.element_ty), mask=m & slot_ok)


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
    """Rotates q and k in place (fp32 math) and writes rotated k and raw v to the paged cache.

    q, k, v may be strided views (e.g. slices of a fused qkv output): all strides are honoured.
    """
    # q: [T, Hq, D]; k, v: [T, Hkv, D]; positions, slot_mapping: [T]; cos, sin: [max_pos, D]
    # k_cache, v_cache: [N, S, Hkv, D]
    n_tokens, n_q_heads, dim = q.shape
    n_kv_heads = k.shape[1]
    assert dim % 2 == 0, "RoPE needs an even head size"
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    assert cos.stride(-1) == 1 and sin.stride(-1) == 1
    if n_tokens == 0:
        return
    half = dim // 2
    block_half = triton.next_power_of_2(half)
    # Tile heads so a tile holds ~2K elements per half: few loop trips, bounded registers.
    block_h = max(1, min(triton.next_power_of_2(max(n_q_heads, n_kv_heads)), 2048 // block_half))
    _rope_and_cache_kernel[(n_tokens,)](
        q,
        k,
        v,
        positions,
        cos,
        sin,
        k_cache,
        v_cache,
        slot_mapping,
        n_q_heads,
        n_kv_heads,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        k.stride(0),
        k.stride(1),
        k.stride(2),
        v.stride(0),
        v.stride(1),
        v.stride(2),
        cos.stride(0),
        sin.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        BLOCK_SIZE=k_cache.shape[1],
        HALF=half,
        BLOCK_H=block_h,
        BLOCK_HALF=block_half,
        num_warps=4,
    )


# --- quantize on write ------------------------------------------------------------------------
# The helpers mirror kvcodec.quant step by step: fp32 statistics, scales rounded up (zeros
# down) into their storage dtype before use, correctly rounded divisions (div_rn), round half
# to even. Only exactly specified operations, so CPU and GPU produce the same bytes.


@triton.jit
def _stored_up(x, dtype: tl.constexpr):
    # x (fp32) rounded toward +inf into dtype (fp16 or fp32), finite; kvcodec.quant._stored_up.
    if dtype == tl.float16:
        x = tl.minimum(tl.maximum(x, -65504.0), 65504.0)
        y = x.to(tl.float16)
        bits = y.to(tl.int16, bitcast=True)
        step = tl.where(y < 0, bits - 1, bits + 1).to(tl.int16).to(tl.float16, bitcast=True)
        out = tl.where(y.to(tl.float32) < x, step, y)
    else:
        out = x
    return out


@triton.jit
def _round_half_even(t):
    # torch.round for |t| < 2**22, from exact steps only (floor, subtraction, compare).
    r = tl.floor(t)
    f = t - r
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    return tl.where((f > 0.5) | ((f == 0.5) & odd), r + 1.0, r)


@triton.jit
def _nonzero(s):
    return tl.where(s > 0, s, 1.0)


@triton.jit
def _clamp(x, lo, hi):
    return tl.minimum(tl.maximum(x, lo), hi)


@triton.jit
def _quantize_heads(
    src_ptr,
    n_heads,
    s_h,
    s_d,
    code_ptr,
    scale_ptr,
    zero_ptr,
    sc_h,
    ss_h,
    slot,
    HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr,
    BITS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_NG: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    # Quantizes heads [0, n_heads) of one token into the cache row at code_ptr / scale_ptr /
    # zero_ptr unless slot < 0. Tiles are [BLOCK_H, BLOCK_NG groups, BLOCK_P channel pairs]:
    # x0 holds channels 2p, x1 channels 2p + 1 of each group, the two nibbles of a u4 byte.
    dt = scale_ptr.dtype.element_ty
    grp = tl.arange(0, BLOCK_NG)[None, :, None]
    p = tl.arange(0, BLOCK_P)[None, None, :]
    d0 = grp * GROUP + 2 * p  # [1, NG, P]
    slot_ok = (tl.zeros([BLOCK_H, 1, 1], dtype=tl.int64) + slot) >= 0
    for h0 in range(0, n_heads, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)[:, None, None]
        g_ok = (h < n_heads) & (grp < HEAD_DIM // GROUP)  # [BLOCK_H, NG, 1]
        ok = g_ok & (2 * p < GROUP)
        src = src_ptr + h * s_h + d0 * s_d
        x0 = tl.load(src, mask=ok, other=0.0).to(tl.float32)
        x1 = tl.load(src + s_d, mask=ok, other=0.0).to(tl.float32)
        meta = h * ss_h + grp
        if BITS == 8:
            amax = tl.max(tl.maximum(tl.abs(x0), tl.abs(x1)), axis=2, keep_dims=True)
            scale = _stored_up(tl.math.div_rn(amax, tl.full(amax.shape, 127.0, tl.float32)), dt)
            s = _nonzero(scale.to(tl.float32))
            c0 = _clamp(_round_half_even(tl.math.div_rn(x0, s)), -127.0, 127.0)
            c1 = _clamp(_round_half_even(tl.math.div_rn(x1, s)), -127.0, 127.0)
            dst = code_ptr + h * sc_h + d0
            tl.store(dst, c0.to(tl.int8), mask=ok & slot_ok)
            tl.store(dst + 1, c1.to(tl.int8), mask=ok & slot_ok)
        else:
            # Padding lanes must not count; fully padded groups get 0 to keep the math finite.
            lo = tl.min(tl.where(ok, tl.minimum(x0, x1), float("inf")), axis=2, keep_dims=True)
            hi = tl.max(tl.where(ok, tl.maximum(x0, x1), -float("inf")), axis=2, keep_dims=True)
            zero = -_stored_up(-tl.where(g_ok, lo, 0.0), dt)
            z = zero.to(tl.float32)
            span = tl.where(g_ok, hi, 0.0) - z
            scale = _stored_up(tl.math.div_rn(span, tl.full(span.shape, 15.0, tl.float32)), dt)
            s = _nonzero(scale.to(tl.float32))
            c0 = _clamp(_round_half_even(tl.math.div_rn(x0 - z, s)), 0.0, 15.0)
            c1 = _clamp(_round_half_even(tl.math.div_rn(x1 - z, s)), 0.0, 15.0)
            byte = c0.to(tl.int32) | (c1.to(tl.int32) << 4)
            dst = code_ptr + h * sc_h + grp * (GROUP // 2) + p
            tl.store(dst, byte.to(tl.uint8), mask=ok & slot_ok)
            tl.store(zero_ptr + meta, zero, mask=g_ok & slot_ok)
        tl.store(scale_ptr + meta, scale, mask=g_ok & slot_ok)


@triton.jit(do_not_specialize_on_alignment=["pos_ptr", "slot_ptr"])
def _rope_and_cache_quant_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    pos_ptr,
    cos_ptr,
    sin_ptr,
    slot_ptr,
    kc_ptr,
    vc_ptr,
    ks_ptr,
    vs_ptr,
    kz_ptr,
    vz_ptr,
    n_q_heads,
    n_kv_heads,
    sq_t,
    sq_h,
    sq_d,
    sk_t,
    sk_h,
    sk_d,
    sv_t,
    sv_h,
    sv_d,
    s_cos,
    s_sin,
    sc_n,
    sc_s,
    sc_h,
    ss_n,
    ss_s,
    ss_h,
    BLOCK_SIZE: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    GROUP: tl.constexpr,
    BITS: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_NG: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    # One program per token: rotate q and k in place, then quantize k (re-read after a barrier,
    # so the cache holds exactly the rotated k the caller sees) and v into the token's slot.
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    c1, c2, s1, s2 = _cos_sin(cos_ptr, sin_ptr, pos, s_cos, s_sin, HALF, BLOCK_HALF)
    no_cache = (tl.zeros([BLOCK_H, 1], dtype=tl.int64) - 1) >= 0
    _rotate_heads(
        q_ptr + t * sq_t,
        n_q_heads,
        sq_h,
        sq_d,
        c1,
        c2,
        s1,
        s2,
        q_ptr,
        0,
        no_cache,
        HALF,
        BLOCK_H,
        BLOCK_HALF,
        False,
    )
    _rotate_heads(
        k_ptr + t * sk_t,
        n_kv_heads,
        sk_h,
        sk_d,
        c1,
        c2,
        s1,
        s2,
        k_ptr,
        0,
        no_cache,
        HALF,
        BLOCK_H,
        BLOCK_HALF,
        False,
    )
    tl.debug_barrier()

    slot = tl.load(slot_ptr + t).to(tl.int64)
    # Padding tokens (slot < 0) get a harmless in-bounds address; their stores are masked.
    safe = tl.maximum(slot, 0)
    code_row = (safe // BLOCK_SIZE) * sc_n + (safe % BLOCK_SIZE) * sc_s
    meta_row = (safe // BLOCK_SIZE) * ss_n + (safe % BLOCK_SIZE) * ss_s
    _quantize_heads(
        k_ptr + t * sk_t,
        n_kv_heads,
        sk_h,
        sk_d,
        kc_ptr + code_row,
        ks_ptr + meta_row,
        kz_ptr + meta_row,
        sc_h,
        ss_h,
        slot,
        2 * HALF,
        GROUP,
        BITS,
        BLOCK_HQ,
        BLOCK_NG,
        BLOCK_P,
    )
    _quantize_heads(
        v_ptr + t * sv_t,
        n_kv_heads,
        sv_h,
        sv_d,
        vc_ptr + code_row,
        vs_ptr + meta_row,
        vz_ptr + meta_row,
        sc_h,
        ss_h,
        slot,
        2 * HALF,
        GROUP,
        BITS,
        BLOCK_HQ,
        BLOCK_NG,
        BLOCK_P,
    )


def rope_and_cache_quant(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    positions: Tensor,
    cos: Tensor,
    sin: Tensor,
    cache: QuantKvCache,
    slot_mapping: Tensor,
) -> None:
    """rope_and_cache into an int8 / int4 cache: rotated k and raw v are quantized per token.

    The codes and scales equal reference.write_kv_cache_quant of the rotated k and v exactly.
    """
    # q: [T, Hq, D]; k, v: [T, Hkv, D]; positions, slot_mapping: [T]; cos, sin: [max_pos, D]
    n_tokens, n_q_heads, dim = q.shape
    n_kv_heads = k.shape[1]
    assert dim % 2 == 0, "RoPE needs an even head size"
    assert dim == cache.head_dim, f"head_dim {dim} != cache head_dim {cache.head_dim}"
    assert cos.stride(-1) == 1 and sin.stride(-1) == 1
    if n_tokens == 0:
        return
    half = dim // 2
    block_half = triton.next_power_of_2(half)
    block_h = max(1, min(triton.next_power_of_2(max(n_q_heads, n_kv_heads)), 2048 // block_half))
    group = cache.group_size
    block_ng = triton.next_power_of_2(dim // group)
    block_p = triton.next_power_of_2(group // 2)
    block_hq = max(1, min(triton.next_power_of_2(n_kv_heads), 1024 // (block_ng * block_p)))
    kz = cache.k_scale if cache.k_zero is None else cache.k_zero  # int8: never read
    vz = cache.v_scale if cache.v_zero is None else cache.v_zero
    _rope_and_cache_quant_kernel[(n_tokens,)](
        q,
        k,
        v,
        positions,
        cos,
        sin,
        slot_mapping,
        cache.k,
        cache.v,
        cache.k_scale,
        cache.v_scale,
        kz,
        vz,
        n_q_heads,
        n_kv_heads,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        k.stride(0),
        k.stride(1),
        k.stride(2),
        v.stride(0),
        v.stride(1),
        v.stride(2),
        cos.stride(0),
        sin.stride(0),
        cache.k.stride(0),
        cache.k.stride(1),
        cache.k.stride(2),
        cache.k_scale.stride(0),
        cache.k_scale.stride(1),
        cache.k_scale.stride(2),
        BLOCK_SIZE=cache.block_size,
        HALF=half,
        BLOCK_H=block_h,
        BLOCK_HALF=block_half,
        GROUP=group,
        BITS=cache.bits,
        BLOCK_HQ=block_hq,
        BLOCK_NG=block_ng,
        BLOCK_P=block_p,
        num_warps=4,
    )
