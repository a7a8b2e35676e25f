"""The host memory budget (device_topology.cpu.memory_mb), checked before anything is allocated:
the Warm pool (kv_cache.warm_region_mb), the Cold tier behind it (at most as much again: its
lz4 records of Warm blocks) and Cold-Weights' experts in their stored format must fit. Without
a budget, 90 % of the memory the kernel reports available (MemAvailable) is the limit.
"""

from __future__ import annotations

from hybridgen.engine_config import EngineConfig
from hybridgen.gpu_daemon.memory import MIB, BudgetTooSmall
from hybridgen.models.expert_arena import arena_bytes
from hybridgen.models.spec import ModelSpec

AVAILABLE_SHARE = 0.9
"""Of MemAvailable, what the tiers may take when cpu.memory_mb is unset."""


def available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo; None where there is none."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def host_need(config: EngineConfig, spec: ModelSpec) -> dict[str, int]:
    """Bytes each host tier will hold at most."""
    warm = int(config.warm_pool_mb * MIB)
    experts = 0
    if config.expert_cache_slots is not None and spec.num_local_experts:
        experts = arena_bytes(spec, config.expert_format, spec.num_layers)
    return {"warm": warm, "cold": warm, "experts": experts}


def check_host_budget(config: EngineConfig, spec: ModelSpec) -> None:
    """BudgetTooSmall, naming the keys, when the host tiers cannot fit."""
    need = host_need(config, spec)
    total = sum(need.values())
    if total == 0:
        return
    if config.host_memory_mb is not None:
        budget = config.host_memory_mb * MIB
        where = f"device_topology.cpu.memory_mb={config.host_memory_mb}"
    else:
        available = available_bytes()
        if available is None:
            return
        budget = int(available * AVAILABLE_SHARE)
        where = f"the host's available memory ({budget // MIB} MiB; cpu.memory_mb unset)"
    if total > budget:
        raise BudgetTooSmall(
            f"{where} is too small for the host tiers: Warm {need['warm'] // MIB} MiB "
            f"(kv_cache.warm_region_mb) and up to as much for Cold, experts "
            f"{need['experts'] // MIB} MiB (cold_weights.expert_format={config.expert_format}); "
            f"{total // MIB} MiB in all. Lower kv_cache.warm_region_mb, choose a smaller "
            "expert_format, or raise device_topology.cpu.memory_mb"
        )
