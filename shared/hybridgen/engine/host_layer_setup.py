"""weights.gpu_layers at start: how many decoder layers stay on the device (checked against
the model, or auto from the memory budget), the rest in host memory (models/host_layers.py),
and how a step computes them: the CPU's share of each projection's rows under split (auto
on CUDA) from the timed CPU against the timed link, then corrected by the two timed at once
(they share the host's memory), and for auto on CUDA the crossover above
which a step streams, the Cold-Weights latency model's (experts/latency.py), a host layer in
place of an expert."""

from __future__ import annotations

import math
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import structlog
import torch

from hybridgen.config.engine import ConfigError, EngineConfig
from hybridgen.engine.memory import auto_gpu_layers
from hybridgen.experts.latency import CALIBRATION_TOKENS, RUNS, LatencyModel
from hybridgen.models.host_layers import (
    PARTS,
    HostEmbedding,
    HostLayers,
    HostLayerStats,
    keep_resident,
    module_bytes,
    offload_layers,
)
from hybridgen.models.llama import CausalLM
from hybridgen.placement.timing import best_of

log = structlog.get_logger()


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
        state = model.host_layers
        if state is not None:  # loaded into host memory: every layer there, none resident
            return auto_gpu_layers(config, model, device, state.layer_bytes, state.host_layers)
        first = model.layers[0]
        layer_bytes = sum(module_bytes(first.get_submodule(p)) for p in PARTS)
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
    """Put the layers past weights.gpu_layers in host memory (or, loaded there already, size
    auto's split) and place them; None when every layer stays on the device."""
    state = model.host_layers
    if state is None:
        gpu_layers = resident_layers(config, model, device)
        state = offload_layers(model.layers, gpu_layers, "stream", device, model.spec.dtype)
    elif not state.resolved:
        embedding_to_host(model, device)  # before sizing: its bytes go to resident layers
        state.compute = "stream"  # the memory plan's profiling step streams every layer
        gpu_layers = resident_layers(config, model, device)
        keep_resident(state, model.layers, gpu_layers)
        state.resolved = True
        if gpu_layers == state.num_layers:
            state, model.host_layers = None, None
            if isinstance(model.embed_tokens, HostEmbedding):
                model.embed_tokens = model.embed_tokens.resident(device)
    model.host_layers = state
    if state is not None:
        embedding_to_host(model, device)
    if device.type == "cuda":  # what moved left cached blocks on both sides
        torch.cuda.empty_cache()
        _empty_host_cache()
    if state is None:
        return None
    state.compute, state.stats, state.cpu_max_tokens = (
        config.host_layer_compute,
        HostLayerStats(),
        None,
    )
    place(state, config, device.type == "cuda")
    log.info("host_layers", **state.placement())
    return state


def embedding_to_host(model: CausalLM, device: torch.device) -> None:
    """An untied token embedding table moves to host memory beside host layers (tied, the
    LM head reads it on the device: it stays)."""
    if model.spec.tie_word_embeddings or isinstance(model.embed_tokens, HostEmbedding):
        return
    table = model.embed_tokens.weight
    model.embed_tokens = HostEmbedding(table, device.type == "cuda")  # type: ignore[assignment]


def place(state: HostLayers, config: EngineConfig, cuda: bool) -> None:
    """Each host projection's CPU rows for state.compute: all (cpu, and auto on a CPU-only
    engine), none (stream), or the share `split_fraction` gives (split, and auto on CUDA,
    which also streams the steps above the crossover)."""
    if state.compute == "cpu" or (state.compute == "auto" and not cuda):
        state.place(1.0)
        return
    if state.compute == "stream":
        state.place(0.0)
        return
    latency = calibrate_host_layer(state, config)
    alone = split_fraction(latency)
    cpu_s, link_s = time_together(state, alone)
    fraction = rebalance(alone, cpu_s, link_s)
    state.place(fraction)
    if state.compute == "auto":
        split = LatencyModel(
            fraction * latency.cpu_fixed_s,
            fraction * latency.cpu_s_per_token,
            latency.pcie_bytes_per_s,
            latency.expert_bytes,
        )
        state.cpu_max_tokens = max(split.cpu_max_tokens, 1)
    log.info(
        "host_layer_latency",
        split_fraction=fraction,
        split_fraction_alone=alone,
        together_cpu_us=cpu_s * 1e6,
        together_link_us=link_s * 1e6,
        **latency.figures(),
    )


def split_fraction(latency: LatencyModel) -> float:
    """The CPU's share f of a host layer's rows at one token (decode) so that its part and
    the link's part take equally long: f * cpu_s(1) = (1 - f) * fetch_s."""
    cpu, link = latency.cpu_s(1), latency.fetch_s
    return link / (cpu + link) if cpu + link > 0 else 0.0


def rebalance(fraction: float, cpu_s: float, link_s: float) -> float:
    """The CPU's share that balances the two sides, from their times for the shares
    `fraction` and 1 - fraction of a layer measured while both ran at once (time_together):
    a whole layer then costs the CPU cpu_s / f and the link link_s / (1 - f), which is what
    they cost each other (both read host memory) and the separate calibration cannot see."""
    if not 0 < fraction < 1 or cpu_s <= 0 or link_s <= 0:
        return fraction
    cpu_layer, link_layer = cpu_s / fraction, link_s / (1 - fraction)
    return link_layer / (cpu_layer + link_layer)


def time_together(state: HostLayers, fraction: float) -> tuple[float, float]:
    """The first host layer's projections split at `fraction` for one token, as a decode step
    runs them: the CPU's rows in a worker thread while the link copies the rest into a
    staging slot; (CPU seconds, link seconds), each the best of RUNS after a warm-up."""
    state.place(fraction, layers=1)
    parts = state.projections[0]
    inputs = [torch.randn(1, p.in_features, dtype=state.dtype) for p in parts]
    cuda = state.device.type == "cuda"

    def cpu_side() -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            for p, x in zip(parts, inputs, strict=True):
                if p.cpu_rows:  # the parts the CPU has none of (cpu_shares) stay out
                    p.cpu_linear(x)
        return time.perf_counter() - start

    def once(pool: ThreadPoolExecutor) -> tuple[float, float]:
        start = time.perf_counter()
        cpu = pool.submit(cpu_side)
        for p, staged in zip(parts, state.slots[0], strict=True):
            p.stage(staged, p.cpu_rows)
        if cuda:
            torch.cuda.synchronize(state.device)
        link = time.perf_counter() - start
        return cpu.result(), link

    with ThreadPoolExecutor(1, thread_name_prefix="host-calibrate") as pool:
        once(pool)
        runs = [once(pool) for _ in range(RUNS)]
    return min(r[0] for r in runs), min(r[1] for r in runs)


def calibrate_host_layer(state: HostLayers, config: EngineConfig) -> LatencyModel:
    """Time the first host layer's projections on the CPU (every row, in the CPU kernels'
    form) at CALIBRATION_TOKENS, and the copy of every row into a staging slot (the link);
    device_topology.cpu.bandwidth_gbps, when set, replaces the CPU's weight-read time, as
    experts/latency.calibrate does."""
    parts = state.projections[0]
    for p in parts:
        p.set_cpu_rows(p.out_features, state.dtype)
    lo, hi = CALIBRATION_TOKENS
    inputs = [torch.randn(hi, p.in_features, dtype=state.dtype) for p in parts]
    cpu, device = torch.device("cpu"), state.device

    def on_cpu(n: int) -> None:
        for p, x in zip(parts, inputs, strict=True):
            p.cpu_linear(x[:n])

    def copy() -> None:
        for p, staged in zip(parts, state.slots[0], strict=True):
            p.stage(staged, 0)

    with torch.inference_mode():
        t_lo, t_hi = (best_of(RUNS, partial(on_cpu, n), cpu) for n in (lo, hi))
        link_s = best_of(RUNS, copy, device)
    per_token = max((t_hi - t_lo) / (hi - lo), 0.0)
    fixed = max(t_lo - lo * per_token, 0.0)
    if config.cpu_bandwidth_gbps is not None:
        fixed = state.layer_bytes / (config.cpu_bandwidth_gbps * 1e9)
    link = state.layer_bytes / link_s if link_s > 0 else math.inf
    return LatencyModel(fixed, per_token, link, state.layer_bytes)


def _empty_host_cache() -> None:
    """Give the pinned host blocks the moves left cached back (torch.accelerator's call from
    torch 2.13; the CUDA caching host allocator's own call before it, as on torch 2.11)."""
    empty = getattr(torch.accelerator, "empty_host_cache", None) or getattr(
        torch._C, "_host_emptyCache", None
    )
    if empty is not None:
        empty()
