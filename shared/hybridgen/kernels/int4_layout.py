"""The byte layout of int4 expert codes: torch's CPU int4 kernel's, which depends on the CPU.

torch._weight_int4pack_mm_for_cpu reads codes packed by its own converter, whose layout
follows the instruction set torch dispatches to: output rows in blocks of R, block b a
contiguous [K, R / 2] bytes, byte (k, j) holding row R b + j's code (low nibble) and row
R b + R / 2 + j's (high nibble), with R = 64 on AVX-512 and 32 on AVX2. Other CPUs (no AVX2)
pack neighbouring rows into a byte instead; there the stored layout is R = 64 and the CPU
dequantizes (`cpu_reads`). The device kernels read whichever R this machine stores.

Stored as [out, in / 2] uint8; every matrix's rows are a multiple of 64, so both fit.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

ROW_BLOCKS = (64, 32)
"""The R of torch's CPU layouts (AVX-512, AVX2); the first is stored where neither fits."""


def pack(codes: Tensor, row_block: int) -> Tensor:
    """codes uint8 [E, out, in] in 0..15 -> [E, out, in / 2] bytes, rows in blocks of
    `row_block`."""
    e, out, in_ = codes.shape
    rows = codes.view(e, out // row_block, 2, row_block // 2, in_)  # row R b + R/2 h + j
    packed = rows[:, :, 0] | (rows[:, :, 1] << 4)  # [E, out / R, R / 2, in]
    return packed.transpose(-1, -2).reshape(e, out, in_ // 2)


def unpack(q: Tensor, row_block: int) -> Tensor:
    """One matrix's bytes [out, in / 2] -> codes uint8 [out, in]."""
    out, half = q.shape
    blocks = q.reshape(out // row_block, 2 * half, row_block // 2).transpose(-1, -2)
    return torch.stack([blocks & 15, blocks >> 4], dim=1).reshape(out, 2 * half)


@functools.cache
def _native() -> int | None:
    """The R of torch's CPU converter here, None when it packs another way."""
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (64, 64), generator=gen, dtype=torch.int32)
    native = torch._convert_weight_to_int4pack_for_cpu(codes, 1)
    for r in ROW_BLOCKS:
        if torch.equal(native, pack(codes.to(torch.uint8)[None], r)[0]):
            return r
    return None


def row_block() -> int:
    """The R this machine stores int4 experts in (its CPU's, else ROW_BLOCKS[0])."""
    return _native() or ROW_BLOCKS[0]


def cpu_reads() -> bool:
    """Whether torch's CPU int4 kernel reads the stored layout on this CPU."""
    return _native() is not None
