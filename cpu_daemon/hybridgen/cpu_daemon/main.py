"""Entry point of the CPU daemon (systemd unit hybridgen-cpu.service).

    python -m hybridgen.cpu_daemon.main --config C [--model M] [--instance I] --listen unix:PATH

Attaches to the GPU daemon's rings, serves the public GenerationService to the gateway over
a unix socket (detokenization, stop strings and streaming happen here), and tells systemd
READY once the GPU daemon has reported its model. If the GPU daemon dies, in-flight
requests end with UNAVAILABLE and the process exits non-zero so that it is restarted with
its peer.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses

import structlog

from hybridgen.config import sections as config_sections
from hybridgen.config.file import ConfigError, load_config
from hybridgen.cpu_daemon.ring_backend import RingBackend
from hybridgen.experts.link import ExpertLinkWorker
from hybridgen.ipc.channels import Channels
from hybridgen.kvtiers.warm_link import WarmLinkWorker
from hybridgen.models.errors import ModelLoadError
from hybridgen.models.tokenizer_source import load_tokenizer
from hybridgen.runtime import log as hlog
from hybridgen.runtime.affinity import bind, cpu_daemon_cores
from hybridgen.runtime.prestart import wait_for_go
from hybridgen.runtime.process_exit import exit_with
from hybridgen.runtime.startup_error import startup_failed
from hybridgen.serving.metrics import Metrics
from hybridgen.serving.server import serve

log = structlog.get_logger()

_DRAIN_GRACE_S = 2.0
"""On shutdown, how long the gateway's streams through this socket may finish."""
PEER_DEAD = 3
"""Exit status when the GPU daemon died: systemd (or `hybridgen serve`) restarts the pair."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="HybridGen CPU daemon")
    ap.add_argument("--config", default=None, help="hybridgen_config.yaml (default: built-in)")
    ap.add_argument("--model", default=None, help="override model.name_or_path")
    ap.add_argument("--instance", default=None, help="override server.instance")
    ap.add_argument(
        "--listen",
        default=None,
        help="unix:PATH for the gateway (default: <server.runtime_dir>/cpu.sock)",
    )
    ap.add_argument(
        "--device",
        default="auto",
        help="the GPU daemon's --device: on a GPU this daemon leaves it "
        "device_topology.cpu.gpu_daemon_cores of its cores",
    )
    ap.add_argument(
        "--attach-timeout",
        type=float,
        default=600.0,
        help="seconds to wait for the GPU daemon's rings",
    )
    return ap.parse_args(argv)


def socket_settings(server: config_sections.ServerConfig) -> config_sections.ServerConfig:
    """The server section as this daemon's socket uses it. The gateway in front enforces the
    public limits (keys, TLS, timeouts, streams per client) and serves metrics and HTTP; this
    socket is the daemons' own (mode 0660), and takes the gateway's one connection and
    whatever message size it lets through."""
    return dataclasses.replace(
        server,
        metrics_port=0,
        http_port=0,
        request_timeout_s=0.0,
        max_streams_per_connection=config_sections.ServerConfig.max_streams_per_connection,
        tls=config_sections.TlsConfig(),
        api_key_file=None,
    )


async def run(backend: RingBackend, listen: str, server: config_sections.ServerConfig) -> int:
    """Serve until stopped -> 0, or PEER_DEAD when the GPU daemon died first (not when it
    stops after this daemon was told to: systemd's stop, or SIGTERM to both at once)."""
    stop = asyncio.Event()
    peer_died_first = False

    async def watch_peer() -> None:
        nonlocal peer_died_first
        while backend.dead is None:
            await asyncio.sleep(0.05)
        peer_died_first = not stop.is_set()
        stop.set()  # drain and stop: the streams already failed

    watcher = asyncio.create_task(watch_peer())
    socket = socket_settings(server)
    await serve(backend, socket, Metrics(), listen, _DRAIN_GRACE_S, watchdog=False, stop=stop)
    # (the heartbeat pings the watchdog)
    watcher.cancel()
    return PEER_DEAD if peer_died_first else 0


def main(argv: list[str] | None = None) -> int:
    wait_for_go()  # started ahead by serve's supervisor: its imports are done, its turn waits
    args = parse_args(argv)
    hlog.configure(json=True)
    try:
        config = load_config(args.config)
        cpu = config.device_topology.cpu
        cores = cpu_daemon_cores(cpu.cores, cpu.gpu_daemon_cores, args.device)
        bind(cores, "device_topology.cpu.cores")
    except ConfigError as e:
        return startup_failed("hybridgen-cpu", str(e))
    config = config.with_model(args.model)
    instance = args.instance or config.server.instance
    listen = args.listen or f"unix:{config.server.runtime_dir}/cpu.sock"
    structlog.contextvars.bind_contextvars(process="cpu_daemon", instance=instance)
    try:
        tokenizer = load_tokenizer(config.model.name_or_path)
    except ModelLoadError as e:
        return startup_failed("hybridgen-cpu", str(e))
    channels = Channels.attach(instance, wait=args.attach_timeout)
    workers: list[WarmLinkWorker | ExpertLinkWorker] = []
    if config.warm_pool_mb:  # the GPU daemon asks for attn_warm's CPU share
        workers.append(WarmLinkWorker(instance))
    if config.cold_weights.expert_cache_slots is not None:  # ... and Cold-Weights' CPU experts
        workers.append(ExpertLinkWorker(instance))
    for worker in workers:
        worker.start()
    try:
        backend = RingBackend(channels, tokenizer)
        return asyncio.run(run(backend, listen, config.server))
    finally:
        for worker in workers:
            worker.stop()
        channels.close()


if __name__ == "__main__":
    exit_with(main)
