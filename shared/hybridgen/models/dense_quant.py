"""Weight-only int8 / int4 for a model's dense linear layers (weights.format), and QuantLinear,
the module that replaces nn.Linear for them at load.

Formats (value = code * scale + zero per group of `group` inputs of one output row):
    int8  codes int8 [N, K]; scale fp32 [N, K / group]; symmetric (no zero). Quantized from
          the model's weights per output channel (group = K); GGUF Q8_0 is repacked as is
          (group 32, scale its fp16 d).
    int4  codes in 0..15, two per byte, [N, K / 2] uint8 in GGUF's nibble order: each run of
          32 inputs is 16 bytes, byte j holding input j (low nibble) and input j + 16 (high);
          scale and zero fp16 [N, K / group]. Quantized from the model's weights in groups of
          64 (asymmetric: zero is the group's minimum; 4.5 bits a weight); GGUF Q4_0
          (zero = -8 d) and Q4_1 (zero = m) are repacked as they are (group 32), which is
          exact: d * q + m computed in fp32 is what gguf-py (and transformers) dequantize to.

The device multiplies with fused Triton kernels that read the codes once and dequantize in
registers (kernels/triton_dense_quant.py); the CPU dequantizes and multiplies (torch). int4
has three one-row kernels for bf16 activations (the word GEMV, the tensor-core GEMV and the
int8-activation GEMV, which rounds x to int8 a 32-input run as llama.cpp's matvec does);
which is fastest depends on the projection's shape and the GPU, so `choose_gemv` times each
at load over every projection of each shape and gives each the fastest (QuantLinear.gemv).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, TypeAlias

import numpy as np
import torch
from torch import Tensor, nn

from hybridgen.kernels import ops
from hybridgen.placement.timing import best_of

if TYPE_CHECKING:  # triton ships with the gpu and test extras only
    from hybridgen.kernels.triton_dense_quant import Tiles

WeightFormat = Literal["native", "int8", "int4"]
INT4_GROUP = 64
"""Inputs per int4 scale and zero when quantizing a model's own weights."""
GGUF_BLOCK = 32
"""Inputs per block of GGUF's Q8_0, Q4_0 and Q4_1."""


@dataclass
class QuantWeight:
    """One [N, K] matrix in int8 or int4 (see the module docstring)."""

    fmt: Literal["int8", "int4"]
    codes: Tensor
    scale: Tensor
    zero: Tensor | None
    group: int

    @property
    def shape(self) -> tuple[int, int]:
        n = self.codes.shape[0]
        return n, self.scale.shape[1] * self.group

    def dequantize(self, dtype: torch.dtype) -> Tensor:
        """[N, K] in `dtype`, computed in fp32 (the kernels' arithmetic)."""
        n, k = self.shape
        codes = self.codes if self.fmt == "int8" else unpack_int4(self.codes)
        values = codes.float().view(n, -1, self.group) * self.scale.float()[..., None]
        if self.zero is not None:
            values = values + self.zero.float()[..., None]
        return values.reshape(n, k).to(dtype)

    def to(self, device: torch.device) -> QuantWeight:
        zero = None if self.zero is None else self.zero.to(device)
        return QuantWeight(self.fmt, self.codes.to(device), self.scale.to(device), zero, self.group)

    @staticmethod
    def cat(parts: list[QuantWeight]) -> QuantWeight:
        """Row-wise concatenation (q, k, v -> qkv); the parts share format and group."""
        first = parts[0]
        assert all(p.fmt == first.fmt and p.group == first.group for p in parts)
        zero = None if first.zero is None else torch.cat([p.zero for p in parts])  # type: ignore[misc]
        return QuantWeight(
            first.fmt,
            torch.cat([p.codes for p in parts]),
            torch.cat([p.scale for p in parts]),
            zero,
            first.group,
        )

    @property
    def nbytes(self) -> int:
        parts = [self.codes, self.scale] + ([] if self.zero is None else [self.zero])
        return sum(t.numel() * t.element_size() for t in parts)


QUANTIZE_CHUNK_BYTES = 64 << 20
"""fp32 bytes of the rows quantized at once: bounds the temporaries, which on the device
otherwise (the LM head's 2 GB of fp32 copies) leave the caching allocator's segments pinned
by the small results carved from them, memory no KV pool can use."""


def quantize(
    w: Tensor,
    fmt: Literal["int8", "int4"],
    chunk_bytes: int = QUANTIZE_CHUNK_BYTES,
    work: torch.device | None = None,
) -> QuantWeight:
    """A model's float weight [N, K] -> int8 per channel or int4 in groups of INT4_GROUP,
    into outputs allocated first (on w's device), `chunk_bytes` of fp32 rows at a time,
    each computed on `work` (default w's device: a host layer's rows on the device)."""
    n, k = w.shape
    if fmt == "int4" and k % INT4_GROUP:
        raise ValueError(f"int4 needs inputs in groups of {INT4_GROUP}; got K = {k}")
    groups = 1 if fmt == "int8" else k // INT4_GROUP
    out = QuantWeight(
        fmt,
        torch.empty(
            n,
            k if fmt == "int8" else k // 2,
            dtype=torch.int8 if fmt == "int8" else torch.uint8,
            device=w.device,
        ),
        torch.empty(
            n, groups, dtype=torch.float32 if fmt == "int8" else torch.float16, device=w.device
        ),
        None if fmt == "int8" else torch.empty(n, groups, dtype=torch.float16, device=w.device),
        k if fmt == "int8" else INT4_GROUP,
    )
    rows = max(1, chunk_bytes // (4 * k))
    for r in range(0, n, rows):
        _quantize_rows(w[r : r + rows].to(work or w.device).float(), out, slice(r, r + rows))
    return out


def _quantize_rows(x: Tensor, out: QuantWeight, rows: slice) -> None:
    """Rows `rows` of `out` from their fp32 values x."""
    n, k = x.shape
    if out.fmt == "int8":
        scale = x.abs().amax(-1, keepdim=True).clamp_min(1e-12) / 127  # [n, 1]
        out.codes[rows] = torch.round(x / scale).clamp(-127, 127).to(torch.int8)
        out.scale[rows] = scale
        return
    assert out.zero is not None
    g = x.view(n, -1, INT4_GROUP)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp_min(1e-8).half()
    zero = lo.half()
    codes = torch.round((g - zero.float()[..., None]) / scale.float()[..., None]).clamp(0, 15)
    out.codes[rows] = pack_int4(codes.to(torch.uint8).view(n, k))
    out.scale[rows], out.zero[rows] = scale, zero


def pack_int4(codes: Tensor) -> Tensor:
    """codes uint8 [N, K] in 0..15 -> [N, K / 2] bytes in GGUF's nibble order."""
    n, k = codes.shape
    runs = codes.view(n, k // 32, 2, 16)
    return (runs[:, :, 0] | (runs[:, :, 1] << 4)).reshape(n, k // 2)


def unpack_int4(packed: Tensor) -> Tensor:
    """[N, K / 2] bytes in GGUF's nibble order -> codes uint8 [N, K]."""
    n, half = packed.shape
    runs = packed.view(n, half // 16, 1, 16)
    return torch.cat([runs & 15, runs >> 4], dim=2).reshape(n, 2 * half)


def from_gguf_blocks(qtype: str, blocks: np.ndarray) -> QuantWeight | None:
    """GGUF Q8_0 / Q4_0 / Q4_1 rows [N, bytes] as stored -> the same values, repacked; None
    for another type (those are quantized from the dequantized values instead)."""
    n = blocks.shape[0]
    b = torch.from_numpy(np.array(blocks))
    if qtype == "Q8_0":
        b = b.view(n, -1, 34)
        scale = b[..., :2].contiguous().view(torch.float16)[..., 0].float()
        codes = b[..., 2:].contiguous().view(torch.int8).reshape(n, -1)
        return QuantWeight("int8", codes, scale, None, GGUF_BLOCK)
    if qtype in ("Q4_0", "Q4_1"):
        head = 2 if qtype == "Q4_0" else 4
        b = b.view(n, -1, head + 16)
        scale = b[..., :2].contiguous().view(torch.float16)[..., 0]
        zero = (
            -8 * scale if qtype == "Q4_0" else b[..., 2:4].contiguous().view(torch.float16)[..., 0]
        )
        return QuantWeight(
            "int4", b[..., head:].reshape(n, -1).contiguous(), scale, zero, GGUF_BLOCK
        )
    return None


class QuantLinear(nn.Module):
    """y = x @ W.T (+ bias) with W as a QuantWeight; its tensors are frozen parameters, so
    the memory accounting and device moves see them."""

    def __init__(self, weight: QuantWeight, bias: Tensor | None) -> None:
        super().__init__()
        self.fmt, self.group = weight.fmt, weight.group
        self.out_features, self.in_features = weight.shape
        self.codes = nn.Parameter(weight.codes, requires_grad=False)
        self.scale = nn.Parameter(weight.scale, requires_grad=False)
        self.zero = None if weight.zero is None else nn.Parameter(weight.zero, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.gemv: Tiles | None = None
        """The one-row kernel's tiles `choose_gemv` timed fastest for this shape; None: the
        kernels' default (triton_dense_quant.tiles_for)."""

    @property
    def weight(self) -> QuantWeight:
        return QuantWeight(self.fmt, self.codes, self.scale, self.zero, self.group)  # type: ignore[arg-type]

    def forward(self, x: Tensor, swiglu: bool = False, rope: ops.RopeWrite | None = None) -> Tensor:
        """x [T, K] -> [T, N]; `swiglu` (a fused [gate | up] weight): silu(gate) * up [T, N / 2];
        `rope` (a fused qkv): q, k and v written (ops.RopeWrite). In one kernel where the
        one-row kernel can (triton_dense_quant.quant_linear)."""
        tiles = self.gemv if x.shape[0] == 1 else None
        return ops.quant_dense_linear(x, self.weight, self.bias, tiles, swiglu, rope)


GEMV_RUNS = 5
"""Timed passes per candidate kernel in choose_gemv (the shortest counts)."""
PassTimer: TypeAlias = "Callable[[Tiles, list[QuantLinear]], float]"
"""Seconds of one pass of a one-row kernel's tiles over the given projections."""


def choose_gemv(
    model: nn.Module, dtype: torch.dtype, timer: PassTimer | None = None
) -> dict[tuple[int, int, int], tuple[str, dict[str, float]]]:
    """For the device's int4 projections with bf16 activations: time each one-row kernel
    (GEMV_CANDIDATES that fit the group) over all projections of a shape (N, K, group), every
    layer's, which like a decode step reads more bytes than the L2 cache holds, and give them
    the fastest (QuantLinear.gemv). Returns {shape: (chosen, {candidate: seconds a pass})};
    nothing for int8, fp32 activations or weights off CUDA."""
    if dtype != torch.bfloat16:
        return {}
    from hybridgen.kernels.triton_dense_quant import GEMV_CANDIDATES, gemv_fits

    by_shape: dict[tuple[int, int, int], list[QuantLinear]] = defaultdict(list)
    for module in model.modules():
        if isinstance(module, QuantLinear) and module.fmt == "int4" and module.codes.is_cuda:
            shape = (module.out_features, module.in_features, module.group)
            by_shape[shape].append(module)
    chosen = {}
    for shape, modules in by_shape.items():
        times = {
            name: (timer or _time_pass)(tiles, modules)
            for name, tiles in GEMV_CANDIDATES.items()
            if gemv_fits(tiles, shape[2])
        }
        best = min(times, key=times.__getitem__)
        for module in modules:
            module.gemv = GEMV_CANDIDATES[best]
        chosen[shape] = (best, times)
    return chosen


def _time_pass(tiles: Tiles, modules: list[QuantLinear]) -> float:
    """One pass of `tiles`' kernel over `modules` (one bf16 row each) on their device,
    replayed from a CUDA graph as a decode step runs it: launched one by one from Python,
    each call costs the host ~40 us, more than most of these kernels take on the device
    (llama3-8b's 32 qkv GEMVs timed 1.26 ms a pass that way on the H100, ~0.27 ms of work)."""
    device = modules[0].codes.device
    x = torch.randn(1, modules[0].in_features, dtype=torch.bfloat16, device=device)

    def run() -> None:
        for m in modules:
            ops.quant_dense_linear(x, m.weight, m.bias, tiles)

    run()  # compiles outside the capture
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return best_of(GEMV_RUNS, graph.replay, device)


# Each fused projection and the HF weights it concatenates, in row order.
_FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}


def quantize_dense(
    model: nn.Module,
    fmt: Literal["int8", "int4"],
    stored: dict[str, QuantWeight] | None = None,
    work: torch.device | None = None,
) -> int:
    """Replace the model's dense projections (qkv, o, gate_up, down, and an untied LM head)
    by QuantLinear in `fmt`; returns the bytes the quantized weights take. `stored`: HF
    weight name -> the file's own blocks repacked (GGUF Q8_0 for int8, Q4_0/Q4_1 for int4),
    used when every part of a fused projection has them, else the float weight is quantized
    (on `work`, default where it is). MoE experts are left to cold_weights.expert_format."""
    stored = stored or {}
    total = 0
    layers = model.get_submodule("layers")
    assert isinstance(layers, nn.ModuleList)
    for i, layer in enumerate(layers):
        for fused, parts in _FUSED.items():
            owner_name, attr = fused.rsplit(".", 1)
            owner = layer.get_submodule(owner_name)
            linear = getattr(owner, attr, None)
            if not isinstance(linear, nn.Linear):  # a MoE block has no dense MLP
                continue
            names = [f"model.layers.{i}.{p}.weight" for p in parts]
            found = [stored.get(n) for n in names]
            if all(w is not None and w.fmt == fmt for w in found):
                weight = QuantWeight.cat(found).to(linear.weight.device)  # type: ignore[arg-type]
            else:
                weight = quantize(linear.weight.detach(), fmt, work=work)
            setattr(owner, attr, QuantLinear(weight, linear.bias))
            total += weight.nbytes
    head = model.get_submodule("lm_head").get_parameter("weight")
    if head is not model.get_submodule("embed_tokens").get_parameter("weight"):
        weight = quantize(head.detach(), fmt)
        model.lm_head = QuantLinear(weight, None)
        total += weight.nbytes
    return total


def project_swiglu(layer: nn.Module, x: Tensor) -> Tensor:
    """silu(gate) * up of a fused [gate | up] projection: a QuantLinear's kernel computes it
    in its epilogue (one graph node fewer a layer), any other projection's output goes through
    ops.silu_and_mul."""
    if isinstance(layer, QuantLinear):
        return layer(x, swiglu=True)
    return ops.silu_and_mul(project(layer, x))


def project(layer: nn.Module, x: Tensor) -> Tensor:
    """A model projection: nn.Linear through ops.linear (Triton GEMV at one row on CUDA), or
    any other projection module called (a QuantLinear, a host layer's: models/host_layers.py)."""
    if not isinstance(layer, nn.Linear):
        return layer(x)
    return ops.linear(x, layer.weight, layer.bias)
