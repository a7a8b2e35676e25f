"""The gateway's server: grpc.aio with GenerationService, health, reflection, a Prometheus
endpoint, hybridgen_config.yaml's server section (config/sections.py ServerConfig: limits,
keepalive, TLS, API keys, ports), over a Backend:
EngineBackend (the model in this process), the gateway's ProxyBackend (forwards to a daemon
serving the same API) or the CPU daemon's RingBackend. The gateway's main runs it as the
product's gateway process, the CPU daemon's main on its unix socket, and
`python -m hybridgen.gateway.standalone` in one process for development and tests.

Start-up order: the port opens first with health NOT_SERVING (clients see UNAVAILABLE while
the model loads), then the backend loads and health turns SERVING. SIGTERM/SIGINT drain:
health NOT_SERVING, new calls UNAVAILABLE, running streams get `grace_s` to finish, and those
still running STOP_MARGIN_S before it ends get UNAVAILABLE (HTTP: 503, or an error event and
[DONE] on a stream) saying the server is stopping. The
process's own choices beside the section (where to listen, how long to drain) are serve's
arguments.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import os
import signal
import socket
import stat
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from hybridgen.config.engine import ConfigError
from hybridgen.config.sections import ServerConfig, TlsConfig
from hybridgen.runtime import sd_notify
from hybridgen.serving.auth import ApiKeys, AuthInterceptor
from hybridgen.serving.backend import Backend
from hybridgen.serving.http_server import HttpServer
from hybridgen.serving.metrics import Metrics
from hybridgen.serving.openai_http import OpenAIApi
from hybridgen.serving.service import SERVICE_NAME, GenerationService, add_to_server

log = structlog.get_logger()

_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
# How often the health status follows backend.ready() (a dead backend turns NOT_SERVING).
# Matches ProxyBackend's upstream poll, so that the gateway's health follows a daemon's
# within about half a second.
_HEALTH_POLL_S = 0.25
# A unix socket's mode: owner and group (the other daemons' service group) may connect.
_UNIX_SOCKET_MODE = 0o660


DRAIN_GRACE_S = 10.0
"""On shutdown, how long the gateway's running streams may finish before they are cancelled
(the supervisor's stop timeout outlasts it)."""
STOP_MARGIN_S = 1.0
"""Calls still running this long before the grace ends are ended by the service, with a
status their clients read (ServerStopping), rather than cut off with the connection."""
WARM_WAIT_S = 60.0
"""Longest the gateway waits for the HTTP API's model facts before it reports READY (the
load goes on after, and the first call waits for it)."""


def listen_address(config: ServerConfig, listen: str | None) -> str:
    """The gRPC address to bind: `listen` (host:port or unix:/path), else server.host:port."""
    return listen if listen is not None else f"{config.host}:{config.port}"


# Clients may ping (without calls in flight) at most this often, or keepalive_s if shorter;
# more often is a strike, and _PING_STRIKES of them get GOAWAY (too_many_pings).
_MIN_CLIENT_PING_MS = 10_000
_PING_STRIKES = 2


def grpc_options(config: ServerConfig) -> list[tuple[str, int]]:
    keepalive_ms = round(config.keepalive_s * 1000)
    return [
        # One server per port: a second one must fail to bind, not share the port silently.
        ("grpc.so_reuseport", 0),
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.max_concurrent_streams", config.max_streams_per_connection),
        ("grpc.keepalive_time_ms", keepalive_ms),
        ("grpc.keepalive_timeout_ms", keepalive_ms),
        # What closes the connection of an unanswered ping (grpcio 1.85: the line above alone
        # does not).
        ("grpc.http2.ping_timeout_ms", keepalive_ms),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),  # the server's own pings are not capped
        # The least time between two client pings (grpc's name for the *received* interval).
        ("grpc.http2.min_ping_interval_without_data_ms", min(keepalive_ms, _MIN_CLIENT_PING_MS)),
        ("grpc.http2.max_ping_strikes", _PING_STRIKES),
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
    """The bound gRPC port (not meaningful for a unix socket)."""
    address: str
    """The bound address, host:port or unix:/path."""
    keys: ApiKeys | None = None
    """server.api_key_file's keys, which the HTTP port asks for too; None: no keys."""


async def build(
    backend: Backend, config: ServerConfig, metrics: Metrics, listen: str | None = None
) -> Gateway:
    """Create the server with every service registered and bound to `listen` (host:port or
    unix:/path; None: config.host:port, port 0 picks a free one); ConfigError for an
    unreadable key or certificate file, OSError when the address cannot be bound."""
    interceptors = []
    keys = ApiKeys.load(config.api_key_file) if config.api_key_file is not None else None
    if keys is not None:
        interceptors.append(AuthInterceptor(keys))
    credentials = _credentials(config.tls) if config.tls.enabled else None
    server = grpc.aio.server(options=grpc_options(config), interceptors=interceptors)
    service = GenerationService(backend, metrics, config.max_queue, config.request_timeout_s)
    add_to_server(service, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    await _set_health(health_servicer, _NOT_SERVING)
    if config.reflection:
        names = (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME)
        reflection.enable_server_reflection(names, server)
    wanted = listen_address(config, listen)
    path = unix_path(wanted)
    if path is not None:
        remove_stale_socket(path)
    port = _bind(server, wanted, credentials)
    if path is not None:
        os.chmod(path, _UNIX_SOCKET_MODE)  # bound above: the file exists now
        address = wanted
    else:
        address = f"{wanted.rsplit(':', 1)[0]}:{port}"
    metrics.queue_depth.set_function(backend.queue_depth)
    return Gateway(server, service, health_servicer, port, address, keys)


def _credentials(tls: TlsConfig) -> grpc.ServerCredentials:
    """Server credentials from the PEM files; mutual TLS when client_ca_file is set."""
    files = {k: v for k, v in dataclasses.asdict(tls).items() if v is not None}
    pem: dict[str, bytes] = {}
    for name, path in files.items():
        try:
            pem[name] = Path(path).read_bytes()
        except OSError as exc:
            raise ConfigError(f"server.tls.{name}={path!r}: cannot read it: {exc}") from exc
    ca = pem.get("client_ca_file")
    return grpc.ssl_server_credentials(
        [(pem["key_file"], pem["cert_file"])],
        root_certificates=ca,
        require_client_auth=ca is not None,
    )


def _bind(server: grpc.aio.Server, address: str, credentials: grpc.ServerCredentials | None) -> int:
    """Bind `address`; OSError saying why when it cannot be (grpc says only "Failed to bind")."""
    try:
        if credentials is None:
            return server.add_insecure_port(address)
        return server.add_secure_port(address, credentials)
    except RuntimeError as exc:
        raise OSError(f"cannot listen on {address}: {_bind_problem(address) or exc}") from exc


def _bind_problem(address: str) -> str | None:
    """Why a TCP address cannot be bound, asked of the OS (None: it can, or not TCP)."""
    host, _, port = address.rpartition(":")
    if unix_path(address) is not None or not port.isdigit():
        return None
    try:
        with socket.create_server((host.strip("[]"), int(port))):
            return None
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            return (
                "the port is in use (another gateway?); stop that program or pick another port "
                "(server.port, --port N)"
            )
        return exc.strerror


def unix_path(address: str) -> str | None:
    """The socket path of a unix:PATH or unix://PATH address; None for host:port."""
    if address.startswith("unix://"):
        return address.removeprefix("unix://")
    if address.startswith("unix:"):
        return address.removeprefix("unix:")
    return None


def remove_stale_socket(path: str) -> None:
    """Remove a socket file left by a dead server; refuse a live one or a non-socket file."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise RuntimeError(f"{path} exists and is not a socket; refusing to replace it")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(path)
        except OSError:
            os.unlink(path)  # nobody listens: stale
            return
    raise RuntimeError(f"{path} is in use by a running server")


async def _set_health(servicer: health.aio.HealthServicer, status: int) -> None:
    for name in ("", SERVICE_NAME):
        await servicer.set(name, status)


async def _follow_backend(
    gateway: Gateway, backend: Backend, serving: bool, watchdog: float | None
) -> None:
    """Keep health in step with the backend: NOT_SERVING while it is dead, down or draining;
    ping systemd's watchdog every `watchdog` seconds (None: no watchdog)."""
    current = _SERVING if serving else _NOT_SERVING
    pinged = 0.0
    while True:
        await asyncio.sleep(_HEALTH_POLL_S)
        wanted = _SERVING if backend.ready() and not gateway.service.draining else _NOT_SERVING
        if wanted != current:
            report = log.info if wanted == _SERVING else log.warning
            report("health_changed", serving=wanted == _SERVING)
            await _set_health(gateway.health, wanted)
            current = wanted
        now = time.monotonic()
        if watchdog is not None and now - pinged >= watchdog:
            sd_notify.watchdog()
            pinged = now


def _serve_metrics(metrics: Metrics, config: ServerConfig) -> None:
    """The /metrics endpoint; OSError naming the key and the flag when it cannot listen."""
    try:
        metrics.serve(config.metrics_port, config.metrics_host)
    except OSError as exc:
        log.error(
            "cannot_serve_metrics",
            address=f"{config.metrics_host}:{config.metrics_port}",
            error=str(exc),
            hint="free the port, or set server.metrics_port (0: no metrics endpoint)",
        )
        raise OSError(
            f"server.metrics_port {config.metrics_port} on {config.metrics_host}: "
            f"{exc.strerror or exc}; free it, or pick another: --metrics-port N (0: none)"
        ) from exc


async def serve(
    backend: Backend,
    config: ServerConfig,
    metrics: Metrics,
    listen: str | None = None,
    grace_s: float = DRAIN_GRACE_S,
    watchdog: bool = True,
    stop: asyncio.Event | None = None,
) -> None:
    """Run until SIGTERM/SIGINT (or `stop` is set: the caller's own reason), then drain:
    running streams get `grace_s` to finish. `listen`: as build's. `metrics` is shared with
    the backend, which sets its own gauges. Tells systemd READY once serving; `watchdog`:
    ping its watchdog from the event loop (a process whose own loop pings it passes False)."""
    if config.metrics_port:
        _serve_metrics(metrics, config)
    try:
        gateway = await build(backend, config, metrics, listen)
    except (ConfigError, OSError) as exc:  # address in use, stale-socket refusal, bad files
        log.error("cannot_listen", address=listen_address(config, listen), error=str(exc))
        raise
    await gateway.server.start()
    started = await _start_http(gateway, config, grace_s)
    http, api = started if started is not None else (None, None)
    log.info("gateway_listening", address=gateway.address, metrics=config.metrics_port)
    stop = stop if stop is not None else asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await backend.start()
    except Exception:
        log.exception("backend_failed_to_start")
        await gateway.server.stop(0)
        if http is not None:
            await http.stop()
        raise
    # A proxy's upstream may not be up yet; the watcher turns health SERVING when it is.
    serving = backend.ready()
    if api is not None:  # the HTTP API's model facts before READY (else its first call loads)
        warming = asyncio.create_task(api.warm())
        if serving:
            await asyncio.wait({warming}, timeout=WARM_WAIT_S)
    await _set_health(gateway.health, _SERVING if serving else _NOT_SERVING)
    log.info("gateway_serving" if serving else "gateway_waiting", address=gateway.address)
    sd_notify.ready(f"{'serving' if serving else 'waiting for the model'} on {gateway.address}")
    interval = sd_notify.watchdog_interval_s() if watchdog else None
    watcher = asyncio.create_task(_follow_backend(gateway, backend, serving, interval))
    await stop.wait()
    log.info("gateway_draining", grace_s=grace_s)
    sd_notify.stopping()
    gateway.service.draining = True
    gateway.service.stop_calls_at(loop.time() + max(grace_s - STOP_MARGIN_S, 0.0))
    watcher.cancel()
    await _set_health(gateway.health, _NOT_SERVING)
    stopping = [gateway.server.stop(grace_s), *([http.stop()] if http else [])]
    await asyncio.gather(*stopping)
    await backend.stop()
    path = unix_path(gateway.address)
    if path is not None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    log.info("gateway_stopped")


async def _start_http(
    gateway: Gateway, config: ServerConfig, grace_s: float
) -> tuple[HttpServer, OpenAIApi] | None:
    """The OpenAI API on config.http_port, over the gRPC service's admission and backend."""
    if not config.http_port:
        return None
    keys = gateway.keys
    allows = keys.allows if keys is not None else None
    api = OpenAIApi(gateway.service, allows, config.max_message_bytes, config.cors_origins)
    http = HttpServer(api.app(), config.host, config.http_port, grace_s, config.tls)
    try:
        port = await http.start()
    except OSError as exc:
        log.error("cannot_listen", address=f"{config.host}:{config.http_port}", error=str(exc))
        await gateway.server.stop(0)
        raise
    log.info("http_listening", address=f"{config.host}:{port}")
    return http, api
