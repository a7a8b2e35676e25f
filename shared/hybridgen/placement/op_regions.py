"""Op-Regions: the named pieces of a decode step, their affinity labels and where each runs.

DESIGN.md "Op-Regions". Every decoder layer is cut into the same regions, and a few run once
per step::

    per layer:  norm -> qkv_proj -> rope -> attn_hot --+-> attn_merge -> o_proj -> norm -> mlp
                                            attn_warm -+
    per step:   lm_head -> sample;  kv_codec (Hot <-> Warm moves)

Labels: `gpu-bound` regions read weights or Hot-KV that live in GPU memory, or are fused into
the GPU's kernels, so they run there; `hybrid-aware` regions run on either device with the
same results (exact modes), and their placement is chosen. Where a placement comes from, in
order of precedence:

    degrade    moved toward the CPU by backpressure, while it lasts (placement/degrade.py;
               offload_threshold.softmax decides whether the sampler's softmax may move)
    tuned      attn_warm's split re-balanced from live timings (placement/tuner.py)
    pinned     the config's `placements` (or mode: pure_gpu, which pins every region to gpu)
    profile    a tuning_profile.json from hybridgen-profiler (config `profile_path`)
    measured   timed on both devices at start: the Warm tier's probe for attn_warm,
               placement/region_timing.py for sample and kv_codec (on a GPU)
    default    the measured default recorded in bench/NOTES.md

This module only describes; the engine and the daemons do the placing, and report what they
chose (engine/info.py `engine_regions`). The table is what `hybridgen serve --explain`
prints and what GetModelInfo returns.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

Label = Literal["gpu-bound", "cpu-bound", "hybrid-aware"]
Scope = Literal["layer", "step"]

GPU_BOUND_LAYER = ("norm", "qkv_proj", "rope", "attn_hot", "attn_merge", "o_proj", "mlp")
"""Layer regions that run inside the GPU's kernels (rope and norm are fused into them)."""
SWITCHABLE = ("attn_warm", "kv_codec", "sample")
"""Regions that run on either device with identical results in exact modes."""


@dataclass(frozen=True)
class Region:
    """One row of the table."""

    name: str
    scope: Scope
    label: Label
    placement: str
    """gpu, cpu, split:<CPU share> or off (the region has no work in this engine)."""
    source: str
    """degrade, tuned, pinned, profile, measured, default, or fixed (gpu-bound)."""
    measured: Mapping[str, float] = field(default_factory=dict)
    """The figures behind the placement, e.g. cpu_ms / gpu_ms of the same work."""

    def as_dict(self) -> dict[str, object]:
        return {
            "name": self.name,
            "scope": self.scope,
            "label": self.label,
            "placement": self.placement,
            "source": self.source,
            "measured": dict(self.measured),
        }


def gpu_bound_regions() -> list[Region]:
    """The fixed part of the table: per-layer work and the LM head stay on the GPU."""
    rows = [Region(n, "layer", "gpu-bound", "gpu", "fixed") for n in GPU_BOUND_LAYER]
    rows.append(Region("lm_head", "step", "gpu-bound", "gpu", "fixed"))
    return rows


def format_table(regions: Sequence[Region]) -> str:
    """The table as text, one region per line."""
    lines = [f"{'region':11} {'scope':6} {'label':13} {'placement':12} {'source':9} measured"]
    for r in regions:
        figures = ", ".join(f"{k}={v:.4g}" for k, v in r.measured.items()) or "-"
        lines.append(
            f"{r.name:11} {r.scope:6} {r.label:13} {r.placement:12} {r.source:9} {figures}"
        )
    return "\n".join(lines)
