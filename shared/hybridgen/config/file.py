"""hybridgen_config.yaml: HybridGenConfig (its sections are config/sections.py), the checks
that span sections, its mapping to the engine's EngineConfig, and loading.

Types come from the annotations (Literal: choices; `X | None`: optional), ranges from the
field metadata, so no section has a parser of its own. Errors name the dotted key
(`kv_cache.hot_region_mb`) and what is allowed. An empty file, or none, gives the defaults.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog
import yaml

from hybridgen.config.engine import ConfigError, EngineConfig
from hybridgen.config.ranges import Mode
from hybridgen.config.schema import (
    StrictLoader,
    build,
    checked,
    parse_cpu_list,
)
from hybridgen.config.sections import (
    NONEMPTY,
    ColdWeightsConfig,
    DeviceTopology,
    DynamicTuning,
    KvCacheConfig,
    ModelConfig,
    OffloadThreshold,
    Placements,
    ServerConfig,
    WeightsConfig,
)
from hybridgen.placement.tuning_profile import (
    TuningProfile,
    load_profile,
    resolve_placements,
    warn_mismatch,
)

__all__ = [
    "ConfigError",
    "HybridGenConfig",
    "load_config",
    "parse_config",
    "parse_cpu_list",
    "read_config_file",
]

log = structlog.get_logger()


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
    profile_path: str | None = checked(None, *NONEMPTY)
    """tuning_profile.json from hybridgen-profiler, relative to this file; null: none."""
    placements: Placements = field(default_factory=Placements)
    """Regions pinned by hand, over every measurement."""
    cold_weights: ColdWeightsConfig = field(default_factory=ColdWeightsConfig)
    """MoE experts in host memory."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The model."""
    weights: WeightsConfig = field(default_factory=WeightsConfig)
    """The dense weights' format on the device."""
    server: ServerConfig = field(default_factory=ServerConfig)
    """The public endpoint."""
    mode: Mode = "hybrid"
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

        self._check_tensor_parallel()

    def _check_tensor_parallel(self) -> None:
        """What tensor_parallel > 1 does not combine with (yet), by the keys that set it."""
        if self.device_topology.gpu.tensor_parallel == 1:
            return
        for key, value, allowed in (
            ("kv_cache.warm_region_mb", self.warm_pool_mb, 0),
            ("weights.gpu_layers", self.weights.gpu_layers, None),
            ("cold_weights.expert_cache_slots", self.cold_weights.expert_cache_slots, None),
            ("weights.format", self.weights.format, "native"),
            ("kv_cache.hot_codec", self.kv_cache.hot_codec, "native"),
        ):
            if value != allowed:
                shown = "null" if allowed is None else repr(allowed)
                raise ConfigError(
                    f"{key}={value!r} is out of range: allowed {shown} with "
                    "device_topology.gpu.tensor_parallel > 1 (each rank keeps its share of a "
                    "native Hot cache and every layer's weights on its GPU)"
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
        import torch  # here, not at the top: the gateway reads this file without torch

        if device == "cuda" or (device == "auto" and torch.cuda.is_available()):
            device = f"cuda:{self.device_topology.gpu.device_ids[0]}"
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
            step_latency_ms=m.step_latency_ms,
            max_model_len=m.max_model_len,
            kv_pool_mb=self.kv_cache.hot_region_mb,
            hot_codec=self.kv_cache.hot_codec,
            warm_pool_mb=self.warm_pool_mb,
            warm_codec=self.kv_cache.warm_codec,
            cold_threshold_ms=self.kv_cache.cold_threshold_ms,
            hot_turn_tokens=self.kv_cache.hot_turn_tokens,
            spill_policy=self.kv_cache.spill_policy,
            warm_draft_tokens=self.kv_cache.warm_draft_tokens,
            attn_warm="gpu" if pure_gpu else placed.attn_warm or "auto",
            warm_split=placed.warm_split,
            prefix_reuse=self.kv_cache.prefix_reuse,
            # Unpinned and without a profile: the engine times both at start on a GPU
            # (placement/region_timing.py); these are where it starts from.
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
            weights_format=self.weights.format,
            gpu_layers=self.weights.gpu_layers,
            host_layer_compute=self.weights.host_layer_compute,
            expert_cpu_max_tokens=self.cold_weights.cpu_max_tokens,
            tensor_parallel=self.device_topology.gpu.tensor_parallel,
            tensor_parallel_ids=self.device_topology.gpu.ids,
            profiled_regions=placed.profiled,
            profile_measured=placed.measured,
            seed=m.seed,
            mode=self.mode,
        )


def parse_config(data: Mapping[str, Any] | None) -> HybridGenConfig:
    """Check a parsed YAML document against the schema; None: all defaults."""
    return build(HybridGenConfig, data, "")


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The YAML document of a config file, unchecked ({} when empty); errors name the file and
    the line."""
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
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the config must be a mapping of keys, got {data!r}")
    return data


def load_config(path: str | Path | None) -> HybridGenConfig:
    """Read hybridgen_config.yaml; None: all defaults. Errors name the file and the key."""
    if path is None:
        return HybridGenConfig()
    path = Path(path)
    data = read_config_file(path)
    try:
        config = parse_config(data)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from exc
    return relative_to_file(config, path)


def relative_to_file(config: HybridGenConfig, path: Path) -> HybridGenConfig:
    """`config` with its relative file paths (profile_path, server.tls.*, server.api_key_file)
    taken relative to the file it was read from."""
    profile = config.profile_path
    if profile is not None:
        config = dataclasses.replace(config, profile_path=_beside(path, profile))
    return dataclasses.replace(config, server=_server_files_beside(path, config.server))


def _beside(config_path: Path, file: str) -> str:
    return file if Path(file).is_absolute() else str(config_path.parent / file)


def _server_files_beside(config_path: Path, server: ServerConfig) -> ServerConfig:
    """server's TLS and API key files, relative ones taken relative to the config file."""
    tls = {
        name: _beside(config_path, value)
        for name, value in dataclasses.asdict(server.tls).items()
        if value is not None
    }
    keys = server.api_key_file
    return dataclasses.replace(
        server,
        tls=dataclasses.replace(server.tls, **tls),
        api_key_file=None if keys is None else _beside(config_path, keys),
    )
