"""The facts about a loaded engine that GetModelInfo reports, as dicts keyed by its fields."""

from __future__ import annotations

from typing import Any

import torch

from hybridgen.engine.engine import Engine, PassCounts
from hybridgen.placement.op_regions import Region, gpu_bound_regions

MIB = 2**20


def engine_info(engine: Engine) -> dict[str, Any]:
    """Model and pool facts that stay fixed after load, keyed by GetModelInfo field names."""
    spec, config = engine.spec, engine.config
    return {
        "model": spec.name,
        "architecture": spec.architecture,
        "family": spec.family,
        "synthetic": spec.synthetic,
        "vocab_size": spec.vocab_size,
        "max_model_len": engine.max_model_len,
        "dtype": str(spec.dtype).removeprefix("torch."),
        "device": str(engine.device),
        "kv_block_size": config.block_size,
        "kv_blocks_total": engine.plan.num_blocks,
        "max_num_seqs": config.max_num_seqs,
        "eos_token_ids": sorted(engine.eos_ids),
        "mode": config.mode,
        "spill_policy": config.spill_policy if engine.warm is not None else "off",
        "op_regions": [r.as_dict() for r in engine_regions(engine)],
    }


def moe_info(engine: Engine) -> dict[str, float | int]:
    """Cold-Weights counters, keyed by GetModelInfo field names (all 0 without it)."""
    s = engine.moe_stats()
    return {
        "expert_cache_hit_rate": s["cache_hit_rate"],
        "cpu_experts": int(s["cpu_experts"]),
        "cpu_daemon_experts": int(s["cpu_daemon_experts"]),
        "gpu_experts": int(s["gpu_experts"]),
        "expert_bytes_h2d": int(s["bytes_h2d"]),
    }


def host_layer_info(engine: Engine) -> dict[str, float | int | str]:
    """weights.gpu_layers: layers by placement and bytes moved per token, keyed by
    GetModelInfo field names (every layer on the device without host layers)."""
    host = engine.host_layers
    if host is None:
        return {"gpu_layers": engine.spec.num_layers, "host_layers": 0}
    return host.placement()


def step_info(engine: Engine) -> dict[str, dict[int, float]]:
    """The step budget's measured decode-only step and the part of a step with decodes and
    prefill beside its prefill (ms) by batch size bucket (engine/step_budget.py), keyed by
    GetModelInfo field names."""
    times = engine.step_times
    return {
        "decode_step_ms": {rows: s * 1e3 for rows, s in times.decode.items()},
        "mixed_step_ms": {rows: s * 1e3 for rows, s in times.mixed.items()},
    }


def launch_info(engine: Engine) -> dict[str, float]:
    """The step budget's measured host time to launch an eager forward pass (ms; 0 until
    measured, and where steps run as they are called), keyed by GetModelInfo field name."""
    launch = engine.step_times.launch
    return {"eager_launch_ms": 0.0 if launch is None else launch * 1e3}


def counter_info(engine: Engine) -> dict[str, float | int | str]:
    """What the engine thread's figures say now, as scalars keyed by GetModelInfo field
    names: the tiers (Engine.tier_stats), the expert cache, the host layers and the launch
    floor; both the GPU daemon's stats and the in-process backend publish these."""
    return {
        **engine.tier_stats(),
        **moe_info(engine),
        **host_layer_info(engine),
        **launch_info(engine),
        **{f"step_s_{phase}": s for phase, s in engine.stats.seconds.items()},
        **pass_info(engine.stats.passes),
    }


def pass_info(passes: dict[str, PassCounts]) -> dict[str, int]:
    """Forward passes by phase, keyed by GetModelInfo field names: step_n_<phase>,
    step_rows_<phase> (decode rows) and, where prompts are computed, step_tokens_<phase>."""
    out = {}
    for phase, c in passes.items():
        out[f"step_n_{phase}"], out[f"step_rows_{phase}"] = c.passes, c.rows
        if phase != "decode":
            out[f"step_tokens_{phase}"] = c.prompt_tokens
    return out


def memory_info(device: torch.device) -> dict[str, float]:
    """Device memory figures that change while serving, keyed by GetModelInfo field names.
    They read only the CUDA caching allocator's counters, which are thread-safe, so any
    thread may ask (not only the one that steps the engine)."""
    return {"gpu_mem_peak_reserved_mb": peak_reserved_mb(device)}


def peak_reserved_mb(device: torch.device) -> float:
    """torch.cuda.max_memory_reserved in MiB; 0 on a CPU device. The engine resets the peak
    once while it sizes its KV pool (after the weights are on the device), so this covers
    weights, KV pool, graphs and every step served since."""
    if device.type != "cuda":
        return 0.0
    return torch.cuda.max_memory_reserved(device) / MIB


def engine_regions(engine: Engine) -> list[Region]:
    """The op-region table of this engine: what runs where, and why (placement/op_regions.py)."""
    config, warm, degraded = engine.config, engine.warm, engine.degrade.active
    profiled: dict[str, dict[str, float]] = {}
    for region, key, value in config.profile_measured:
        profiled.setdefault(region, {})[key] = value

    def source(name: str, measured: bool = False, shifted: bool = False) -> str:
        if degraded and shifted:  # moved toward the CPU by backpressure (degrade.py)
            return "degrade"
        if name in config.pinned_regions:
            return "pinned"
        if name in config.profiled_regions:
            return "profile"
        return "measured" if measured else "default"

    rows = gpu_bound_regions()
    if warm is None:
        rows.append(Region("attn_warm", "layer", "hybrid-aware", "off", "no Warm tier"))
        rows.append(Region("kv_codec", "step", "hybrid-aware", "off", "no Warm tier"))
    else:
        place = f"split:{warm.split:.3f}" if warm.mode == "split" else warm.mode
        timed = engine.measured.get("attn_warm")
        figures = dict(timed.measured if timed is not None else profiled.get("attn_warm", {}))
        how = source("attn_warm", timed is not None, shifted=warm.mode != "cpu")
        tuned = warm.tuner.updates if warm.tuner is not None else 0
        if tuned and how != "degrade":  # re-balanced from live timings (tuner.py)
            how, figures["tuned_updates"] = "tuned", tuned
        rows.append(Region("attn_warm", "layer", "hybrid-aware", place, how, figures))
        codec = engine.measured.get("kv_codec")
        rows.append(
            Region(
                "kv_codec",
                "step",
                "hybrid-aware",
                warm.codec_on,
                source("kv_codec", codec is not None),
                codec.measured if codec is not None else profiled.get("kv_codec", {}),
            )
        )
    if engine.spec.num_local_experts:
        gate = engine.measured.get("moe_gate")
        rows.append(
            Region(
                "moe_gate",
                "layer",
                "hybrid-aware",
                config.moe_gate_placement if gate is None else gate.placement,
                source("moe_gate", gate is not None),
                {} if gate is None else gate.measured,
            )
        )
        rows.append(_moe_experts_row(engine))
    sample, d = engine.degrade.sample_placement, engine.degrade
    shifted = sample != d.normal_sample
    timed = engine.measured.get("sample")
    figures = dict(timed.measured if timed is not None else profiled.get("sample", {}))
    # offload_threshold.softmax decides where the degrade path's softmax goes.
    figures["degrade_softmax_mflops"] = d.softmax_mflops
    figures["softmax_threshold_mflops"] = d.softmax_threshold
    how = source("sample", timed is not None, shifted=shifted)
    rows.append(Region("sample", "step", "hybrid-aware", sample, how, figures))
    return rows


def _moe_experts_row(engine: Engine) -> Region:
    """Cold-Weights: experts on the CPU or through the device cache, per the latency model;
    without it every expert is resident on the device."""
    if engine.experts is None:
        return Region("moe_experts", "layer", "hybrid-aware", "gpu", "default")
    cache, latency = engine.experts
    figures: dict[str, float] = dict(latency.figures())
    figures["cache_slots"] = cache.capacity
    figures["cache_hit_rate"] = engine.moe_stats()["cache_hit_rate"]
    # 1: the CPU daemon computes beside the device, and a layer's misses are balanced between
    # the two; 0: each miss goes where it alone is faster (expert_latency.py).
    figures["overlapped"] = float(cache.remote is not None)
    how = "pinned" if engine.config.expert_cpu_max_tokens is not None else "measured"
    return Region("moe_experts", "layer", "hybrid-aware", "cpu+cache", how, figures)
