"""Small integers to fp32 or fp16 without an I2F: the SM issues a conversion from a byte at 16
a clock (1/8 of the FMA pipe), while these are integer adds, ORs and byte permutes and an FADD
(HSUB2 for two halves) at full rate. Each gives the integer's value exactly."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def byte_float(c):
    # int32 c in 0..255 -> the same value as fp32: the bits of 2^23 + c, less 2^23.
    return (c | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def int8_float(c):
    # int8 (or int32) c in -128..127 -> the same value as fp32: the bits of 2^23 + 128 + c,
    # less 2^23 + 128 (c + 128 is in 0..255).
    return (c.to(tl.int32) + 0x4B000080).to(tl.float32, bitcast=True) - 8388736.0


@triton.jit
def int8_words_half(w, ASM: tl.constexpr):
    # int32 words of four int8 codes (byte k: code k) -> [*w.shape, 2, 2] fp16 whose last dims
    # flatten to the codes in byte order. On the device a word takes an XOR, two PRMTs and two
    # HSUB2s: c ^ 0x80 is c + 128 as a byte; under a 0x64 byte it reads as the half 1024 + c +
    # 128, less 1152.
    if ASM:
        lo, hi = tl.inline_asm_elementwise(
            """{ .reg .b32 a, m;
            xor.b32 a, $2, 0x80808080;
            mov.b32 m, 0x64806480;
            prmt.b32 $0, a, 0x64646464, 0x4140;
            prmt.b32 $1, a, 0x64646464, 0x4342;
            sub.f16x2 $0, $0, m;
            sub.f16x2 $1, $1, m; }""",
            "=r,=r,r",
            [w],
            (tl.int32, tl.int32),
            True,
            1,
        )
        h0, h1 = _halves(lo)
        h2, h3 = _halves(hi)
    else:
        h0, h1, h2, h3 = _magic_half(w, 0), _magic_half(w, 1), _magic_half(w, 2), _magic_half(w, 3)
    return tl.join(tl.join(h0, h2), tl.join(h1, h3))  # [..., 2, 2]: h0, h1, h2, h3


@triton.jit
def int4_words_half(w, ASM: tl.constexpr):
    # int32 words of eight u4 codes (channel c in bits 4c..4c+3: byte i holds channels 2i low
    # and 2i + 1 high) -> [*w.shape, 2, 2, 2] fp16 whose last dims flatten to channels 0..7. On
    # the device a word takes three shifts, four LOP3s and four HSUB2s: (w >> 4k) & 0x000F000F
    # holds channels k and k + 4, and under 0x6400 each reads as the half 1024 + u.
    if ASM:
        p0, p1, p2, p3 = tl.inline_asm_elementwise(
            """{ .reg .b32 s1, s2, s3, m;
            mov.b32 m, 0x64006400;
            shr.b32 s1, $4, 4;
            shr.b32 s2, $4, 8;
            shr.b32 s3, $4, 12;
            lop3.b32 $0, $4, 0x000F000F, 0x64006400, 0xEA;
            lop3.b32 $1, s1, 0x000F000F, 0x64006400, 0xEA;
            lop3.b32 $2, s2, 0x000F000F, 0x64006400, 0xEA;
            lop3.b32 $3, s3, 0x000F000F, 0x64006400, 0xEA;
            sub.f16x2 $0, $0, m;
            sub.f16x2 $1, $1, m;
            sub.f16x2 $2, $2, m;
            sub.f16x2 $3, $3, m; }""",
            "=r,=r,=r,=r,r",
            [w],
            (tl.int32, tl.int32, tl.int32, tl.int32),
            True,
            1,
        )
        c0, c4 = _halves(p0)
        c1, c5 = _halves(p1)
        c2, c6 = _halves(p2)
        c3, c7 = _halves(p3)
    else:
        c0, c1, c2, c3 = _nibble(w, 0), _nibble(w, 1), _nibble(w, 2), _nibble(w, 3)
        c4, c5, c6, c7 = _nibble(w, 4), _nibble(w, 5), _nibble(w, 6), _nibble(w, 7)
    # A join's new dim is the last (the fastest once flattened): the outer join takes channel
    # bit 0, the next bit 1, the inner bit 2, so the three dims flatten to channels 0..7.
    even = tl.join(tl.join(c0, c4), tl.join(c2, c6))
    odd = tl.join(tl.join(c1, c5), tl.join(c3, c7))
    return tl.join(even, odd)


@triton.jit
def _nibble(w, c: tl.constexpr):
    # channel c of w (a u4 code) as fp16, by the bits the device's LOP3 builds.
    bits = ((w >> (4 * c)) & 0xF) | 0x6400
    return bits.to(tl.int16).to(tl.float16, bitcast=True) - 1024.0


@triton.jit
def _halves(x):
    # int32 x -> its low and high 16 bits as fp16.
    lo = (x & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True)
    return lo, (x >> 16).to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def _magic_half(w, k: tl.constexpr):
    # byte k of w (an int8 code) as fp16, by the bits the device's PRMT builds.
    bits = (((w >> (8 * k)) & 0xFF) ^ 0x80) | 0x6400
    return bits.to(tl.int16).to(tl.float16, bitcast=True) - 1152.0
