"""Fused NeoX-style RoPE (in place on q and k) + paged KV-cache write (Triton)."""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor


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


# fmt: off
@triton.jit
def _rope_and_cache_kernel(
    q_ptr, k_ptr, v_ptr, pos_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr, slot_ptr,
    n_q_heads, n_kv_heads,
    sq_t, sq_h, sq_d, sk_t, sk_h, sk_d, sv_t, sv_h, sv_d,
    s_cos, s_sin,
    skc_n, skc_s, skc_h, svc_n, svc_s, svc_h,
    BLOCK_SIZE: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    # fmt: on
    # One program per token. Cache rows have unit stride along D (checked by the wrapper).
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)[None, :]
    d_ok = d < HALF
    c1 = tl.load(cos_ptr + pos * s_cos + d, mask=d_ok, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + pos * s_cos + HALF + d, mask=d_ok, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + pos * s_sin + d, mask=d_ok, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + pos * s_sin + HALF + d, mask=d_ok, other=0.0).to(tl.float32)

    slot = tl.load(slot_ptr + t).to(tl.int64)
    # Padding tokens (slot < 0) get a harmless in-bounds address; their cache stores are masked.
    # The mask is broadcast to [BLOCK_H, 1] explicitly: the interpreter rejects scalar masks.
    slot_ok = (tl.zeros([BLOCK_H, 1], dtype=tl.int64) + slot) >= 0
    safe = tl.maximum(slot, 0)
    blk = safe // BLOCK_SIZE
    off = safe % BLOCK_SIZE
    kc_row = kc_ptr + blk * skc_n + off * skc_s
    vc_row = vc_ptr + blk * svc_n + off * svc_s

    # fmt: off
    _rotate_heads(q_ptr + t * sq_t, n_q_heads, sq_h, sq_d, c1, c2, s1, s2,
                  kc_row, skc_h, slot_ok, HALF, BLOCK_H, BLOCK_HALF, False)
    _rotate_heads(k_ptr + t * sk_t, n_kv_heads, sk_h, sk_d, c1, c2, s1, s2,
                  kc_row, skc_h, slot_ok, HALF, BLOCK_H, BLOCK_HALF, True)
    # fmt: on

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
    # fmt: off
    _rope_and_cache_kernel[(n_tokens,)](
        q, k, v, positions, cos, sin, k_cache, v_cache, slot_mapping,
        n_q_heads, n_kv_heads,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        cos.stride(0), sin.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        BLOCK_SIZE=k_cache.shape[1],
        HALF=half,
        BLOCK_H=block_h,
        BLOCK_HALF=block_half,
        num_warps=4,
    )
    # fmt: on
