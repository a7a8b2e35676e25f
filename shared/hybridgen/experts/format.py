"""MoE expert weights in their stored format (cold_weights.expert_format), as kept in host
memory and in the device expert cache:

    native  the checkpoint's dtype, as is (exact mode)
    int8    symmetric per output channel: w ~ q * s, q int8 [out, in], s fp32 [out];
            about 2:1 against bf16; the CPU multiplies with torch's int8 weight-only kernel
    int4    asymmetric per group of GROUP input values: w ~ (code - 8) * scale + zero, codes
            in 0..15 packed two per byte in the layout of torch's CPU int4 kernel (below),
            scale and zero as sz [in / GROUP, out, 2] in the model dtype (fp16 for fp32
            models); 4.5 bits a weight, about 3.6:1 against bf16; the CPU multiplies with
            that kernel

The int4 layout is torch._convert_weight_to_int4pack_for_cpu's on this CPU
(kernels/int4_layout.py: rows in blocks of 64 on AVX-512, 32 on AVX2), so the CPU reads the
stored bytes as they are; stored as [out, in / 2] uint8.

A PackedMatrices holds one stack [E, out, in] (every expert's gate_up, or every down) in one
format; the cache holds N slots of the same layout and copies experts in as stored, so a
fetch moves the compressed bytes. Both devices compute from the same codes: for a few tokens
the device runs fused kernels that read the codes once (kernels/triton_quant_gemv.py), for
more it dequantizes to the model dtype and multiplies; the CPU uses torch's int8 and int4
weight-only kernels.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
from torch import Tensor

from hybridgen.kernels import int4_layout, ops

Format = Literal["native", "int8", "int4"]
Alloc = Callable[[tuple[int, ...], torch.dtype], Tensor]
"""Where stored tensors come from: (shape, dtype) -> an uninitialized host tensor."""
GROUP = 64
"""Input values per int4 scale and zero."""
ROW_BLOCK = max(int4_layout.ROW_BLOCKS)
"""int4 matrices' rows are a multiple of this (every CPU layout's row block divides it)."""
INT4_SHAPES = (
    f"int4 needs each expert matrix's inputs in groups of {GROUP} and outputs in blocks of "
    f"{ROW_BLOCK}"
)
"""What an expert matrix's shape must allow for int4 (the error's first half)."""


class PackedMatrices:
    """E matrices [out, in] in one format; `parts` are its tensors, each with E first."""

    def __init__(self, fmt: Format, parts: dict[str, Tensor], dtype: torch.dtype) -> None:
        self.fmt, self.parts, self.dtype = fmt, parts, dtype
        """dtype: the model's, what `matrix` returns."""

    @classmethod
    def pack(cls, w: Tensor, fmt: Format) -> PackedMatrices:
        """w: [E, out, in] in the model dtype (on the CPU) -> the stack in `fmt`."""
        if fmt == "native":
            return cls(fmt, {"w": w.contiguous()}, w.dtype)
        x = w.float()
        if fmt == "int8":
            s = x.abs().amax(-1).clamp_min(1e-12) / 127  # [E, out]
            q = torch.round(x / s[..., None]).clamp(-127, 127).to(torch.int8)
            return cls(fmt, {"q": q, "s": s}, w.dtype)
        if not _int4_fits(*w.shape[-2:]):
            raise ValueError(f"{INT4_SHAPES}; got [out, in] = {list(w.shape[-2:])}")
        g = x.unflatten(-1, (-1, GROUP))  # [E, out, in / G, G]
        lo, hi = g.amin(-1), g.amax(-1)
        # scale and zero as stored; the codes are taken against the rounded values.
        sz_dtype = _scale_dtype(w.dtype)
        scale = ((hi - lo) / 15).clamp_min(1e-6).to(sz_dtype).float()
        zero = (lo + 8 * scale).to(sz_dtype).float()
        codes = torch.round((g - zero[..., None]) / scale[..., None]) + 8
        codes = codes.clamp(0, 15).to(torch.uint8).flatten(-2)  # [E, out, in]
        sz = torch.stack([scale, zero], dim=-1).transpose(1, 2).to(sz_dtype)  # [E, in/G, out, 2]
        q = int4_layout.pack(codes, int4_layout.row_block())
        return cls(fmt, {"q": q, "sz": sz.contiguous()}, w.dtype)

    @staticmethod
    def layout(
        fmt: Format, n: int, out: int, in_: int, dtype: torch.dtype
    ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """The tensors of n [out, in_] matrices of model dtype `dtype` in `fmt`."""
        layouts: dict[str, dict[str, tuple[tuple[int, ...], torch.dtype]]] = {
            "native": {"w": ((n, out, in_), dtype)},
            "int8": {"q": ((n, out, in_), torch.int8), "s": ((n, out), torch.float32)},
            "int4": {
                "q": ((n, out, in_ // 2), torch.uint8),
                "sz": ((n, in_ // GROUP, out, 2), _scale_dtype(dtype)),
            },
        }
        return layouts[fmt]

    @classmethod
    def allocate(
        cls, fmt: Format, n: int, out: int, in_: int, dtype: torch.dtype, alloc: Alloc
    ) -> PackedMatrices:
        """n uninitialized [out, in_] matrices of model dtype `dtype` in `fmt`, from `alloc`."""
        layout = cls.layout(fmt, n, out, in_, dtype)
        return cls(fmt, {k: alloc(shape, t) for k, (shape, t) in layout.items()}, dtype)

    @property
    def matrix_bytes(self) -> int:
        """Bytes of one matrix as stored: what a fetch copies."""
        return sum(t[0].numel() * t.element_size() for t in self.parts.values())

    def moved(self, alloc: Alloc) -> PackedMatrices:
        """A copy in tensors from `alloc` (pinned memory, the shared expert arena)."""
        parts = {}
        for k, t in self.parts.items():
            parts[k] = alloc(tuple(t.shape), t.dtype)
            parts[k].copy_(t)
        return PackedMatrices(self.fmt, parts, self.dtype)

    def empty(self, n: int, device: torch.device) -> PackedMatrices:
        """n slots of this layout on `device`, uninitialized."""
        parts = {
            k: torch.empty((n, *t.shape[1:]), dtype=t.dtype, device=device)
            for k, t in self.parts.items()
        }
        return PackedMatrices(self.fmt, parts, self.dtype)

    def copy_(self, i: int, src: PackedMatrices, j: int, non_blocking: bool) -> None:
        """Slot i <- src's matrix j, as stored."""
        for k, t in self.parts.items():
            t[i].copy_(src.parts[k][j], non_blocking=non_blocking)

    def matrix(self, i: int) -> Tensor:
        """Matrix i as [out, in] in the model dtype (a view in native format)."""
        if self.fmt == "native":
            return self.parts["w"][i]
        if self.fmt == "int8":
            q, s = self.parts["q"][i], self.parts["s"][i]
            return (q.float() * s[:, None]).to(self.dtype)
        return ops.int4_matrix(self.parts["q"][i], self.parts["sz"][i], GROUP, self.dtype)

    def linear(self, x: Tensor, i: int) -> Tensor:
        """x [N, in] @ matrix i^T -> [N, out], on x's device, which holds this stack."""
        if self.fmt == "native":
            return ops.linear(x, self.parts["w"][i])
        if self.fmt == "int8":
            q, s = self.parts["q"][i], self.parts["s"][i]
            if x.device.type == "cpu":
                return torch._weight_int8pack_mm(x, q, s.to(x.dtype))
            fused = ops.quant_int8_linear(x, q, s)
        else:
            q, sz = self.parts["q"][i], self.parts["sz"][i]
            if x.device.type == "cpu" and int4_layout.cpu_reads():
                x = x.contiguous()
                return torch._weight_int4pack_mm_for_cpu(x, q, GROUP, sz.to(x.dtype))
            fused = ops.quant_int4_linear(x, q, sz, GROUP)
        return fused if fused is not None else ops.linear(x, self.matrix(i))


def unsupported(fmt: Format, hidden: int, intermediate: int) -> str | None:
    """Why experts of this size cannot be stored in `fmt` (None when they can)."""
    if fmt != "int4":
        return None
    for name, out, in_ in (("gate_up", 2 * intermediate, hidden), ("down", hidden, intermediate)):
        if not _int4_fits(out, in_):
            return f"{INT4_SHAPES}; {name} is [{out}, {in_}]"
    return None


def _int4_fits(out: int, in_: int) -> bool:
    return in_ % GROUP == 0 and out % ROW_BLOCK == 0


def _scale_dtype(dtype: torch.dtype) -> torch.dtype:
    """int4 scales and zeros: the model dtype when it is 16-bit (what torch's CPU kernel
    takes beside activations of that dtype), fp16 for fp32 models (converted per call)."""
    return dtype if dtype.itemsize == 2 else torch.float16


def host_alloc(pin: bool) -> Alloc:
    """Plain host tensors, page-locked when `pin` (for async copies to CUDA)."""
    return lambda shape, dtype: torch.empty(shape, dtype=dtype, pin_memory=pin)


def swiglu_packed(x: Tensor, gate_up: PackedMatrices, down: PackedMatrices, i: int) -> Tensor:
    """Expert i: x [N, H] -> [N, H], models.llama.MLP's math on the stored weights."""
    return down.linear(ops.silu_and_mul(gate_up.linear(x, i)), i)
