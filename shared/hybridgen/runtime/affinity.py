"""Binding a process to CPU cores: device_topology.cpu.cores for both daemons, the CPU daemon
on all but device_topology.cpu.gpu_daemon_cores of them (its Warm-attention and expert
workers then run on those cores), --cpu-cores for hybridgen.tools.device_checker."""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

import structlog
import torch

from hybridgen.config.engine import ConfigError

log = structlog.get_logger()


def format_cores(cores: Iterable[int]) -> str:
    """The cpulist spelling of `cores` ("0-3,8"), the inverse of config_schema.parse_cpu_list."""
    runs: list[list[int]] = []
    for core in sorted(set(cores)):
        if runs and core == runs[-1][1] + 1:
            runs[-1][1] = core
        else:
            runs.append([core, core])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def check_cores(
    cores: Sequence[int], key: str, available: Iterable[int] | None = None
) -> list[int]:
    """`cores`, all of which this process may use (or `available`); else a ConfigError naming
    `key` and the allowed cores."""
    available = set(os.sched_getaffinity(0) if available is None else available)
    missing = sorted(set(cores) - available)
    if missing:
        raise ConfigError(
            f"{key}={format_cores(cores)!r} is out of range: cores {format_cores(missing)} are "
            f"not available to this process; allowed: cores {format_cores(available)}"
        )
    return sorted(set(cores))


def cpu_daemon_cores(
    cores: Sequence[int] | None,
    gpu_daemon_cores: int,
    device: str,
    available: Iterable[int] | None = None,
) -> list[int]:
    """The CPU daemon's cores: `cores` (or every core this process may use, or `available`)
    less the last `gpu_daemon_cores` of them, which the GPU daemon's thread keeps for itself
    while it spins on the device; at least one core. With the engine on the CPU (`device`,
    the GPU daemon's --device) it takes them all: the GPU daemon then waits for the CPU
    daemon's answers asleep, and a core left out would only idle."""
    pool = sorted(set(os.sched_getaffinity(0) if available is None else available))
    if cores is not None:
        pool = check_cores(cores, "device_topology.cpu.cores", pool)
    on_gpu = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    return pool[: max(len(pool) - (gpu_daemon_cores if on_gpu else 0), 1)]


def bind(cores: Sequence[int] | None, key: str) -> list[int]:
    """Bind this process to `cores` and size torch's intra-op pool to them, one thread per
    bound core; None keeps the process's affinity and torch's own choice. Returns the cores."""
    if cores is None:
        return sorted(os.sched_getaffinity(0))
    chosen = check_cores(cores, key)
    os.sched_setaffinity(0, chosen)
    torch.set_num_threads(len(chosen))
    log.info("bound", cores=format_cores(chosen), threads=len(chosen))
    return chosen
