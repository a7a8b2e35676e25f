"""Decoder layers whose weights stay in host memory (weights.gpu_layers), for dense models
larger than the device.

Design. The first `gpu_layers` decoder layers are resident on the device, whole. Each later
layer keeps its four projections (the fused qkv, o, and the MLP's fused gate_up and down) in
host memory, page-locked on CUDA; its two RMSNorm weights (2 * H values) stay on the device,
and so does its KV: the Hot pool holds every layer's K and V, so the KV write, rope,
attention and the residual norms of every layer run on the device exactly as for a resident
layer, and the KV tiers (Warm, prefix reuse, preemption) see no difference. Per step, each
host layer is either

    cpu     its projections run on the CPU with the host weights: the qkv projection's input
            goes to the host and q|k|v come back, attention's output goes to the host and the
            o projection comes back, and the MLP (gate_up, SiLU-and-mul, down) runs on the
            host whole: four activation copies of T rows per layer, no weight moves;
    stream  its weights are copied into one device staging layer that all host layers share,
            and the layer runs there as a resident one does: the layer's bytes cross per step.

Both compute the function a resident layer computes, with the same ops in the same dtype, so
in fp32 the tokens are the resident model's (bit for bit on a CPU-only engine, where the
"device" is the CPU too and a stream is a copy between two host buffers).

The choice (weights.host_layer_compute: auto) is the Cold-Weights latency model's
(experts/latency.py), with a host layer in place of an expert: the CPU's time for the layer's
projections at the step's T tokens against the copy at PCIe bandwidth plus one device call;
a step of at most `cpu_max_tokens` tokens computes its host layers on the CPU, a larger one
(a prefill chunk) streams them. All host layers have the same shape, so one step places them
all alike. On a CPU-only engine streaming would only add a copy: auto computes on the CPU.
`cpu` and `stream` pin the choice (tests, measurements).

Not here yet: overlapping the fetch of layer i + 1 with layer i (one staging buffer, copies
in the compute stream), and the CPU daemon computing the CPU layers (the GPU daemon's own
threads do); MoE models keep their experts' own offload (cold_weights) and cannot use this.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from hybridgen.models.dense_quant import project

HostCompute = Literal["auto", "cpu", "stream"]
"""weights.host_layer_compute: how a step computes the host layers."""
CPU = torch.device("cpu")


@dataclass
class HostLayerStats:
    """Counters since start, over every host layer."""

    cpu_layers: int = 0
    """Host layers computed on the CPU, summed over steps."""
    streamed_layers: int = 0
    """Host layers streamed to the device staging buffer and computed there, over steps."""
    weight_bytes_h2d: int = 0
    """Weight bytes copied from host memory into the staging buffer."""
    activation_bytes: int = 0
    """Activation bytes copied each way for the CPU's layers."""
    tokens: int = 0
    """Tokens of the steps that ran host layers."""

    def bytes_per_token(self) -> float:
        moved = self.weight_bytes_h2d + self.activation_bytes
        return moved / self.tokens if self.tokens else 0.0


def module_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


class HostLayers:
    """The host layers' shared state: this step's placement, the choice rule and counters."""

    def __init__(
        self,
        gpu_layers: int,
        num_layers: int,
        compute: HostCompute,
        device: torch.device,
        layer_bytes: int,
    ) -> None:
        self.gpu_layers, self.num_layers = gpu_layers, num_layers
        self.compute, self.device, self.layer_bytes = compute, device, layer_bytes
        self.cpu_max_tokens: int | None = None
        """auto on CUDA: the latency model's crossover (set at start); None: every step on
        the CPU (a CPU-only engine)."""
        self.mode: Literal["cpu", "stream"] = "cpu"
        self.stats = HostLayerStats()

    @property
    def host_layers(self) -> int:
        return self.num_layers - self.gpu_layers

    def choose(self, tokens: int) -> Literal["cpu", "stream"]:
        """Where a step of `tokens` tokens computes its host layers."""
        if self.compute != "auto":
            return self.compute
        if self.cpu_max_tokens is None or tokens <= self.cpu_max_tokens:
            return "cpu"
        return "stream"

    def begin_step(self, tokens: int) -> None:
        """A forward pass of `tokens` packed tokens starts: place its host layers."""
        self.mode = self.choose(tokens)
        self.stats.tokens += tokens
        if self.mode == "cpu":
            self.stats.cpu_layers += self.host_layers
        else:
            self.stats.streamed_layers += self.host_layers

    def run(self, host: nn.Module, staging: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """`host`'s function of x [T, in], on the CPU or through `staging` on the device."""
        if self.mode == "cpu":
            self.stats.activation_bytes += x.numel() * x.element_size()
            y = host(x.to(CPU))
            self.stats.activation_bytes += y.numel() * y.element_size()
            return y.to(x.device)
        for dst, src in zip(staging.parameters(), host.parameters(), strict=True):
            dst.copy_(src, non_blocking=True)
            self.stats.weight_bytes_h2d += src.numel() * src.element_size()
        return staging(x)

    def placement(self) -> dict[str, int | float | str]:
        """The figures `serve --explain` and GetModelInfo show."""
        s = self.stats
        return {
            "gpu_layers": self.gpu_layers,
            "host_layers": self.host_layers,
            "host_layer_compute": self.compute,
            "host_layer_bytes": self.layer_bytes,
            "cpu_layer_steps": s.cpu_layers,
            "streamed_layer_steps": s.streamed_layers,
            "host_bytes_per_token": s.bytes_per_token(),
        }


class Projection(nn.Module):
    """y = x @ W.T (+ b) through models.dense_quant.project: an nn.Linear or a QuantLinear as
    a module, so that host and staging copies run alike."""

    def __init__(self, linear: nn.Module) -> None:
        super().__init__()
        self.linear = linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return project(self.linear, x)


class HostModule(nn.Module):
    """A layer's projection (or whole MLP) whose weights live in host memory: each call runs
    it on the CPU or streams it through the shared `staging` copy, as `layers` placed the
    step. The host module is kept outside the module tree, so the model's parameters (what
    the memory plan counts, what .to() moves) are the device's alone."""

    def __init__(self, host: nn.Module, staging: nn.Module, layers: HostLayers) -> None:
        super().__init__()
        self.staging = staging
        self.layers = layers
        self._host = (host,)  # a tuple: nn.Module would register a module attribute

    @property
    def host(self) -> nn.Module:
        return self._host[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers.run(self.host, self.staging, x)


def _to_host(module: nn.Module, pin: bool) -> nn.Module:
    """The module moved to host memory (page-locked when `pin`), in place."""
    module.to(CPU)
    if pin:
        for p in module.parameters():
            p.data = p.data.pin_memory()
    return module


_PARTS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp")
"""A host layer's parts whose weights live in host memory (the norms stay on the device)."""


def _part(layer: nn.Module, path: str) -> tuple[nn.Module, str, nn.Module]:
    """(its owner, its attribute name, the part as a module that computes it)."""
    owner_path, _, name = path.rpartition(".")
    owner = layer.get_submodule(owner_path) if owner_path else layer
    part = getattr(owner, name)
    return owner, name, part if path == "mlp" else Projection(part)


def offload_layers(
    layers: nn.ModuleList, gpu_layers: int, compute: HostCompute, device: torch.device
) -> HostLayers | None:
    """Keep layers[gpu_layers:]'s projections in host memory (see the module docstring);
    None when every layer stays on the device. The layers' MLP must be dense."""
    n = len(layers)
    if gpu_layers >= n:
        return None
    staging = [copy.deepcopy(_part(layers[gpu_layers], p)[2]).to(device) for p in _PARTS]
    layer_bytes = sum(module_bytes(m) for m in staging)
    state = HostLayers(gpu_layers, n, compute, device, layer_bytes)
    pin = device.type == "cuda"
    for layer in layers[gpu_layers:]:
        for path, stage in zip(_PARTS, staging, strict=True):
            owner, name, part = _part(layer, path)
            setattr(owner, name, HostModule(_to_host(part, pin), stage, state))
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return state
