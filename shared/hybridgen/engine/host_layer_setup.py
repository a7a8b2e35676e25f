"""weights.gpu_layers at start: how many decoder layers stay on the device (checked against
the model, or auto from the memory budget), the rest moved to host memory
(models/host_layers.py), and, for host_layer_compute auto on CUDA, the latency model that
places them per step: the Cold-Weights one (experts/latency.py), a host layer in place of an
expert."""

from __future__ import annotations

import math
from functools import partial
from typing import Literal

import structlog
import torch

from hybridgen.config.engine import ConfigError, EngineConfig
from hybridgen.engine.memory import auto_gpu_layers
from hybridgen.experts.latency import CALIBRATION_TOKENS, RUNS, LatencyModel
from hybridgen.models.host_layers import (
    HostLayers,
    HostLayerStats,
    HostModule,
    module_bytes,
    offload_layers,
)
from hybridgen.models.llama import CausalLM
from hybridgen.placement.timing import best_of

log = structlog.get_logger()

_PROJECTIONS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp")


def resident_layers(config: EngineConfig, model: CausalLM, device: torch.device) -> int:
    """weights.gpu_layers for this model: checked against its layers, auto sized from the
    budget (memory.auto_gpu_layers), unset: every layer."""
    spec, n = model.spec, model.spec.num_layers
    want = config.gpu_layers
    if want is None:
        return n
    if spec.num_local_experts:
        raise ConfigError(
            f"weights.gpu_layers={want!r} is out of range: allowed null for a MoE model "
            "(its experts move to host memory with cold_weights.expert_cache_slots)"
        )
    if want == "auto":
        first = model.layers[0]
        layer_bytes = sum(module_bytes(first.get_submodule(p)) for p in _PROJECTIONS)
        return auto_gpu_layers(config, model, device, layer_bytes)
    if not 0 <= want <= n:
        raise ConfigError(
            f"weights.gpu_layers={want} is out of range: allowed 0..{n} (the model's decoder "
            "layers) or auto"
        )
    return want


def setup_host_layers(
    config: EngineConfig, model: CausalLM, device: torch.device
) -> HostLayers | None:
    """Move the layers past weights.gpu_layers to host memory and place them; None when every
    layer stays on the device. A model an earlier engine split keeps its split."""
    if model.host_layers is not None:
        model.host_layers.compute = config.host_layer_compute
        model.host_layers.stats = HostLayerStats()
        return model.host_layers
    gpu_layers = resident_layers(config, model, device)
    state = offload_layers(model.layers, gpu_layers, config.host_layer_compute, device)
    model.host_layers = state
    if state is None:
        return None
    if state.compute == "auto" and device.type == "cuda":
        latency = calibrate_host_layer(model, state, config)
        state.cpu_max_tokens = latency.cpu_max_tokens
        log.info("host_layer_latency", **latency.figures())
    log.info("host_layers", **state.placement())
    return state


def calibrate_host_layer(model: CausalLM, state: HostLayers, config: EngineConfig) -> LatencyModel:
    """Time the first host layer's projections on the CPU at CALIBRATION_TOKENS, and its
    stream (the copy into the staging layer and one call there, timed together: the model's
    gpu_s, with no separate fetch) at one token; device_topology.cpu.bandwidth_gbps, when
    set, replaces the CPU's weight-read time, as experts/latency.calibrate does."""
    layer = model.layers[state.gpu_layers]
    parts = [layer.get_submodule(p) for p in _PROJECTIONS]
    assert all(isinstance(p, HostModule) for p in parts)
    spec, device, cpu = model.spec, state.device, torch.device("cpu")
    lo, hi = CALIBRATION_TOKENS

    def run(mode: Literal["cpu", "stream"], x: torch.Tensor, a: torch.Tensor) -> None:
        state.mode = mode
        qkv, o, mlp = parts
        qkv(x), o(a), mlp(x)

    x = torch.randn(hi, spec.hidden_size, dtype=spec.dtype)
    a = torch.randn(hi, spec.q_size, dtype=spec.dtype)
    with torch.inference_mode():
        t_lo, t_hi = (best_of(RUNS, partial(run, "cpu", x[:n], a[:n]), cpu) for n in (lo, hi))
        stream_s = best_of(RUNS, partial(run, "stream", x[:1].to(device), a[:1].to(device)), device)
    state.stats = HostLayerStats()  # the timing's calls are no served steps
    per_token = max((t_hi - t_lo) / (hi - lo), 0.0)
    fixed = max(t_lo - lo * per_token, 0.0)
    if config.cpu_bandwidth_gbps is not None:
        fixed = state.layer_bytes / (config.cpu_bandwidth_gbps * 1e9)
    return LatencyModel(fixed, per_token, math.inf, state.layer_bytes, stream_s)
