"""Small integers to fp32 without an I2F: the SM issues a conversion from a byte at 16 a clock
(1/8 of the FMA pipe), while these are integer adds or ORs and an FADD at full rate. Both
give the integer's value exactly."""

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
