"""What each setting allows, declared once: the config file's schema (config/sections.py) and
EngineConfig (config/engine.py) both check against these tables, so that a range changed here
changes the error of `model.max_num_seqs` in the file and of EngineConfig's max_num_seqs alike.

RANGES holds the numeric settings, CHOICES the named ones, each by its dotted key in
hybridgen_config.yaml with the EngineConfig field it becomes (config/file.py engine_config).
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Any, Literal

MAX_DRAFT_TOKENS = 16
"""Most tokens drafted per Warm read (kv_cache.warm_draft_tokens); fewer where the model has
more than 7 query heads per kv head (warm_drafts.STACKED_HEADS)."""

MAX_TENSOR_PARALLEL = 8
"""Most ranks of tensor parallel: the GPUs of one host."""

Dtype = Literal["auto", "float32", "bfloat16", "float16"]
BlockSize = Literal[8, 16, 32, 64, 128]
HotCodec = Literal["native", "int8", "int4"]
WarmCodec = Literal["lossless", "lz4", "int8", "int4"]
SpillPolicy = Literal["auto", "always", "never"]
Device = Literal["cpu", "gpu"]
DeviceOrSplit = Literal["cpu", "gpu", "split"]
WeightsFormat = Literal["native", "int8", "int4"]
HostLayerCompute = Literal["auto", "cpu", "stream", "split"]
ExpertFormat = Literal["native", "int8", "int4"]
Mode = Literal["hybrid", "pure_gpu"]


@dataclass(frozen=True)
class Range:
    """The numbers one setting allows: from low (or above it), up to high."""

    low: float
    """The smallest value allowed (with `above`: the value it must exceed)."""
    high: float | None = None
    """The largest value allowed; None: no upper bound."""
    above: bool = False
    """Values must exceed low ("> 0") instead of reaching it (">= 64")."""
    auto: bool = False
    """"auto" is allowed too: the engine picks the number at start."""
    note: str = ""
    """What else bounds the value, said after the range in errors."""

    def allows(self, value: object) -> bool:
        """Whether `value` is in the range (a bool is no number here)."""
        if isinstance(value, str):
            return self.auto and value == "auto"
        if isinstance(value, bool) or not isinstance(value, int | float):
            return False
        reached = value > self.low if self.above else value >= self.low
        return reached and (self.high is None or value <= self.high)

    @property
    def allowed(self) -> str:
        """The range in words, as errors say it: 1..4096, > 0, >= 0 (...) or auto."""
        if self.high is not None:
            words = f"{self.low}..{self.high}"
        else:
            words = f"{'>' if self.above else '>='} {self.low}"
        if self.note:
            words += f" ({self.note})"
        return words + (" or auto" if self.auto else "")


@dataclass(frozen=True)
class Ranged:
    """A numeric setting of the file and the EngineConfig field it becomes."""

    field: str
    """EngineConfig's name for it."""
    range: Range
    """What both allow (null / None aside, where the setting is optional)."""


@dataclass(frozen=True)
class Chosen:
    """A named setting of the file and the EngineConfig field it becomes."""

    field: str
    """EngineConfig's name for it."""
    hint: Any
    """The Literal of its choices, which the file's section annotates it with."""
    auto: bool = False
    """EngineConfig also takes "auto", what the file's null becomes (measured at start)."""

    @property
    def choices(self) -> tuple[object, ...]:
        """What EngineConfig allows, in order."""
        return typing.get_args(self.hint) + (("auto",) if self.auto else ())


RANGES: dict[str, Ranged] = {
    "device_topology.gpu.tensor_parallel": Ranged("tensor_parallel", Range(1, MAX_TENSOR_PARALLEL)),
    "device_topology.gpu.memory_mb": Ranged("gpu_memory_mb", Range(64)),
    "device_topology.gpu.bandwidth_gbps": Ranged("gpu_bandwidth_gbps", Range(0, above=True)),
    "device_topology.cpu.memory_mb": Ranged("host_memory_mb", Range(64)),
    "device_topology.cpu.bandwidth_gbps": Ranged("cpu_bandwidth_gbps", Range(0, above=True)),
    "kv_cache.hot_region_mb": Ranged("kv_pool_mb", Range(0, above=True)),
    "kv_cache.warm_region_mb": Ranged("warm_pool_mb", Range(0)),
    "kv_cache.cold_threshold_ms": Ranged("cold_threshold_ms", Range(1)),
    "kv_cache.hot_turn_tokens": Ranged("hot_turn_tokens", Range(0)),
    "kv_cache.warm_draft_tokens": Ranged("warm_draft_tokens", Range(0, MAX_DRAFT_TOKENS)),
    "offload_threshold.softmax": Ranged("softmax_threshold_mflops", Range(0)),
    "dynamic_tuning.warmup_steps": Ranged("tuning_warmup_steps", Range(0)),
    "dynamic_tuning.update_interval_ms": Ranged("tuning_interval_ms", Range(1)),
    "model.max_model_len": Ranged("max_model_len", Range(16)),
    "model.max_num_seqs": Ranged("max_num_seqs", Range(1, 4096)),
    "model.step_latency_ms": Ranged("step_latency_ms", Range(0.0, 10000.0)),
    "model.seed": Ranged("seed", Range(0)),
    "weights.gpu_layers": Ranged(
        "gpu_layers", Range(0, auto=True, note="up to the model's layers")
    ),
    "cold_weights.expert_cache_slots": Ranged("expert_cache_slots", Range(1, auto=True)),
    "cold_weights.cpu_max_tokens": Ranged("expert_cpu_max_tokens", Range(0)),
}
"""Numeric settings by their key in the file (the config/sections.py fields that `shared()`
declares); an optional one may also be null / None."""

CHOICES: dict[str, Chosen] = {
    "model.dtype": Chosen("dtype", Dtype),
    "kv_cache.block_size": Chosen("block_size", BlockSize),
    "kv_cache.hot_codec": Chosen("hot_codec", HotCodec),
    "kv_cache.warm_codec": Chosen("warm_codec", WarmCodec),
    "kv_cache.spill_policy": Chosen("spill_policy", SpillPolicy),
    "placements.attn_warm": Chosen("attn_warm", DeviceOrSplit, auto=True),
    "placements.sample": Chosen("sample_placement", Device),
    "placements.kv_codec": Chosen("kv_codec_placement", Device),
    "placements.moe_gate": Chosen("moe_gate_placement", Device),
    "placements.softmax": Chosen("degrade_softmax", Device, auto=True),
    "weights.format": Chosen("weights_format", WeightsFormat),
    "weights.host_layer_compute": Chosen("host_layer_compute", HostLayerCompute),
    "cold_weights.expert_format": Chosen("expert_format", ExpertFormat),
    "mode": Chosen("mode", Mode),
}
"""Named settings by their key in the file, whose section annotates it with `hint` (or
`hint | None`: null, where the engine then measures or defaults)."""
