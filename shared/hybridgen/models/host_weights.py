"""One projection of a host layer (models/host_layers.py): its weights in host memory in the
device kernels' layout (what a fetch copies, row for row), the CPU's form of its first
`cpu_rows` output rows, and the multiply either side runs over its rows.

    native  weight [N, K] (+ bias [N]): one copy serves both sides (the CPU multiplies a view
            of its rows)
    int8    codes int8 [N, K], scale fp32 [N, K / group] (models/dense_quant.py): one copy;
            the CPU multiplies with torch's int8 weight-only kernel when the scale is per
            channel (weights quantized here), else dequantizes its rows per call (GGUF Q8_0)
    int4    codes in dense_quant's layout, which the device's kernel reads; the CPU's rows
            are repacked into torch's CPU int4 layout (experts/format.py: w = (code - 8) *
            scale + zero', zero' = zero + 8 scale, in the model dtype), a second copy of
            cpu_rows rows: the host holds (1 + f) times the layers' int4 bytes for a CPU
            share f (cpu: 2x, split at f = 0.27: 1.27x). Rows not in blocks of 64 dequantize.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hybridgen.kernels import int4_layout, ops
from hybridgen.models.dense_quant import QuantLinear, QuantWeight, WeightFormat, unpack_int4

CPU = torch.device("cpu")
INT4_CPU_GROUPS = (32, 64, 128, 256)
"""Input group sizes torch's CPU int4 kernel takes."""
INT4_CPU_ROWS = max(int4_layout.ROW_BLOCKS)
"""Rows torch's CPU int4 kernel takes in whole blocks on every CPU (its layouts' blocks)."""


def _host(t: Tensor, pin: bool) -> Tensor:
    t = t.detach().to(CPU).contiguous()
    return t.pin_memory() if pin else t


@dataclass
class HostProjection:
    """One projection's host tensors, each with the output rows first."""

    fmt: WeightFormat
    group: int
    rows: dict[str, Tensor]
    """native: weight; int8/int4: codes, scale (and zero for int4); bias when there is one."""
    cpu_rows: int = 0
    """Output rows [0, cpu_rows) the CPU computes when the step computes on the host."""
    cpu_form: tuple[Tensor, ...] = field(default=())
    """The CPU kernels' tensors for those rows (empty where the rows' view serves)."""

    @classmethod
    def of(cls, linear: nn.Module, pin: bool) -> HostProjection:
        """An nn.Linear's or a QuantLinear's tensors, moved to host memory (page-locked when
        `pin`, for async copies to CUDA)."""
        bias = getattr(linear, "bias", None)
        rows: dict[str, Tensor] = {}
        fmt: WeightFormat
        if isinstance(linear, QuantLinear):
            w = linear.weight
            rows = {"codes": w.codes, "scale": w.scale}
            if w.zero is not None:
                rows["zero"] = w.zero
            fmt, group = linear.fmt, linear.group
        else:
            assert isinstance(linear, nn.Linear)
            rows, fmt, group = {"weight": linear.weight}, "native", linear.in_features
        if bias is not None:
            rows["bias"] = bias
        return cls(fmt, group, {k: _host(v, pin) for k, v in rows.items()})  # type: ignore[arg-type]

    @property
    def out_features(self) -> int:
        return next(iter(self.rows.values())).shape[0]

    @property
    def in_features(self) -> int:
        if self.fmt == "native":
            return self.rows["weight"].shape[1]
        return self.rows["scale"].shape[1] * self.group

    def nbytes(self, rows: slice = slice(None)) -> int:
        """Bytes of rows `rows` as stored (what a fetch of them copies)."""
        return sum(t[rows].numel() * t.element_size() for t in self.rows.values())

    def stage(self, staged: dict[str, Tensor], first: int) -> None:
        """Copy rows [first, out_features) into the first rows of a staging slot's part
        (non-blocking: on CUDA the copy is queued on the current stream)."""
        for name, t in self.rows.items():
            staged[name][: t.shape[0] - first].copy_(t[first:], non_blocking=True)

    def module(self, device: torch.device) -> nn.Module:
        """The projection as a resident module on `device` (weights.gpu_layers: auto)."""
        rows = {k: v.to(device) for k, v in self.rows.items()}
        bias = rows.get("bias")
        if self.fmt == "native":
            w = rows["weight"]
            linear = nn.Linear(w.shape[1], w.shape[0], bias=bias is not None, device="meta")
            linear.weight = nn.Parameter(w, requires_grad=False)
            if bias is not None:
                linear.bias = nn.Parameter(bias, requires_grad=False)
            return linear
        return QuantLinear(self.weight(rows, slice(None)), bias)

    def weight(self, rows: dict[str, Tensor], sel: slice) -> QuantWeight:
        """Rows `sel` of int8/int4 tensors `rows` (host or staging) as a QuantWeight."""
        zero = rows["zero"][sel] if "zero" in rows else None
        fmt = self.fmt
        assert fmt != "native"
        return QuantWeight(fmt, rows["codes"][sel], rows["scale"][sel], zero, self.group)

    def set_cpu_rows(self, n: int, dtype: torch.dtype) -> None:
        """The CPU computes rows [0, n) from now: build their CPU form (activations in
        `dtype`)."""
        self.cpu_rows, self.cpu_form = n, ()
        sel = slice(0, n)
        if n == 0 or self.fmt == "native":
            return
        w = self.weight(self.rows, sel)
        if self.fmt == "int8" and w.scale.shape[1] == 1:
            self.cpu_form = (w.codes, w.scale[:, 0].to(dtype).contiguous())
        elif self.fmt == "int4" and n % INT4_CPU_ROWS == 0 and w.group in INT4_CPU_GROUPS:
            assert w.zero is not None
            codes = unpack_int4(w.codes).to(torch.int32)
            packed = torch._convert_weight_to_int4pack_for_cpu(codes, 1)  # this CPU's layout
            scale, zero = w.scale.float(), w.zero.float() + 8 * w.scale.float()
            sz = torch.stack([scale, zero], -1).transpose(0, 1).to(dtype).contiguous()
            self.cpu_form = (packed, sz)

    def cpu_linear(self, x: Tensor) -> Tensor:
        """x [T, K] on the CPU -> rows [0, cpu_rows) of the output [T, cpu_rows]."""
        sel = slice(0, self.cpu_rows)
        bias = self.rows["bias"][sel] if "bias" in self.rows else None
        if self.fmt == "native":
            return F.linear(x, self.rows["weight"][sel], bias)
        if self.cpu_form and self.fmt == "int8":
            y = torch._weight_int8pack_mm(x, self.cpu_form[0], self.cpu_form[1])
        elif self.cpu_form:
            y = torch._weight_int4pack_mm_for_cpu(
                x.contiguous(), self.cpu_form[0], self.group, self.cpu_form[1]
            )
        else:
            y = F.linear(x, self.weight(self.rows, sel).dequantize(x.dtype))
        return y if bias is None else y + bias

    def device_linear(self, staged: dict[str, Tensor], x: Tensor) -> Tensor:
        """x [T, K] on the device times the rows `staged` holds (views of a staging slot's
        first rows: the device's share of them) -> [T, rows]."""
        bias = staged.get("bias")
        if self.fmt == "native":
            return ops.linear(x, staged["weight"], bias)
        return ops.quant_dense_linear(x, self.weight(staged, slice(None)), bias)

    def staging(self, device: torch.device) -> dict[str, Tensor]:
        """An empty device copy of every row (a staging slot's part)."""
        return {k: torch.empty_like(v, device=device) for k, v in self.rows.items()}
