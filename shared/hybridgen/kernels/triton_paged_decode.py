"""Paged decode attention, flash-decoding split-K (Triton).

Grid (B, Hkv, num_splits). One program serves all G = Hq // Hkv query heads of one kv head:
each K/V tile is loaded once and multiplied against a [BLOCK_G, D] query tile (BLOCK_G >= 16,
tl.dot's minimum), which is what makes GQA decode bandwidth-bound rather than load-bound.
Keys are walked in tiles of BLOCK_N (independent of the cache block size S) by gathering the
physical block of every key through the block table. Each split writes an unnormalized partial
(acc, running max m, running sum l) in the log2 domain; a second kernel merges the splits. With
one split the first kernel normalizes and writes the output itself. (A merge by the last split
to finish, 909fee1, saved that launch but was slower: B1 int4 on an H100 decoded at 323 tok/s
against 354 before it, `bench/ab_commits.sh`; its one program walked the splits' partials one
after another, each load waiting on L2, where the merge kernel's programs load them at once.)

Quantized caches (kv_quant.QuantKvCache, int8 or int4 per token and group of channels) take the
same kernel: each K/V tile is loaded as codes plus per-group scales (and zeros), dequantized in
registers and rounded to q's dtype, so the kernel computes the same attention as the torch
reference over the cache dequantized to the model dtype (kv_quant.dequantize_blocks). An int8
or int4 cache with one group size for keys and values (the Hot tier's) instead keeps the
scales and zeros out of the codes (`_attend_folded`): the codes enter fp16 dots as they are
and the scales multiply the dots' results, a finer rounding than the dequantized cache's. Every
byte is loaded once: scales as [BLOCK_N, D / g] and broadcast over their g channels, int4 codes
as [BLOCK_N, D / 2] bytes split into nibbles, so the group size must be a power of two. Keys
and values have a group each: the Warm pool's int4 records (KIVI) keep one key scale and zero
per block and channel, a group of 1 with no stride along the block's tokens (warm_device.py).

Everything is launch-shape static (grid, scratch sizes) given B, Hq, M and num_splits, so the
wrapper is safe inside CUDA graph capture: no host syncs, no data-dependent Python branches.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from hybridgen.kernels.exact_float import int4_words_half, int8_float, int8_words_half
from hybridgen.kernels.kv_quant import QuantKvCache

_LOG2E = 1.4426950408889634
_MIN_TILES_PER_SPLIT = 2
_CTAS_PER_SM = 4  # H200 sweep: ~4 resident programs per SM saturate HBM best
_MAX_SPLITS = 64
_DEFAULT_SMS = 132
_MERGE_SPLITS = triton.next_power_of_2(_MAX_SPLITS)  # the merge's lanes: one compile for all
_MERGE_TILE = 4096  # fp32 elements of the merge's [splits, head dims] tile (CHUNK_D from it)
_NO_WINDOW = 1 << 30  # longer than any sequence; keeps the kernel free of a window branch
# Launch tunables (module-level so a benchmark can sweep them).
_TILE_KEYS = 64  # keys per inner-loop tile for head dims <= 128 (halved above)
_NUM_WARPS = 4
_NUM_STAGES = 2
_sm_cache: dict[int, int] = {}


@triton.jit
def _natural_lse(m, l_sum):
    # m: running max of log2-domain scores; l: sum of exp2(s - m). Rows with l == 0 saw no key.
    has_keys = l_sum > 0
    lse2 = m + tl.log2(tl.where(has_keys, l_sum, 1.0))
    return tl.where(has_keys, lse2 * 0.6931471805599453, float("-inf"))


@triton.jit
def _decode_epilogue(
    acc, m_i, l_i, heads, row_ok, d, d_ok, out_row_ptr, so_h, lse_row_ptr, WRITE_LSE: tl.constexpr
):
    # acc: [BLOCK_G, BLOCK_D]; m_i, l_i: [BLOCK_G] (log2 domain). Rows with no visible key
    # (l == 0) become out 0, lse -inf instead of 0/0.
    has_keys = l_i > 0
    o = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    o_ptrs = out_row_ptr + heads[:, None] * so_h + d[None, :]
    tl.store(o_ptrs, o.to(out_row_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    if WRITE_LSE:
        tl.store(lse_row_ptr + heads, _natural_lse(m_i, l_i), mask=row_ok)


@triton.jit
def _split_tiles(seq_len, window, num_splits, split, BLOCK_N: tl.constexpr):
    # Visible keys are [start, seq_len); this split owns key tiles [t_lo, t_hi) of them.
    # A zero-length row yields no tiles and so reads nothing, not even its block table.
    start = tl.maximum(seq_len - window, 0)  # the wrapper maps "no window" to 2**30
    first_tile = start // BLOCK_N
    n_tiles = tl.cdiv(seq_len, BLOCK_N) - first_tile
    per_split = tl.cdiv(n_tiles, num_splits)
    t_lo = first_tile + split * per_split
    t_hi = tl.minimum(t_lo + per_split, first_tile + n_tiles)
    return start, t_lo, t_hi


@triton.jit
def _group_meta(
    ptr,
    meta_row,
    row_ok,
    n_groups,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    QGROUP: tl.constexpr,
):
    # -> [BLOCK_N, BLOCK_D] fp32: each key's per-group scale (or zero) repeated over its QGROUP
    # channels. Loaded once per group, [BLOCK_N, BLOCK_D / QGROUP], then broadcast in registers
    # (a per-channel gather issued QGROUP times as many loads and made the kernel load-bound).
    NG: tl.constexpr = BLOCK_D // QGROUP
    gi = tl.arange(0, NG)
    mask = row_ok[:, None] & (gi < n_groups)[None, :]
    m = tl.load(ptr + meta_row[:, None] + gi[None, :], mask=mask, other=0.0).to(tl.float32)
    return tl.reshape(tl.broadcast_to(m[:, :, None], (BLOCK_N, NG, QGROUP)), (BLOCK_N, BLOCK_D))


@triton.jit
def _load_kv_tile(
    code_ptr,
    scale_ptr,
    zero_ptr,
    code_row,
    meta_row,
    row_ok,
    head_dim,
    OUT_TY: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    QGROUP: tl.constexpr,
    QUANT: tl.constexpr,
):
    # -> [BLOCK_N, BLOCK_D] keys or values; code_row / meta_row: [BLOCK_N] element offsets of
    # each key's (block, offset, kv head) row; row_ok: [BLOCK_N] visible keys. QUANT 0: the
    # native cache's values as stored; 8: int8 code * scale; 4: u4 code * scale + zero (channel
    # 2i in the low nibble of byte i). Masked lanes (rows, channels >= head_dim) give 0.
    d = tl.arange(0, BLOCK_D)
    mask = row_ok[:, None] & (d < head_dim)[None, :]
    if QUANT == 0:
        x = tl.load(code_ptr + code_row[:, None] + d[None, :], mask=mask, other=0.0)
    else:
        n_groups = head_dim // QGROUP
        scale = _group_meta(scale_ptr, meta_row, row_ok, n_groups, BLOCK_N, BLOCK_D, QGROUP)
        if QUANT == 8:
            c = tl.load(code_ptr + code_row[:, None] + d[None, :], mask=mask, other=0)
            # without an I2F, which held the int8 cache back (exact_float)
            x = int8_float(c) * scale
        else:
            # One byte load per two channels, split into nibbles and interleaved back.
            h = tl.arange(0, BLOCK_D // 2)
            hmask = row_ok[:, None] & (h < head_dim // 2)[None, :]
            byte = tl.load(code_ptr + code_row[:, None] + h[None, :], mask=hmask, other=0)
            byte = byte.to(tl.int32)
            c = tl.interleave(byte & 15, byte >> 4)
            zero = _group_meta(zero_ptr, meta_row, row_ok, n_groups, BLOCK_N, BLOCK_D, QGROUP)
            x = c.to(tl.float32) * scale + zero
        x = x.to(OUT_TY)
    return x


@triton.jit
def _attend_folded(
    q_row_ptr,
    sq_h,
    kc_ptr,
    vc_ptr,
    ks_ptr,
    kz_ptr,
    vs_ptr,
    vz_ptr,
    bt_row_ptr,
    start,
    seq_len,
    t_lo,
    t_hi,
    kvh,
    group,
    head_dim,
    qk_scale,
    skc_n,
    skc_s,
    skc_h,
    svc_n,
    svc_s,
    svc_h,
    ksm_n,
    ksm_s,
    ksm_h,
    vsm_n,
    vsm_s,
    vsm_h,
    HALF: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    QGROUP: tl.constexpr,
    QUANT: tl.constexpr,
    ASM: tl.constexpr,
):
    # An int8 or int4 cache's tiles with their scales kept out of the codes (-> acc
    # [BLOCK_G, BLOCK_D], m, l [BLOCK_G] as the generic loop's). The dots' rows are (head h,
    # group j) at h * NG + j:
    # row (h, j) of the query holds head h's channels of group j (0 elsewhere), so a key's
    # score for head h is the sum over j of row (h, j)'s dot times the key's scale of group j,
    # and the values' dot takes row (h, j) = p_h times each key's value scale of group j,
    # giving group j's channels of head h. int4's zeros add z_j times the sum of row (h, j)'s
    # query to the scores, and p_h's sum against the keys' group-j value zeros to group j's
    # channels. The codes go to the dots as they are (exact in fp16): no multiply a code;
    # they load as int32 words (of four int8 or eight u4 codes) that convert in the loaded
    # layout (exact_float: five instructions a word of int8, eleven of u4) before the dot's
    # layout, as a native cache's bf16 tiles go (Triton 3.9 for sm_90 offline: 754
    # instructions in the loop a 64-key int8 tile against 1,454 dequantizing each code, and
    # native's 594).
    # fp16 keeps 11 bits: the queries are scaled to a max of 1024 and each tile's value
    # scales of a group to a max of 4096 (p <= 1), both undone after the dots in fp32.
    NG: tl.constexpr = BLOCK_D // QGROUP
    R: tl.constexpr = BLOCK_G * NG
    dot_ty = tl.float16 if HALF else tl.float32
    r = tl.arange(0, R)
    rh = r // NG
    rj = r % NG
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    in_group = (d // QGROUP)[None, :] == rj[:, None]  # [R, BLOCK_D]
    gi = tl.arange(0, NG)
    gi_ok = gi < head_dim // QGROUP
    PER_WORD: tl.constexpr = 4 if QUANT == 8 else 8  # codes an int32 word
    dw = tl.arange(0, BLOCK_D // PER_WORD)  # head_dim % PER_WORD == 0
    kc_words = kc_ptr.to(tl.pointer_type(tl.int32))
    vc_words = vc_ptr.to(tl.pointer_type(tl.int32))
    qb = tl.load(
        q_row_ptr + rh[:, None] * sq_h + d[None, :],
        mask=(rh < group)[:, None] & d_ok[None, :] & in_group,
        other=0.0,
    ).to(tl.float32)
    qmax = tl.max(tl.abs(qb))
    q_up = tl.where(qmax > 0, 1024.0 / tl.maximum(qmax, 1e-30), 1.0)
    q_dot = (qb * q_up).to(dot_ty)
    score_scale = qk_scale / q_up
    q_sums = tl.reshape(tl.sum(q_dot.to(tl.float32), axis=1), (BLOCK_G, NG))  # int4's zeros

    m_i = tl.zeros([BLOCK_G], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([R, BLOCK_D], dtype=tl.float32)
    acc_zero = tl.zeros([R], dtype=tl.float32)  # int4: p against the value zeros
    for tile in range(t_lo, t_hi):
        j = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        valid = (j >= start) & (j < seq_len)
        phys = tl.load(bt_row_ptr + j // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        off = j % BLOCK_SIZE
        word_ok = valid[:, None] & (dw < head_dim // PER_WORD)[None, :]
        meta_ok = gi_ok[:, None] & valid[None, :]
        # [NG, BLOCK_N]: each key's scale (and zero) of each group
        k_meta = (phys * ksm_n + off * ksm_s + kvh * ksm_h)[None, :] + gi[:, None]
        v_meta = (phys * vsm_n + off * vsm_s + kvh * vsm_h)[None, :] + gi[:, None]
        kc = tl.load(
            kc_words + ((phys * skc_n + off * skc_s + kvh * skc_h) // 4)[:, None] + dw[None, :],
            mask=word_ok,
            other=0,
        )
        k = _codes_dot_operand(kc, QUANT, HALF, BLOCK_N, BLOCK_D, ASM)
        ks = tl.load(
            ks_ptr + k_meta,
            mask=meta_ok,
            other=0.0,
        ).to(tl.float32)  # [NG, BLOCK_N]
        s3 = tl.reshape(tl.dot(q_dot, tl.trans(k), input_precision="ieee"), (BLOCK_G, NG, BLOCK_N))
        s3 = s3 * (ks * score_scale)[None, :, :]
        if QUANT == 4:
            kz = tl.load(
                kz_ptr + k_meta,
                mask=meta_ok,
                other=0.0,
            ).to(tl.float32)
            s3 += q_sums[:, :, None] * (kz * score_scale)[None, :, :]
        s = tl.sum(s3, axis=1)  # [BLOCK_G, BLOCK_N]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        vc = tl.load(
            vc_words + ((phys * svc_n + off * svc_s + kvh * svc_h) // 4)[:, None] + dw[None, :],
            mask=word_ok,
            other=0,
        )
        v = _codes_dot_operand(vc, QUANT, HALF, BLOCK_N, BLOCK_D, ASM)
        vs = tl.load(
            vs_ptr + v_meta,
            mask=meta_ok,
            other=0.0,
        ).to(tl.float32)  # [NG, BLOCK_N]
        v_max = tl.max(vs, axis=1)  # [NG]; 0: no visible key has a nonzero value in group
        v_up = vs * tl.where(v_max > 0, 4096.0 / tl.maximum(v_max, 1e-30), 0.0)[:, None]
        pv = tl.reshape(p[:, None, :] * v_up[None, :, :], (R, BLOCK_N)).to(dot_ty)
        v_down = tl.reshape(tl.broadcast_to((v_max * (1.0 / 4096.0))[None, :], (BLOCK_G, NG)), (R,))
        alpha_r = tl.reshape(tl.broadcast_to(alpha[:, None], (BLOCK_G, NG)), (R,))
        pv_v = tl.dot(pv, v, input_precision="ieee")
        acc = acc * alpha_r[:, None] + pv_v * v_down[:, None]
        if QUANT == 4:
            vz = tl.load(
                vz_ptr + v_meta,
                mask=meta_ok,
                other=0.0,
            ).to(tl.float32)
            pz = tl.reshape(tl.sum(p[:, None, :] * vz[None, :, :], axis=2), (R,))
            acc_zero = acc_zero * alpha_r + pz
        m_i = m_new
    # Row (h, j) holds group j's channels of head h (and sums of no use elsewhere).
    acc = tl.where(in_group, acc + acc_zero[:, None], 0.0)
    return tl.sum(tl.reshape(acc, (BLOCK_G, NG, BLOCK_D)), axis=1), m_i, l_i


@triton.jit
def _codes_dot_operand(
    words,
    QUANT: tl.constexpr,
    HALF: tl.constexpr,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
    ASM: tl.constexpr,
):
    # [ROWS, COLS / 4 or / 8] int32 words of int8 or u4 codes -> [ROWS, COLS] fp16 (HALF) or
    # fp32, exactly.
    if QUANT == 8:
        x = tl.reshape(int8_words_half(words, ASM), (ROWS, COLS))
    else:
        x = tl.reshape(int4_words_half(words, ASM), (ROWS, COLS))
    return x if HALF else x.to(tl.float32)


@triton.jit(
    do_not_specialize=["num_splits", "s_bt"],
    do_not_specialize_on_alignment=["bt_ptr", "seq_lens_ptr"],
)
def _decode_split_kernel(
    q_ptr,
    kc_ptr,
    vc_ptr,
    bt_ptr,
    seq_lens_ptr,
    acc_ptr,
    m_ptr,
    l_ptr,
    out_ptr,
    lse_ptr,
    qk_scale,
    sliding_window,
    num_splits,
    n_q_heads,
    group,
    head_dim,
    sq_b,
    sq_h,
    skc_n,
    skc_s,
    skc_h,
    svc_n,
    svc_s,
    svc_h,
    s_bt,
    so_b,
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
    BLOCK_N: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DIRECT: tl.constexpr,
    WRITE_LSE: tl.constexpr,
    DOT_FP32: tl.constexpr,
    QUANT: tl.constexpr,
    KGROUP: tl.constexpr,
    VGROUP: tl.constexpr,
    FOLD: tl.constexpr,
    ASM: tl.constexpr,
):
    # q: [B, Hq, D]; caches: [N, S, Hkv, D] (or quantized codes, see _load_kv_tile) with unit
    # stride along D; K's scales and zeros share strides ksm_* (ksm_s 0: one per block and
    # channel, KIVI keys), V's vsm_*; bt: [B, M]
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    start, t_lo, t_hi = _split_tiles(seq_len, sliding_window, num_splits, split, BLOCK_N)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    row_ok = g < group
    d_ok = d < head_dim
    heads = kvh * group + g
    if FOLD:  # int8 with one group size: the scales kept out of the codes
        acc, m_i, l_i = _attend_folded(
            q_ptr + b * sq_b + kvh * group * sq_h,
            sq_h,
            kc_ptr,
            vc_ptr,
            ks_ptr,
            kz_ptr,
            vs_ptr,
            vz_ptr,
            bt_ptr + b * s_bt,
            start,
            seq_len,
            t_lo,
            t_hi,
            kvh,
            group,
            head_dim,
            qk_scale,
            skc_n,
            skc_s,
            skc_h,
            svc_n,
            svc_s,
            svc_h,
            ksm_n,
            ksm_s,
            ksm_h,
            vsm_n,
            vsm_s,
            vsm_h,
            q_ptr.dtype.element_ty != tl.float32,  # fp16 dots (fp32 for an fp32 model)
            BLOCK_SIZE,
            BLOCK_N,
            BLOCK_G,
            BLOCK_D,
            KGROUP,
            QUANT,
            ASM,
        )
    else:
        q = tl.load(
            q_ptr + b * sq_b + heads[:, None] * sq_h + d[None, :],
            mask=row_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        # Quantized tiles are dequantized to q's dtype, in which the dots then run.
        kv_ty = kc_ptr.dtype.element_ty if QUANT == 0 else q_ptr.dtype.element_ty
        q = q.to(tl.float32) if DOT_FP32 else q.to(kv_ty)

        m_i = tl.zeros([BLOCK_G], dtype=tl.float32) - float("inf")
        l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
        for tile in range(t_lo, t_hi):
            j = tile * BLOCK_N + tl.arange(0, BLOCK_N)
            valid = (j >= start) & (j < seq_len)
            phys = tl.load(bt_ptr + b * s_bt + j // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
            off = j % BLOCK_SIZE
            k = _load_kv_tile(
                kc_ptr,
                ks_ptr,
                kz_ptr,
                phys * skc_n + off * skc_s + kvh * skc_h,
                phys * ksm_n + off * ksm_s + kvh * ksm_h,
                valid,
                head_dim,
                kv_ty,
                BLOCK_N,
                BLOCK_D,
                KGROUP,
                QUANT,
            )
            if DOT_FP32:
                k = k.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale  # [BLOCK_G, BLOCK_N]
            s = tl.where(valid[None, :], s, float("-inf"))
            # Every tile holds >= 1 visible key, so m_new is finite and no exp2(-inf - -inf) occurs.
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = _load_kv_tile(
                vc_ptr,
                vs_ptr,
                vz_ptr,
                phys * svc_n + off * svc_s + kvh * svc_h,
                phys * vsm_n + off * vsm_s + kvh * vsm_h,
                valid,
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

    if DIRECT:
        _decode_epilogue(
            acc,
            m_i,
            l_i,
            heads,
            row_ok,
            d,
            d_ok,
            out_ptr + b * so_b,
            so_h,
            lse_ptr + b * n_q_heads,
            WRITE_LSE,
        )
    else:
        # Scratch: acc [B, Hq, NS, BLOCK_D]; m, l [B, Hq, NS].
        part = (b * n_q_heads + heads) * num_splits + split  # [BLOCK_G]
        tl.store(acc_ptr + part[:, None] * BLOCK_D + d[None, :], acc, mask=row_ok[:, None])
        tl.store(m_ptr + part, m_i, mask=row_ok)
        tl.store(l_ptr + part, l_i, mask=row_ok)


@triton.jit(do_not_specialize=["num_splits"])
def _decode_merge_kernel(
    acc_ptr,
    m_ptr,
    l_ptr,
    out_ptr,
    lse_ptr,
    num_splits,
    n_q_heads,
    head_dim,
    so_b,
    so_h,
    SPLITS_BLOCK: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CHUNK_D: tl.constexpr,
    WRITE_LSE: tl.constexpr,
):
    # Grid (B, Hq): rescales each split's partial to the global max and sums them.
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    row = b * n_q_heads + h
    sp = tl.arange(0, SPLITS_BLOCK)
    sp_ok = sp < num_splits
    m = tl.load(m_ptr + row * num_splits + sp, mask=sp_ok, other=float("-inf"))
    l_part = tl.load(l_ptr + row * num_splits + sp, mask=sp_ok, other=0.0)
    m_max = tl.max(m, axis=0)
    m_safe = tl.where(m_max > float("-inf"), m_max, 0.0)
    w = tl.exp2(m - m_safe)  # empty splits: exp2(-inf) = 0
    l_tot = tl.sum(l_part * w, axis=0)
    has_keys = l_tot > 0
    denom = tl.where(has_keys, l_tot, 1.0)
    for d0 in tl.static_range(0, BLOCK_D, CHUNK_D):  # [SPLITS_BLOCK, CHUNK_D] tiles
        d = d0 + tl.arange(0, CHUNK_D)
        acc = tl.load(
            acc_ptr + (row * num_splits + sp[:, None]) * BLOCK_D + d[None, :],
            mask=sp_ok[:, None],
            other=0.0,
        )
        o = tl.sum(acc * w[:, None], axis=0) / denom
        o_ptrs = out_ptr + b * so_b + h * so_h + d
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=d < head_dim)
    if WRITE_LSE:
        tl.store(lse_ptr + row, _natural_lse(m_safe, l_tot))


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return _DEFAULT_SMS
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _sm_cache:
        _sm_cache[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _sm_cache[idx]


def pick_num_splits(batch: int, n_kv_heads: int, max_keys: int, block_n: int, sms: int) -> int:
    """Splits per (sequence, kv head): as many as fit one wave of _CTAS_PER_SM programs per SM.

    Rounded down, because a second, partial wave costs more than the lost parallelism (H200
    sweep). Bounded so that each split still gets >= _MIN_TILES_PER_SPLIT key tiles of the
    longest possible sequence (max_keys = M * S), and by _MAX_SPLITS. Depends on shapes only,
    never on seq_lens, so it is fixed under CUDA-graph capture.
    """
    want = (_CTAS_PER_SM * sms) // max(batch * n_kv_heads, 1)
    max_tiles = triton.cdiv(max(max_keys, 1), block_n)
    cap = max_tiles // _MIN_TILES_PER_SPLIT
    return max(1, min(want, cap, _MAX_SPLITS))


def key_tile(block_d: int, keys: int) -> int:
    """Keys per inner-loop tile (`keys` for head dims <= 128, half up to 512) for a padded
    head width, so that a K and a V tile of
    [keys, BLOCK_D] fit shared memory beside the queries: a 576-wide MLA latent pads to 1,024,
    where 32 keys asked 329,792 bytes of the H200's 232,448 (fp32); tl.dot needs >= 16."""
    if block_d <= 128:
        return keys
    if block_d <= 512:
        return keys // 2
    return 16


def _tile_sizes(head_dim: int, group: int, fold_group: int = 0) -> tuple[int, int, int]:
    # (BLOCK_D, BLOCK_G, BLOCK_N); tl.dot needs every dimension >= 16. With fold_group (the
    # folded int8 loop's channels a scale) the dots' rows are BLOCK_G heads x BLOCK_D /
    # fold_group groups, and only those need 16.
    block_d = max(16, triton.next_power_of_2(head_dim))
    min_rows = triton.cdiv(16, block_d // fold_group) if fold_group else 16
    block_g = max(min_rows, triton.next_power_of_2(group))
    block_n = key_tile(block_d, _TILE_KEYS)
    return block_d, block_g, block_n


def _split_scratch(lse: Tensor, num_splits: int, block_d: int) -> tuple[Tensor, Tensor, Tensor]:
    # (acc [B, Hq, NS, BLOCK_D], m [B, Hq, NS], l [B, Hq, NS]) fp32. With one split the kernel
    # never touches them, so they alias lse: a real allocation keeps launcher pointer checks
    # happy.
    if num_splits == 1:
        return lse, lse, lse
    shape = (*lse.shape, num_splits)
    acc = torch.empty(*shape, block_d, dtype=torch.float32, device=lse.device)
    m = torch.empty(shape, dtype=torch.float32, device=lse.device)
    return acc, m, torch.empty_like(m)


class _Kv(NamedTuple):
    """The cache operands of one launch; a native cache passes itself as unused scales."""

    k: Tensor
    v: Tensor
    k_scale: Tensor
    k_zero: Tensor
    v_scale: Tensor
    v_zero: Tensor
    quant: int
    """0 native, 8 int8, 4 int4 (the kernel's QUANT)."""
    k_group: int
    """Channels per key scale; 1 for native, and for per-channel keys."""
    v_group: int
    """Channels per value scale; 1 for native."""

    def cache_strides(self) -> tuple[int, ...]:
        """K's then V's strides of their first three dims, as the kernels take them."""
        return (*self.k.stride()[:3], *self.v.stride()[:3])

    def scale_operands(self) -> tuple[Tensor | int, ...]:
        """The scales and zeros, then K's and V's scale strides (first three dims each)."""
        k, v = self.k_scale, self.v_scale
        return (k, self.k_zero, v, self.v_zero, *k.stride()[:3], *v.stride()[:3])


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
    """Decode attention of one query token per sequence over a paged KV cache.

    Returns out [B, Hq, D] (q.dtype) and, with return_lse, lse [B, Hq] fp32 (natural log of the
    sum of exp(scaled scores)). Rows with seq_len == 0 give out 0 and lse -inf.
    """
    # q: [B, Hq, D]; caches: [N, S, Hkv, D]; block_tables: [B, M] int32; seq_lens: [B] int32
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    kv = _Kv(k_cache, v_cache, k_cache, k_cache, v_cache, v_cache, 0, 1, 1)
    return _decode(
        q, kv, block_tables, seq_lens, scale, sliding_window, out, return_lse, num_splits
    )


def paged_decode_attention_quant(
    q: Tensor,
    cache: QuantKvCache,
    block_tables: Tensor,
    seq_lens: Tensor,
    scale: float,
    sliding_window: int = 0,
    out: Tensor | None = None,
    return_lse: bool = False,
    num_splits: int | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """paged_decode_attention over an int8 / int4 cache, dequantized to q.dtype in registers."""
    # q: [B, Hq, D]; cache: QuantKvCache; block_tables: [B, M] int32; seq_lens: [B] int32
    assert q.shape[-1] == cache.head_dim, f"head_dim {q.shape[-1]} != {cache.head_dim}"
    kz = cache.k_scale if cache.k_zero is None else cache.k_zero  # int8: never read
    vz = cache.v_scale if cache.v_zero is None else cache.v_zero
    kv = _Kv(
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
    return _decode(
        q, kv, block_tables, seq_lens, scale, sliding_window, out, return_lse, num_splits
    )


def _decode(
    q: Tensor,
    kv: _Kv,
    block_tables: Tensor,
    seq_lens: Tensor,
    scale: float,
    sliding_window: int,
    out: Tensor | None,
    return_lse: bool,
    num_splits: int | None,
) -> Tensor | tuple[Tensor, Tensor]:
    batch, n_q_heads, head_dim = q.shape
    block_size, n_kv_heads = kv.k.shape[1], kv.k.shape[2]
    assert n_q_heads % n_kv_heads == 0, "Hq must be a multiple of Hkv"
    q = q if q.stride(-1) == 1 else q.contiguous()
    group = n_q_heads // n_kv_heads
    # int8 or int4 with one group size for keys and values: the scales kept out of the codes,
    # which load as int32 words (every row of codes 4-byte aligned, whole words a head)
    fold = (
        kv.quant in (8, 4)
        and kv.k_group == kv.v_group
        and head_dim % (4 if kv.quant == 8 else 8) == 0
        and all(st % 4 == 0 for st in kv.cache_strides())
        and kv.k.data_ptr() % 4 == kv.v.data_ptr() % 4 == 0
    )
    block_d, block_g, block_n = _tile_sizes(head_dim, group, kv.k_group if fold else 0)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    assert out.stride(-1) == 1
    lse = torch.empty(batch, n_q_heads, dtype=torch.float32, device=q.device)
    if num_splits is None:
        max_keys = block_tables.shape[1] * block_size
        num_splits = pick_num_splits(batch, n_kv_heads, max_keys, block_n, _sm_count(q.device))
    if batch == 0:
        return (out, lse) if return_lse else out
    direct = num_splits == 1
    window = sliding_window if sliding_window > 0 else _NO_WINDOW
    # CPU tensors only run under the Triton interpreter, whose tl.dot multiplies bf16 operands
    # as their raw uint16 bits; there the dots run on fp32 copies instead (exact for bf16).
    dot_dtype = kv.k.dtype if kv.quant == 0 else q.dtype
    dot_fp32 = not q.is_cuda and dot_dtype == torch.bfloat16
    acc, m, l_ = _split_scratch(lse, num_splits, block_d)
    _decode_split_kernel[(batch, n_kv_heads, num_splits)](
        q,
        kv.k,
        kv.v,
        block_tables,
        seq_lens,
        acc,
        m,
        l_,
        out,
        lse,
        scale * _LOG2E,
        window,
        num_splits,
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
        BLOCK_N=block_n,
        BLOCK_G=block_g,
        BLOCK_D=block_d,
        DIRECT=direct,
        WRITE_LSE=return_lse,
        DOT_FP32=dot_fp32,
        QUANT=kv.quant,
        KGROUP=kv.k_group,
        VGROUP=kv.v_group,
        FOLD=fold,
        ASM=q.is_cuda,
        num_warps=_NUM_WARPS,
        num_stages=_NUM_STAGES,
    )
    if not direct:
        _decode_merge_kernel[(batch, n_q_heads)](
            acc,
            m,
            l_,
            out,
            lse,
            num_splits,
            n_q_heads,
            head_dim,
            out.stride(0),
            out.stride(1),
            SPLITS_BLOCK=_MERGE_SPLITS,
            BLOCK_D=block_d,
            CHUNK_D=min(block_d, _MERGE_TILE // _MERGE_SPLITS),
            WRITE_LSE=return_lse,
            num_warps=4,
        )
    return (out, lse) if return_lse else out
