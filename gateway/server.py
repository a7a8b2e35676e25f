"""The gateway process: grpc.aio server with GenerationService, health, reflection and a
Prometheus endpoint, over a Backend (EngineBackend in this single-process build).

    python -m hybridgen.gateway.server --model tiny-llama --port 50051

Start-up order: the port opens first with health NOT_SERVING (clients see UNAVAILABLE while
the model loads), then the backend loads and health turns SERVING. SIGTERM/SIGINT drain:
health NOT_SERVING, new calls UNAVAILABLE, running streams get `grace_s` to finish.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
from dataclasses import dataclass

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from hybridgen import log as hlog
from hybridgen.engine_config import ConfigError, EngineConfig
from hybridgen.gateway.backend import Backend, EngineBackend
from hybridgen.gateway.metrics import Metrics
from hybridgen.gateway.service import SERVICE_NAME, GenerationService, add_to_server

log = structlog.get_logger()

_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
# How often the health status follows backend.ready() (a dead backend turns NOT_SERVING).
_HEALTH_POLL_S = 1.0


@dataclass(frozen=True)
class ServerConfig:
    """How the gateway listens (the `server` section of the configuration)."""

    host: str = "127.0.0.1"
    """Address to bind; loopback unless asked, since the API has no authentication."""
    port: int = 50051
    """gRPC port; 0 picks a free one."""
    metrics_port: int = 9400
    """Prometheus /metrics port; 0 disables the endpoint."""
    max_queue: int = 64
    """Requests that may wait for the engine before Generate answers RESOURCE_EXHAUSTED."""
    max_message_bytes: int = 64 * 1024 * 1024
    """Largest request or response message (long token-id prompts)."""
    keepalive_time_ms: int = 30_000
    """Server pings an idle connection this often."""
    keepalive_timeout_ms: int = 10_000
    """A ping unanswered this long closes the connection."""
    grace_s: float = 10.0
    """On shutdown, how long running streams may finish before they are cancelled."""


def grpc_options(config: ServerConfig) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.keepalive_time_ms", config.keepalive_time_ms),
        ("grpc.keepalive_timeout_ms", config.keepalive_timeout_ms),
        ("grpc.keepalive_permit_without_calls", 1),
        # Accept client keepalive pings down to 10 s apart instead of answering GOAWAY.
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
        ("grpc.http2.max_pings_without_data", 0),
    ]


@dataclass(frozen=True)
class Gateway:
    """A built, not yet started server and its parts."""

    server: grpc.aio.Server
    """The grpc.aio server."""
    service: GenerationService
    """The GenerationService servicer."""
    health: health.aio.HealthServicer
    """grpc.health.v1 servicer."""
    port: int
    """The bound gRPC port."""


async def build(backend: Backend, config: ServerConfig, metrics: Metrics) -> Gateway:
    """Create the server with every service registered and the port bound."""
    server = grpc.aio.server(options=grpc_options(config))
    service = GenerationService(backend, metrics, config.max_queue)
    add_to_server(service, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    await _set_health(health_servicer, _NOT_SERVING)
    names = (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    port = server.add_insecure_port(f"{config.host}:{config.port}")
    metrics.queue_depth.set_function(backend.queue_depth)
    return Gateway(server, service, health_servicer, port)


async def _set_health(servicer: health.aio.HealthServicer, status: int) -> None:
    for name in ("", SERVICE_NAME):
        await servicer.set(name, status)


async def _follow_backend(gateway: Gateway, backend: Backend) -> None:
    """Keep health in step with the backend: NOT_SERVING once it dies or drains."""
    current = _SERVING
    while True:
        await asyncio.sleep(_HEALTH_POLL_S)
        wanted = _SERVING if backend.ready() and not gateway.service.draining else _NOT_SERVING
        if wanted != current:
            log.warning("health_changed", serving=wanted == _SERVING)
            await _set_health(gateway.health, wanted)
            current = wanted


async def serve(backend: Backend, config: ServerConfig, metrics: Metrics) -> None:
    """Run until SIGTERM/SIGINT, then drain. `metrics` is shared with the backend, which
    sets its own gauges."""
    if config.metrics_port:
        metrics.serve(config.metrics_port, config.host)
    gateway = await build(backend, config, metrics)
    await gateway.server.start()
    log.info("gateway_listening", host=config.host, port=gateway.port, metrics=config.metrics_port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await backend.start()
    except Exception:
        log.exception("backend_failed_to_start")
        await gateway.server.stop(0)
        raise
    await _set_health(gateway.health, _SERVING)
    log.info("gateway_serving", port=gateway.port)
    watcher = asyncio.create_task(_follow_backend(gateway, backend))
    await stop.wait()
    log.info("gateway_draining", grace_s=config.grace_s)
    gateway.service.draining = True
    watcher.cancel()
    await _set_health(gateway.health, _NOT_SERVING)
    await gateway.server.stop(config.grace_s)
    await backend.stop()
    log.info("gateway_stopped")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m hybridgen.gateway.server", description=__doc__)
    p.add_argument("--model", default="tiny-llama", help="checkpoint directory or preset name")
    p.add_argument("--host", default=ServerConfig.host)
    p.add_argument("--port", type=int, default=ServerConfig.port)
    p.add_argument("--metrics-port", type=int, default=ServerConfig.metrics_port, help="0: off")
    p.add_argument("--max-queue", type=int, default=ServerConfig.max_queue)
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--gpu-memory-mb", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=EngineConfig.max_num_seqs)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--decode-steps", type=int, default=EngineConfig.decode_steps)
    p.add_argument("--log-console", action="store_true", help="readable logs instead of JSON")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    hlog.configure(json=not args.log_console)
    if args.max_queue < 1:
        log.error("bad_argument", key="max_queue", value=args.max_queue, allowed=">= 1")
        return 2
    try:
        engine = EngineConfig(
            model=args.model,
            device=args.device,
            dtype=args.dtype,
            gpu_memory_mb=args.gpu_memory_mb,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=max(EngineConfig.max_num_batched_tokens, args.max_num_seqs),
            max_model_len=args.max_model_len,
            decode_steps=args.decode_steps,
        )
    except ConfigError as exc:
        log.error("bad_argument", error=str(exc))
        return 2
    server = ServerConfig(
        host=args.host, port=args.port, metrics_port=args.metrics_port, max_queue=args.max_queue
    )
    metrics = Metrics()
    with contextlib.suppress(KeyboardInterrupt):
        try:
            asyncio.run(serve(EngineBackend(engine, metrics), server, metrics))
        except Exception:
            return 1  # already logged with its traceback
    return 0


if __name__ == "__main__":
    sys.exit(main())
