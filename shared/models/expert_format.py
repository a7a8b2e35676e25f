"""MoE expert weights in their stored format (cold_weights.expert_format), as kept in host
memory and in the device expert cache:

    native  the checkpoint's dtype, as is (exact mode)
    int8    symmetric per output channel: w ~ q * s, q int8 [out, in], s fp32 [out];
            about 2:1 against bf16; the CPU multiplies with torch's int8 weight-only kernel
    int4    symmetric per group of GROUP input values: q in [-7, 7] packed two per byte
            [out, in / 2], s fp16 [out, in / GROUP]; about 3.6:1 against bf16

A PackedMatrices holds one stack [E, out, in] (every expert's gate_up, or every down) in one
format; the cache holds N slots of the same layout and copies experts in as stored, so a
fetch moves the compressed bytes. Both devices compute from the same codes: for a few tokens
the device runs fused kernels that read the codes once (kernels/triton_quant_gemv.py), for
more it dequantizes to the model dtype and multiplies; the CPU does the same for int4 and
uses torch's int8 kernel for int8.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
from torch import Tensor

from hybridgen.kernels import ops

Format = Literal["native", "int8", "int4"]
Alloc = Callable[[tuple[int, ...], torch.dtype], Tensor]
"""Where stored tensors come from: (shape, dtype) -> an uninitialized host tensor."""
GROUP = 32
"""Input values per int4 scale."""


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
        if w.shape[-1] % GROUP:
            raise ValueError(f"int4 experts need in_features divisible by {GROUP}, got {w.shape}")
        g = x.unflatten(-1, (-1, GROUP))  # [E, out, in / G, G]
        # fp16 scales: 4.5 bits per weight; the codes are taken against the rounded scale.
        s = (g.abs().amax(-1) / 7).to(torch.float16).clamp_min(2**-24)  # [E, out, in / G]
        q = torch.round(g / s[..., None].float()).clamp(-7, 7) + 8
        q = q.to(torch.uint8).flatten(-2)
        packed = q[..., 0::2] | (q[..., 1::2] << 4)  # [E, out, in / 2]
        return cls(fmt, {"q": packed, "s": s}, w.dtype)

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
                "s": ((n, out, in_ // GROUP), torch.float16),
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
        parts = {k: torch.empty((n, *t.shape[1:]), dtype=t.dtype, device=device)
                 for k, t in self.parts.items()}  # fmt: skip
        return PackedMatrices(self.fmt, parts, self.dtype)

    def copy_(self, i: int, src: PackedMatrices, j: int, non_blocking: bool) -> None:
        """Slot i <- src's matrix j, as stored."""
        for k, t in self.parts.items():
            t[i].copy_(src.parts[k][j], non_blocking=non_blocking)

    def matrix(self, i: int) -> Tensor:
        """Matrix i as [out, in] in the model dtype (a view in native format)."""
        if self.fmt == "native":
            return self.parts["w"][i]
        q, s = self.parts["q"][i], self.parts["s"][i]
        if self.fmt == "int8":
            return (q.float() * s[:, None]).to(self.dtype)
        codes = torch.stack([q & 15, q >> 4], dim=-1).flatten(-2).float() - 8  # [out, in]
        groups = codes.unflatten(-1, (-1, GROUP)) * s[..., None].float()
        return groups.flatten(-2).to(self.dtype)

    def linear(self, x: Tensor, i: int) -> Tensor:
        """x [N, in] @ matrix i^T -> [N, out], on x's device, which holds this stack."""
        if self.fmt == "native":
            return ops.linear(x, self.parts["w"][i])
        q, s = self.parts["q"][i], self.parts["s"][i]
        if self.fmt == "int8" and x.device.type == "cpu":
            return torch._weight_int8pack_mm(x, q, s.to(x.dtype))
        fused = ops.quant_linear(x, self.fmt, q, s, GROUP)
        return fused if fused is not None else ops.linear(x, self.matrix(i))


def host_alloc(pin: bool) -> Alloc:
    """Plain host tensors, page-locked when `pin` (for async copies to CUDA)."""
    return lambda shape, dtype: torch.empty(shape, dtype=dtype, pin_memory=pin)


def swiglu_packed(x: Tensor, gate_up: PackedMatrices, down: PackedMatrices, i: int) -> Tensor:
    """Expert i: x [N, H] -> [N, H], models.llama.MLP's math on the stored weights."""
    return down.linear(ops.silu_and_mul(gate_up.linear(x, i)), i)
