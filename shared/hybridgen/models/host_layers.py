"""Decoder layers whose weights stay in host memory (weights.gpu_layers), for dense models
larger than the device.

Design. The first `gpu_layers` decoder layers are resident on the device, whole. Each later
layer keeps its four projections (the fused qkv, o, and the MLP's fused gate_up and down) in
host memory, page-locked on CUDA (models/host_weights.py: in the device's layout, plus the
CPU kernels' form of the CPU's rows); its two RMSNorm weights stay on the device, and so does
its KV: the Hot pool holds every layer's K and V, so the KV write, rope, attention, SiLU and
the residual norms of every layer run on the device exactly as for a resident layer, and the
KV tiers see no difference. Loading puts them there directly (models/host_load.py): the
device never holds more than the resident layers and the staging slots.

Each projection of a host layer splits its output rows: the CPU computes the first
`cpu_rows` from the host weights (its input copied to the host, its rows copied back), the
device the rest from a staging slot that the link fills, and the two are concatenated. A
step places its host layers one of two ways (`choose`):

    host    every projection splits at its cpu_rows: all rows for host_layer_compute cpu
            (and auto on a CPU-only engine); for split (and auto on CUDA at most
            cpu_max_tokens tokens: decode) a share f of each layer's weight bytes, from
            its largest projections first (`cpu_shares`: each part the CPU touches costs a
            round trip), f chosen at start so that the CPU's share and the link's share take
            equally long (engine/host_layer_setup.py); both work on every host layer at
            once, which is what lifts decode above either alone;
    stream  every row goes over the link and the layer runs on the device (a prefill chunk).

Overlap. Two staging slots, layer i in slot i % 2: entering layer i issues the copy of layer
i + 1's device rows (and the step's start issues the first host layer's, behind the resident
layers), on a side CUDA stream, ordered by events (a slot is refilled only after the compute
stream's last use of it; a projection's device rows wait for their own copy, not the whole
layer's: the CPU's share of a projection needs the previous projection's output, so waiting
for the layer's copy serialized the CPU behind the link, ~F + 0.9 C a layer instead of
max(F, C): 299 ms a B7 token on the H200 at 1fbe6ef). On CUDA the CPU's rows
run in a worker thread (torch's kernels release the GIL) while the device computes its
rows, and reach the device by a kernel reading them from page-locked memory (ResultRooms):
a copy-engine copy would queue behind the staging copies already issued (up to the next
layer's, ~4 ms at B7's split), and each projection's CPU share waits for the previous
projection's output, so that queue put the link back in series with the CPU (B7's step
stayed at ~F + 0.9 C with per-projection events: 347 ms at 2082a57). On a CPU-only engine
the same code runs with synchronous copies between two host buffers and no events.

All of it computes the function a resident layer computes, with the same ops in the same
dtype (split concatenates disjoint output rows), so in fp32 native weights the tokens are
the resident model's. MoE models keep their experts' own offload (cold_weights) and cannot
use this.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from hybridgen.kernels import ops
from hybridgen.models.host_weights import HostProjection

if ops.HAS_TRITON:
    from hybridgen.kernels.triton_block_gather import gather_rows

HostCompute = Literal["auto", "cpu", "stream", "split"]
"""weights.host_layer_compute: how a step computes the host layers."""
CPU = torch.device("cpu")
PARTS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
"""A host layer's projections, in the order a forward pass calls them."""


@dataclass
class HostLayerStats:
    """Counters since start, over every host layer."""

    cpu_layers: int = 0
    """Host layers computed wholly on the CPU, summed over steps."""
    split_layers: int = 0
    """Host layers split between the CPU and the device, over steps."""
    streamed_layers: int = 0
    """Host layers streamed to the device staging slots and computed there, over steps."""
    weight_bytes_h2d: int = 0
    """Weight bytes copied from host memory into the staging slots."""
    activation_bytes: int = 0
    """Activation bytes copied each way for the CPU's rows."""
    cpu_seconds: float = 0.0
    """Time the CPU's rows took (the worker's calls)."""
    tokens: int = 0
    """Tokens of the steps that ran host layers."""

    def bytes_per_token(self) -> float:
        moved = self.weight_bytes_h2d + self.activation_bytes
        return moved / self.tokens if self.tokens else 0.0

    def cpu_ms_per_token(self) -> float:
        return 1e3 * self.cpu_seconds / self.tokens if self.tokens else 0.0


def module_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def split_rows(f: float, n: int, granule: int) -> int:
    """The CPU's rows of a projection of `n` output rows for a CPU share `f`: a multiple of
    `granule` (the CPU kernel's row block), leaving each side at least one when 0 < f < 1
    and there are two."""
    if f >= 1.0 or f <= 0.0:
        return n if f >= 1.0 else 0
    rows = round(f * n / granule) * granule
    if n >= 2 * granule:
        rows = min(max(rows, granule), n - granule)
    return min(rows, n)


def granule(proj: HostProjection) -> int:
    """The rows the CPU's share of `proj` comes in (its kernel's row block)."""
    return 64 if proj.fmt == "int4" else 8


def cpu_shares(parts: list[HostProjection], fraction: float) -> list[int]:
    """Each part's CPU rows for a CPU share `fraction` of the layer's bytes, taken from the
    largest parts first: each whole until the share is reached, the next one split
    (split_rows), the rest left to the device. Every part with CPU rows costs the step a
    round trip (its input to the host, its rows back) whatever its size, and the CPU's
    kernel runs small matrices slower: split evenly over llama3-70b's four parts at f = 0.52,
    the CPU's rows took 4.9 ms and a host layer 7.7 ms on the H200, 0.45 ms of each part in
    the round trip (bench/host_layer_profile.py); at f <= 0.55 the fused gate_up alone
    carries the share."""
    if fraction >= 1.0 or fraction <= 0.0:
        return [p.out_features if fraction >= 1.0 else 0 for p in parts]
    left = fraction * sum(p.nbytes() for p in parts)
    rows = [0] * len(parts)
    for i in sorted(range(len(parts)), key=lambda i: -parts[i].nbytes()):
        p = parts[i]
        share = min(left / p.nbytes(), 1.0)
        if share * p.out_features < granule(p) / 2:
            continue  # the rest rounds to no block of this part
        rows[i] = split_rows(share, p.out_features, granule(p))
        left -= p.nbytes(slice(0, rows[i]))
    return rows


class HostLayers:
    """The host layers' weights, staging slots and copy stream, this step's placement, the
    choice rule and counters (see the module docstring)."""

    def __init__(
        self,
        gpu_layers: int,
        num_layers: int,
        compute: HostCompute,
        device: torch.device,
        projections: list[list[HostProjection]],
        dtype: torch.dtype,
    ) -> None:
        self.gpu_layers, self.num_layers = gpu_layers, num_layers
        self.compute, self.device, self.dtype = compute, device, dtype
        self.projections = projections
        """Per host layer, its PARTS' host weights."""
        self.cpu_max_tokens: int | None = None
        """auto on CUDA: the latency model's crossover (set at start); None: every step
        computes on the host side (a CPU-only engine)."""
        self.fraction = 0.0
        """The CPU's share of each host layer's weight bytes under split (set at start)."""
        self.resolved = True
        """False while weights.gpu_layers: auto has yet to size the split (loaded with
        every layer in host memory)."""
        self.mode: Literal["host", "stream"] = "host"
        self.stats = HostLayerStats()
        self.slots = [[p.staging(device) for p in projections[0]] for _ in range(2)]
        """Two staging slots on the device, each one layer's parts, every row."""
        cuda = device.type == "cuda"
        self._copies = torch.cuda.Stream(device) if cuda else None
        self._ready = [[torch.cuda.Event() for _ in PARTS] for _ in range(2)] if cuda else []
        """Per slot, per part: its rows are on the device (a part's device rows wait for their
        own copy only, so the CPU's share of part j + 1 starts while part j + 1 still copies)."""
        self._free = [torch.cuda.Event() for _ in range(2)] if cuda else []
        self._rooms = ResultRooms(device) if cuda and ops.HAS_TRITON else None
        """CUDA: where the CPU's rows wait for the device to read them (`ResultRooms`)."""
        self._filled: list[tuple[int, int] | None] = [None, None]
        self._step = 0
        self._worker: ThreadPoolExecutor | None = None

    @property
    def host_layers(self) -> int:
        return self.num_layers - self.gpu_layers

    @property
    def layer_bytes(self) -> int:
        """One host layer's weights as the device reads them (what a stream copies)."""
        return sum(p.nbytes() for p in self.projections[0])

    @property
    def staging_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for s in self.slots for p in s for t in p.values())

    @property
    def split(self) -> bool:
        """Whether a host step leaves some rows to the device (else the CPU has them all)."""
        return any(p.cpu_rows < p.out_features for p in self.projections[0])

    def place(self, fraction: float, layers: int | None = None) -> None:
        """The CPU takes `fraction` of each host layer's weight bytes (1: every row, 0: none;
        `cpu_shares` says which rows), in every host layer or the first `layers` (a
        calibration's)."""
        self.fraction = fraction
        for layer in self.projections[:layers]:
            for p, rows in zip(layer, cpu_shares(layer, fraction), strict=True):
                p.set_cpu_rows(rows, self.dtype)

    def choose(self, tokens: int) -> Literal["host", "stream"]:
        """Where a step of `tokens` tokens computes its host layers."""
        if self.compute == "stream":
            return "stream"
        if self.compute != "auto" or self.cpu_max_tokens is None:
            return "host"
        return "host" if tokens <= self.cpu_max_tokens else "stream"

    def waits_on_host(self, tokens: int) -> bool:
        """Whether a step of `tokens` tokens waits for the CPU at every host projection (its
        rows computed there), so that no later step can be queued on the device behind it."""
        return self.choose(tokens) == "host" and any(p.cpu_rows for p in self.projections[0])

    def begin_step(self, tokens: int) -> None:
        """A forward pass of `tokens` packed tokens starts: place its host layers and fetch
        the first one's device rows behind the resident layers."""
        self.mode = self.choose(tokens)
        self._step += 1
        self.stats.tokens += tokens
        if self.mode == "stream":
            self.stats.streamed_layers += self.host_layers
        elif self.split:
            self.stats.split_layers += self.host_layers
        else:
            self.stats.cpu_layers += self.host_layers
        if self._uses_device():
            self._fetch(0)

    def _uses_device(self) -> bool:
        return self.mode == "stream" or self.split

    def _cpu_rows(self, proj: HostProjection) -> int:
        return proj.cpu_rows if self.mode == "host" else 0

    def project(self, layer: int, part: int, x: torch.Tensor) -> torch.Tensor:
        """Projection PARTS[part] of decoder layer `layer` of x [T, in]: the CPU's rows and
        the device's, concatenated."""
        i = layer - self.gpu_layers
        proj = self.projections[i][part]
        if part == 0 and self._uses_device():
            self._fetch(i)
            if i + 1 < self.host_layers:
                self._fetch(i + 1)
        n, k = proj.out_features, self._cpu_rows(proj)
        cpu: Future[torch.Tensor] | torch.Tensor | None = None
        if k:
            xh = x.to(CPU)
            self.stats.activation_bytes += (xh.shape[1] + k) * xh.shape[0] * xh.element_size()
            key = (i % 2, part)
            cpu = (
                self._cpu(proj, xh, key)
                if k == n
                else self._pool().submit(self._cpu, proj, xh, key)
            )
        dev = None
        if k < n:
            staged = self.slots[i % 2][part]
            if self._copies is not None:
                torch.cuda.current_stream(self.device).wait_event(self._ready[i % 2][part])
            dev = proj.device_linear({name: t[: n - k] for name, t in staged.items()}, x)
        if part == len(PARTS) - 1 and self._copies is not None:
            self._free[i % 2].record(torch.cuda.current_stream(self.device))
        if cpu is None:
            assert dev is not None
            return dev
        y = cpu.result() if isinstance(cpu, Future) else cpu
        y = self._rooms.upload(key, y) if self._rooms is not None else y.to(x.device)
        return y if dev is None else torch.cat([y, dev], dim=-1)

    def _cpu(self, proj: HostProjection, x: torch.Tensor, key: tuple[int, int]) -> torch.Tensor:
        """The CPU's rows of `proj` (in the worker thread when the device has the rest); on
        CUDA written into the page-locked room the device reads them from."""
        start = time.perf_counter()
        with torch.inference_mode():
            y = proj.cpu_linear(x)
            if self._rooms is not None:
                y = self._rooms.stage(key, y)
        self.stats.cpu_seconds += time.perf_counter() - start
        return y

    def _pool(self) -> ThreadPoolExecutor:
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="host-layers")
        return self._worker

    def _fetch(self, i: int) -> None:
        """Copy host layer i's device rows into slot i % 2, once per step: on the copy
        stream after the slot's last use, recording when it is ready (CUDA)."""
        slot = i % 2
        if self._filled[slot] == (self._step, i):
            return
        self._filled[slot] = (self._step, i)
        stream = self._copies
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            if stream is not None:
                stream.wait_event(self._free[slot])
            for part, (proj, staged) in enumerate(
                zip(self.projections[i], self.slots[slot], strict=True)
            ):
                k = self._cpu_rows(proj)
                proj.stage(staged, k)
                self.stats.weight_bytes_h2d += proj.nbytes(slice(k, None))
                if stream is not None:
                    self._ready[slot][part].record(stream)

    def close(self) -> None:
        """Stop the CPU worker (the engine is going)."""
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None

    def placement(self) -> dict[str, int | float | str]:
        """The figures `serve --explain` and GetModelInfo show."""
        s = self.stats
        return {
            "gpu_layers": self.gpu_layers,
            "host_layers": self.host_layers,
            "host_layer_compute": self.compute,
            "host_layer_bytes": self.layer_bytes,
            "host_split_fraction": self.fraction,
            "cpu_layer_steps": s.cpu_layers,
            "split_layer_steps": s.split_layers,
            "streamed_layer_steps": s.streamed_layers,
            "host_bytes_per_token": s.bytes_per_token(),
            "host_cpu_ms_per_token": s.cpu_ms_per_token(),
            "host_layer_max_tokens": self.cpu_max_tokens or 0,
        }


class ResultRooms:
    """The CPU's rows of each (slot, part) in page-locked memory, read onto the device by a
    kernel (triton_block_gather.gather_rows: the device's loads over the link) instead of a
    copy-engine copy, which would queue behind the staging copies (module docstring). On a
    CPU device (the tests, under Triton's interpreter) the same code runs with plain memory
    and no events."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._cuda = device.type == "cuda"
        self._rooms: dict[tuple[int, int], tuple[torch.Tensor, torch.cuda.Event | None]] = {}

    def stage(self, key: tuple[int, int], y: torch.Tensor) -> torch.Tensor:
        """y [T, k] copied into `key`'s room (grown as needed) once the device has finished
        reading what it held -> the copy there."""
        held = self._rooms.get(key)
        if held is None or held[0].numel() < y.numel():
            room = torch.empty(y.numel(), dtype=y.dtype, pin_memory=self._cuda)
            held = (room, torch.cuda.Event() if self._cuda else None)
            self._rooms[key] = held
        room, read = held
        if read is not None:
            read.synchronize()  # the read of two layers ago: done, since every part syncs
        out = room[: y.numel()].view(y.shape)
        out.copy_(y)
        return out

    def upload(self, key: tuple[int, int], y: torch.Tensor) -> torch.Tensor:
        """`stage`'s y [T, k] on the device (rows of whole 4-byte words; else copied)."""
        if y.shape[1] * y.element_size() % 4:
            return y.to(self.device)
        index = torch.arange(y.shape[0], device=self.device)
        rows = gather_rows(y.view(torch.uint8), index)
        read = self._rooms[key][1]
        if read is not None:
            read.record(torch.cuda.current_stream(self.device))
        return rows.view(y.dtype)


class HostLinear(nn.Module):
    """A host layer's projection in the model's tree: its call goes to `layers`, which holds
    the weights outside the tree, so the model's parameters (what the memory plan counts,
    what .to() moves) are the device's alone."""

    def __init__(self, layers: HostLayers, layer: int, part: int) -> None:
        super().__init__()
        self.layer, self.part = layer, part
        self._layers = (layers,)  # a tuple: keeps the state out of the module tree

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._layers[0].project(self.layer, self.part, x)


def _owner(layer: nn.Module, path: str) -> tuple[nn.Module, str]:
    owner_path, _, name = path.rpartition(".")
    return layer.get_submodule(owner_path), name


def offload_layers(
    layers: nn.ModuleList,
    gpu_layers: int,
    compute: HostCompute,
    device: torch.device,
    dtype: torch.dtype,
) -> HostLayers | None:
    """Keep layers[gpu_layers:]'s projections in host memory (see the module docstring),
    moving them there from wherever they are (on the device: after loading a whole model;
    on the host: models/host_load.py put them there); None when every layer stays. The
    layers' MLP must be dense."""
    n = len(layers)
    if gpu_layers >= n:
        return None
    pin = device.type == "cuda"
    projections = []
    for layer in layers[gpu_layers:]:
        parts = []
        for path in PARTS:
            owner, name = _owner(layer, path)
            parts.append(HostProjection.of(getattr(owner, name), pin))
            setattr(owner, name, nn.Identity())  # its device tensors go now
        projections.append(parts)
    state = HostLayers(gpu_layers, n, compute, device, projections, dtype)
    for index in range(gpu_layers, n):
        for part, path in enumerate(PARTS):
            owner, name = _owner(layers[index], path)
            setattr(owner, name, HostLinear(state, index, part))
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return state


def keep_resident(state: HostLayers, layers: nn.ModuleList, gpu_layers: int) -> None:
    """Move host layers up to `gpu_layers` back to the device whole (weights.gpu_layers:
    auto, after loading every layer into host memory)."""
    for index in range(state.gpu_layers, gpu_layers):
        for path, proj in zip(PARTS, state.projections[index - state.gpu_layers], strict=True):
            owner, name = _owner(layers[index], path)
            setattr(owner, name, proj.module(state.device))
    del state.projections[: gpu_layers - state.gpu_layers]
    state.gpu_layers = gpu_layers


class HostEmbedding(nn.Module):
    """The token embedding table in host memory (an untied one, beside host layers): a step
    looks its tokens' rows up on the CPU and copies only those to the device, which keeps
    the table's bytes (2.1 GB for llama3-70b) for resident layers. The table stays out of
    the module tree, as a host layer's weights do."""

    def __init__(self, weight: torch.Tensor, pin: bool) -> None:
        super().__init__()
        table = weight.detach().to(CPU).contiguous()
        self._table = (table.pin_memory() if pin else table,)

    @property
    def weight(self) -> torch.Tensor:
        return self._table[0]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = nn.functional.embedding(input_ids.to(CPU), self.weight)
        return rows.to(input_ids.device, non_blocking=True)

    def resident(self, device: torch.device) -> nn.Embedding:
        """The table back on `device` as an nn.Embedding."""
        table = self.weight.to(device)
        embedding = nn.Embedding(table.shape[0], table.shape[1], device="meta")
        embedding.weight = nn.Parameter(table, requires_grad=False)
        return embedding
