"""The host memory budget (device_topology.cpu.memory_mb), checked before anything is allocated:
the Warm pool (kv_cache.warm_region_mb), the Cold tier behind it (at most as much again: its
lz4 records of Warm blocks) and Cold-Weights' experts in their stored format must fit. Without
a budget, 90 % of the memory the kernel reports available (MemAvailable) is the limit.

Under the daemons the Warm pool and the expert arena are POSIX shared memory, which lives in
the /dev/shm tmpfs: they must fit its free space too, or the first write past it would kill
the daemon with SIGBUS instead of an error.
"""

from __future__ import annotations

import os

from hybridgen.config.engine import EngineConfig
from hybridgen.engine.memory import MIB, BudgetTooSmall
from hybridgen.experts.arena import arena_bytes
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


SHM_DIR = "/dev/shm"


def shm_free_bytes() -> int | None:
    """Free space of the shared-memory tmpfs; None where there is none to ask."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def host_need(config: EngineConfig, spec: ModelSpec) -> dict[str, int]:
    """Bytes each host tier will hold at most."""
    warm = int(config.warm_pool_mb * MIB)
    experts = 0
    if config.expert_cache_slots is not None and spec.num_local_experts:
        experts = arena_bytes(spec, config.expert_format, spec.moe_layer_count)
    return {"warm": warm, "cold": warm, "experts": experts}


def check_host_budget(config: EngineConfig, spec: ModelSpec, experts_made: bool = False) -> None:
    """BudgetTooSmall, naming the keys, when the host tiers cannot fit. `experts_made`: the
    model was loaded before, its experts already in host memory (and counted out of what is
    free)."""
    need = host_need(config, spec)
    if experts_made:
        need["experts"] = 0
    total = sum(need.values())
    if total == 0:
        return
    # The Warm pool is a tmpfs file even when private (unlinked, still mapped); the expert
    # arena is one under the daemons.
    in_shm = need["warm"] + (need["experts"] if config.shm_instance is not None else 0)
    shm_free = shm_free_bytes()
    if shm_free is not None and in_shm > shm_free:
        raise BudgetTooSmall(
            f"{SHM_DIR} has {shm_free // MIB} MiB free, and the Warm pool "
            f"({need['warm'] // MIB} MiB, kv_cache.warm_region_mb) and the expert arena "
            f"({need['experts'] // MIB} MiB, cold_weights.expert_format={config.expert_format}) "
            f"need {in_shm // MIB} MiB of it. Lower them, or enlarge {SHM_DIR} "
            f"(mount -o remount,size=<bytes> {SHM_DIR})"
        )
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
