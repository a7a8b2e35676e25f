"""Entry point of the GPU daemon (systemd unit hybridgen-gpu.service).

    python -m hybridgen.gpu_daemon.main --config hybridgen_config.yaml [--model M] [--instance I]

Creates the shared-memory rings (replacing stale ones from a crashed run), loads the model
with progress, tells systemd READY, runs the heartbeat loop, and on a clean stop (SIGTERM or
a SHUTDOWN ticket) removes every segment it created.
"""

from __future__ import annotations

import argparse
import dataclasses
import signal
from types import FrameType

import structlog
import torch

from hybridgen.config.file import ConfigError, load_config
from hybridgen.engine.engine import Engine
from hybridgen.engine.memory import BudgetTooSmall
from hybridgen.experts.link import ExpertLinkClient
from hybridgen.gpu_daemon.heartbeat import GpuHeartbeat
from hybridgen.ipc import shm
from hybridgen.ipc.channels import Channels, InstanceInUse
from hybridgen.kvtiers.warm_link import WarmLinkClient
from hybridgen.models.errors import ModelLoadError
from hybridgen.runtime import log as hlog
from hybridgen.runtime import sd_notify
from hybridgen.runtime.affinity import bind, cpu_daemon_cores
from hybridgen.runtime.process_exit import exit_with
from hybridgen.runtime.startup_error import startup_failed

log = structlog.get_logger()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="HybridGen GPU daemon")
    ap.add_argument("--config", default=None, help="hybridgen_config.yaml (default: built-in)")
    ap.add_argument("--model", default=None, help="override model.name_or_path")
    ap.add_argument("--instance", default=None, help="override server.instance")
    ap.add_argument("--device", default="auto")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    hlog.configure(json=True)
    try:
        config = load_config(args.config)
        bind(config.device_topology.cpu.cores, "device_topology.cpu.cores")
    except ConfigError as e:
        return startup_failed("hybridgen-gpu", str(e))
    config = config.with_model(args.model)
    instance = args.instance or config.server.instance
    structlog.contextvars.bind_contextvars(process="gpu_daemon", instance=instance)
    try:
        channels = Channels.create(instance)
    except InstanceInUse as e:  # not retried: the other process keeps it until it stops
        log.error("instance_in_use", error=str(e))
        return startup_failed("hybridgen-gpu", str(e))
    try:
        sd_notify.status("loading model")
        try:
            engine_config = config.engine_config(args.device)
            cpu = config.device_topology.cpu  # the CPU daemon's pool computes the CPU's experts
            threads = len(cpu_daemon_cores(cpu.cores, cpu.gpu_daemon_cores, args.device))
            engine = Engine(
                dataclasses.replace(
                    engine_config, shm_instance=instance, cpu_expert_threads=threads
                )
            )
        except (ConfigError, ModelLoadError, BudgetTooSmall) as e:  # the same on every try
            return startup_failed("hybridgen-gpu", str(e))
        except torch.OutOfMemoryError as e:
            first = str(e).splitlines()[0]
            return startup_failed(
                "hybridgen-gpu",
                f"out of device memory at start ({first}); lower device_topology.gpu.memory_mb "
                "(--gpu-memory-mb), or free the GPU",
            )
        if engine.warm is not None:  # the CPU daemon computes the CPU share of attn_warm
            engine.warm.remote = WarmLinkClient(instance)
        if engine.experts is not None:  # ... and Cold-Weights' CPU experts
            engine.experts[0].remote = ExpertLinkClient(instance)
        loop = GpuHeartbeat(engine, channels)

        def stop(signum: int, frame: FrameType | None) -> None:
            loop.stopping = True

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        sd_notify.ready(f"serving {engine.spec.name}")
        log.info("gpu_daemon_ready", model=engine.spec.name)
        status = loop.run()
        engine.close()
    finally:
        sd_notify.stopping()
        channels.close()
        removed = shm.unlink_all(instance)
        log.info("gpu_daemon_stopped", removed_segments=len(removed))
    return status


if __name__ == "__main__":
    exit_with(main)
