"""The schema of hybridgen_config.yaml: frozen dataclasses checked by one generic walk.

Types come from the annotations (Literal: choices; `X | None`: optional), ranges from the
field metadata, so no section has a parser of its own. Errors name the dotted key
(`kv_cache.hot_region_mb`) and what is allowed. An empty file, or none, gives the defaults.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

import structlog
import torch
import yaml

from hybridgen.config_schema import (
    StrictLoader,
    at_least,
    between,
    build,
    checked,
    parse_cpu_list,
)
from hybridgen.engine_config import ConfigError, EngineConfig
from hybridgen.tuning_profile import (
    TuningProfile,
    load_profile,
    resolve_placements,
    warn_mismatch,
)

__all__ = ["ConfigError", "HybridGenConfig", "load_config", "parse_config", "parse_cpu_list"]

log = structlog.get_logger()
T = TypeVar("T")
Device = Literal["cpu", "gpu"]
DeviceOrSplit = Literal["cpu", "gpu", "split"]
_INSTANCE = re.compile(r"[A-Za-z0-9_-]{1,32}")
_POSITIVE: tuple[Callable[[Any], object], str] = (lambda v: v > 0, "> 0")
_NONEMPTY: tuple[Callable[[Any], object], str] = (lambda v: v.strip() != "", "a non-empty string")


@dataclass(frozen=True)
class GpuTopology:
    """The GPU the daemon drives."""

    id: int = at_least(0, 0)
    """CUDA device index."""
    memory_mb: int | None = at_least(None, 64)
    """Hard budget for everything the GPU daemon allocates; null: 90 % of free memory."""
    bandwidth_gbps: float | None = checked(None, *_POSITIVE)
    """Device memory bandwidth for the placement cost model (Cold-Weights' latency model:
    a fetched expert's time on the device); null: measured at start."""


@dataclass(frozen=True)
class CpuTopology:
    """The host CPUs and memory the CPU daemon uses."""

    cores: tuple[int, ...] | None = field(default=None, metadata={"parse": parse_cpu_list})
    """CPUs to bind to, as "0-15" or "0,2,4-7"; null: the process's current affinity."""
    memory_mb: int | None = at_least(None, 64)
    """Host memory budget for Warm-KV, Cold tiers and experts; null: derived from free RAM."""
    bandwidth_gbps: float | None = checked(None, *_POSITIVE)
    """Host memory bandwidth for the placement cost model (Cold-Weights' latency model: the
    CPU's time to read an expert); null: measured at start."""


@dataclass(frozen=True)
class DeviceTopology:
    """The machine, as the placement cost model sees it."""

    gpu: GpuTopology = field(default_factory=GpuTopology)
    """The GPU."""
    cpu: CpuTopology = field(default_factory=CpuTopology)
    """The host CPUs."""


@dataclass(frozen=True)
class KvCacheConfig:
    """KV tiers: Hot on the GPU, Warm compressed in host shm, Cold aged out of Warm."""

    hot_region_mb: float | None = checked(None, *_POSITIVE)
    """GPU memory for Hot-KV blocks (fractions allowed); null: what the GPU budget leaves
    after weights and workspace."""
    warm_region_mb: int | None = at_least(None, 0)
    """Host shm for Warm-KV blocks after compression; null or 0: no Warm tier."""
    cold_threshold_ms: int = at_least(150, 1)
    """A warm block untouched this long is moved to Cold."""
    hot_codec: Literal["native", "int8", "int4"] = "native"
    """Hot-KV storage: the model dtype, or int8/int4 dequantized inside the attention kernel."""
    warm_codec: Literal["lossless", "lz4", "int8", "int4"] = "int8"
    """Warm-KV storage: lossless (as is), lz4, int8 (~2:1) or int4 group-quant (~4:1)."""
    block_size: Literal[8, 16, 32, 64, 128] = 16
    """Tokens per KV block, in every tier."""
    prefix_reuse: bool = True
    """Reuse the KV of a cached token prefix (a shared system prompt, a chat's earlier turns)
    instead of computing it again."""


@dataclass(frozen=True)
class OffloadThreshold:
    """Work per step (MFLOPs) at or above which a region runs on the GPU, below it the CPU."""

    softmax: float = at_least(12000.0, 0)
    """Softmax of the degrade path."""
    layernorm: float = at_least(800.0, 0)
    """RMSNorm / LayerNorm."""
    rotary_emb: float = at_least(5000.0, 0)
    """Rotary position embedding."""


@dataclass(frozen=True)
class DynamicTuning:
    """Re-measuring placements while serving (costs a little CPU; a profile avoids it)."""

    enable: bool = True
    """Re-place regions from live timings every update_interval_ms."""
    warmup_steps: int = at_least(32, 0)
    """Steps served before the first measurement."""
    update_interval_ms: int = at_least(500, 1)
    """Period of the placement update."""


@dataclass(frozen=True)
class Placements:
    """Pinned placements of the regions that can run on either device; null: measured."""

    rope: Device | None = None
    """Rotary embedding (overrides offload_threshold.rotary_emb)."""
    norm: Device | None = None
    """RMSNorm / LayerNorm (overrides offload_threshold.layernorm)."""
    softmax: Device | None = None
    """Softmax of the degrade path, the sampler's: cpu lets backpressure move it (and the
    pick) to the CPU daemon, gpu keeps it on the device; null: offload_threshold.softmax
    decides."""
    attn_warm: DeviceOrSplit | None = None
    """Attention over Warm-KV: CPU partials, blocks sent to the GPU, or a measured split."""
    moe_gate: Device | None = None
    """The MoE router's softmax and top-k: on the device, or its logits to the host, where
    the CPU picks each token's experts."""
    moe_experts: DeviceOrSplit | None = None
    """MoE experts kept in host memory: CPU compute, transfer to the GPU, or a split."""
    kv_codec: Device | None = None
    """Warm-KV quantize / dequantize."""
    sample: Device | None = None
    """Sampling from the logits."""

    def _validate(self, prefix: str) -> None:
        # A placement that would change nothing is refused rather than silently ignored.
        for name in ("rope", "norm"):
            if getattr(self, name) == "cpu":
                raise ConfigError(
                    f"{prefix}{name}='cpu' is out of range: allowed gpu or null ({name} runs "
                    "fused into the GPU's attention and projection kernels)"
                )
        if self.moe_experts is not None:
            raise ConfigError(
                f"{prefix}moe_experts={self.moe_experts!r} is out of range: allowed null "
                "(no MoE model is served yet)"
            )


@dataclass(frozen=True)
class ModelConfig:
    """The model to serve."""

    name_or_path: str = checked("tiny-llama", *_NONEMPTY)
    """An HF checkpoint directory or a synthetic preset name (llama3-8b, tiny-llama, ...)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weights and activations; auto: the checkpoint's (presets: bf16 on GPU, fp32 on CPU)."""
    max_model_len: int | None = at_least(None, 16)
    """Longest sequence; null: the model's, capped by what the KV tiers hold."""
    max_num_seqs: int = between(64, 1, 4096)
    """Sequences running at once."""
    max_num_batched_tokens: int = at_least(2048, 1)
    """Tokens per step; longer prompts are prefilled in chunks."""
    seed: int = at_least(0, 0)
    """Seed of synthetic preset weights."""

    def _validate(self, prefix: str) -> None:
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ConfigError(
                f"{prefix}max_num_batched_tokens={self.max_num_batched_tokens} is out of range: "
                f"allowed >= {prefix}max_num_seqs ({self.max_num_seqs})"
            )


@dataclass(frozen=True)
class ServerConfig:
    """The gateway's public endpoint and the processes' shared names."""

    host: str = checked("127.0.0.1", *_NONEMPTY)
    """Address the gRPC API listens on (0.0.0.0 or :: for every interface)."""
    port: int = between(50051, 1, 65535)
    """gRPC API port."""
    metrics_port: int = between(9400, 0, 65535)
    """Prometheus /metrics port; 0: no metrics endpoint."""
    instance: str = checked("default", _INSTANCE.fullmatch, "1-32 of [A-Za-z0-9_-]")
    """Instance name; shared memory segments are /hybridgen-<instance>-*."""
    max_queue: int = at_least(256, 1)
    """Requests waiting for admission; beyond it the gateway answers RESOURCE_EXHAUSTED."""
    max_message_mb: int = between(16, 1, 2047)
    """Largest gRPC message either way."""
    keepalive_s: float = checked(30.0, *_POSITIVE)
    """gRPC keepalive ping period, so dead clients free their sequences."""
    request_timeout_s: float = at_least(600.0, 0)
    """Longest a request may run before DEADLINE_EXCEEDED; 0: no limit."""
    runtime_dir: str = checked("/run/hybridgen", lambda v: v.startswith("/"), "an absolute path")
    """Folder of the daemons' unix sockets (systemd's RuntimeDirectory=hybridgen)."""

    def _validate(self, prefix: str) -> None:
        if self.metrics_port == self.port:
            raise ConfigError(
                f"{prefix}metrics_port={self.metrics_port} is out of range: "
                f"allowed a port other than {prefix}port"
            )


@dataclass(frozen=True)
class ColdWeightsConfig:
    """MoE experts kept in host memory (Cold-Weights); dense models ignore it."""

    expert_cache_slots: int | Literal["auto"] | None = checked(
        None, lambda v: v == "auto" or v >= 1, ">= 1 or auto"
    )
    """Device slots of the expert cache, shared by all layers; each routed expert is computed
    on the CPU or fetched into it, whichever the latency model says is faster. auto: what the
    budget leaves after the weights, the step workspace and the Hot pool (hot_region_mb, or
    its minimum), up to every expert. null: every expert stays on the device."""
    cpu_max_tokens: int | None = at_least(None, 0)
    """Pins the latency model's crossover: an uncached expert with at most this many routed
    tokens runs on the CPU, more are fetched into the cache. null: timed at start."""
    expert_format: Literal["native", "int8", "int4"] = "native"
    """Format of the experts in host memory and in the device cache: native (the checkpoint's
    dtype: exact), int8 (per output channel, ~2:1 against bf16) or int4 (groups of 32,
    ~3.6:1); converted at load. int8 and int4 need expert_cache_slots."""


@dataclass(frozen=True)
class HybridGenConfig:
    """hybridgen_config.yaml."""

    device_topology: DeviceTopology = field(default_factory=DeviceTopology)
    """The GPU and CPU, and their budgets."""
    kv_cache: KvCacheConfig = field(default_factory=KvCacheConfig)
    """KV tiers."""
    offload_threshold: OffloadThreshold = field(default_factory=OffloadThreshold)
    """Default placement of the small regions by their work per step."""
    dynamic_tuning: DynamicTuning = field(default_factory=DynamicTuning)
    """Live re-placement."""
    profile_path: str | None = checked(None, *_NONEMPTY)
    """tuning_profile.json from hybridgen-profiler, relative to this file; null: none."""
    placements: Placements = field(default_factory=Placements)
    """Regions pinned by hand, over every measurement."""
    cold_weights: ColdWeightsConfig = field(default_factory=ColdWeightsConfig)
    """MoE experts in host memory."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The model."""
    server: ServerConfig = field(default_factory=ServerConfig)
    """The public endpoint."""
    mode: Literal["hybrid", "pure_gpu"] = "hybrid"
    """hybrid: CPU and GPU as partners; pure_gpu: no Warm-KV, nothing placed on the CPU (it
    only detokenizes and streams), the baseline for many short requests."""

    def _validate(self, prefix: str) -> None:
        hot, budget = self.kv_cache.hot_region_mb, self.device_topology.gpu.memory_mb
        if hot is not None and budget is not None and hot > budget:
            raise ConfigError(
                f"kv_cache.hot_region_mb={hot:g} is out of range: "
                f"allowed <= device_topology.gpu.memory_mb ({budget})"
            )
        slots, fmt = self.cold_weights.expert_cache_slots, self.cold_weights.expert_format
        if fmt != "native" and slots is None:
            raise ConfigError(
                f"cold_weights.expert_format={fmt!r} is out of range: allowed native with "
                "cold_weights.expert_cache_slots null (int8 and int4 experts live in host "
                "memory and the device cache; set expert_cache_slots)"
            )
        if self.mode == "pure_gpu" and slots is not None:
            raise ConfigError(
                f"cold_weights.expert_cache_slots={slots} is out of range: allowed null with "
                "mode=pure_gpu (Cold-Weights computes experts on the CPU)"
            )
        if self.mode == "pure_gpu":
            warm = self.kv_cache.warm_region_mb
            if warm:
                raise ConfigError(
                    f"kv_cache.warm_region_mb={warm} is out of range: "
                    "allowed 0 or null with mode=pure_gpu"
                )
            for name, value in dataclasses.asdict(self.placements).items():
                if value not in (None, "gpu"):
                    raise ConfigError(
                        f"placements.{name}={value!r} is out of range: "
                        "allowed gpu or null with mode=pure_gpu"
                    )

    def with_model(self, model: str | None) -> HybridGenConfig:
        """The same config serving `model` instead (a command-line override); None: unchanged."""
        if model is None:
            return self
        return dataclasses.replace(self, model=dataclasses.replace(self.model, name_or_path=model))

    @property
    def warm_pool_mb(self) -> int:
        """The Warm tier's host memory: kv_cache.warm_region_mb in hybrid mode; 0 (no Warm
        tier, so no Cold tier and no ATTN_WARM rings) when unset or in pure_gpu mode."""
        return (self.kv_cache.warm_region_mb or 0) if self.mode == "hybrid" else 0

    def tuning_profile(self) -> TuningProfile | None:
        """The profile at profile_path (checked: a bad one is a ConfigError naming its key);
        None when unset, or, with a warning, when no file is there yet: the engine then
        measures at start as without one."""
        if self.profile_path is None:
            return None
        path = Path(self.profile_path)
        if not path.exists():
            log.warning(
                "tuning_profile_missing",
                profile_path=str(path),
                hint="run hybridgen-profiler to write it, or set profile_path: null",
            )
            return None
        return load_profile(path)

    def engine_config(self, device: str = "auto") -> EngineConfig:
        """The model engine's config; "cuda" (and "auto" with CUDA) means device_topology.gpu.
        Placements: pinned (`placements`) > the tuning profile (profile_path) > measured at
        start > default. In pure_gpu mode every placement is the GPU and the profile is not
        read."""
        if device == "cuda" or (device == "auto" and torch.cuda.is_available()):
            device = f"cuda:{self.device_topology.gpu.id}"
        m, pure_gpu = self.model, self.mode == "pure_gpu"
        profile = None if pure_gpu else self.tuning_profile()
        if profile is not None:
            warn_mismatch(profile, m.name_or_path, device)
        # pinned > profile here; measured (the Warm tier's probe for "auto") > default below.
        placed = resolve_placements(dataclasses.asdict(self.placements), profile)
        return EngineConfig(
            model=m.name_or_path,
            device=device,
            dtype=m.dtype,
            gpu_memory_mb=self.device_topology.gpu.memory_mb,
            host_memory_mb=self.device_topology.cpu.memory_mb,
            cpu_bandwidth_gbps=self.device_topology.cpu.bandwidth_gbps,
            gpu_bandwidth_gbps=self.device_topology.gpu.bandwidth_gbps,
            block_size=self.kv_cache.block_size,
            max_num_seqs=m.max_num_seqs,
            max_num_batched_tokens=m.max_num_batched_tokens,
            max_model_len=m.max_model_len,
            kv_pool_mb=self.kv_cache.hot_region_mb,
            hot_codec=self.kv_cache.hot_codec,
            warm_pool_mb=self.warm_pool_mb,
            warm_codec=self.kv_cache.warm_codec,
            cold_threshold_ms=self.kv_cache.cold_threshold_ms,
            attn_warm="gpu" if pure_gpu else placed.attn_warm or "auto",
            warm_split=placed.warm_split,
            prefix_reuse=self.kv_cache.prefix_reuse,
            # Unpinned and without a profile: the engine times both at start on a GPU
            # (gpu_daemon/region_timing.py); these are where it starts from.
            sample_placement="gpu" if pure_gpu else placed.sample or "gpu",
            kv_codec_placement="gpu" if pure_gpu else placed.kv_codec or "gpu",
            moe_gate_placement="gpu" if pure_gpu else self.placements.moe_gate or "gpu",
            degrade_softmax=self.placements.softmax or "auto",
            softmax_threshold_mflops=self.offload_threshold.softmax,
            pinned_regions=tuple(
                name for name, v in dataclasses.asdict(self.placements).items() if v is not None
            ),
            # A profile replaces runtime profiling; pure_gpu has nothing to tune.
            dynamic_tuning=self.dynamic_tuning.enable and profile is None and not pure_gpu,
            tuning_warmup_steps=self.dynamic_tuning.warmup_steps,
            tuning_interval_ms=self.dynamic_tuning.update_interval_ms,
            expert_cache_slots=self.cold_weights.expert_cache_slots,
            expert_format=self.cold_weights.expert_format,
            expert_cpu_max_tokens=self.cold_weights.cpu_max_tokens,
            profiled_regions=placed.profiled,
            profile_measured=placed.measured,
            seed=m.seed,
            mode=self.mode,
        )


def parse_config(data: Mapping[str, Any] | None) -> HybridGenConfig:
    """Check a parsed YAML document against the schema; None: all defaults."""
    return build(HybridGenConfig, data, "")


def load_config(path: str | Path | None) -> HybridGenConfig:
    """Read hybridgen_config.yaml; None: all defaults. Errors name the file and the key."""
    if path is None:
        return HybridGenConfig()
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from exc
    try:
        data = yaml.load(text, Loader=StrictLoader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        raise ConfigError(f"{where}: invalid YAML: {exc.problem or exc.context}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: invalid YAML: {exc}") from exc
    try:
        config = parse_config(data)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from exc
    profile = config.profile_path
    if profile is not None and not Path(profile).is_absolute():
        # Relative to the file, not to the working directory (systemd starts units in /).
        config = dataclasses.replace(config, profile_path=str(path.parent / profile))
    return config
