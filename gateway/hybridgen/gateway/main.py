"""Entry point of the gateway (systemd unit hybridgen-gateway.service; `hybridgen serve` runs
it too): the public gRPC API in front of the CPU daemon's unix socket.

    python -m hybridgen.gateway.main --config C [--upstream unix:PATH] [--host H] [--port N]
        [--metrics-port N] [--http-port N] [--api-key-file F]

Every setting comes from the config's `server` section: TLS, API keys, message and stream
limits, keepalive, request timeout, reflection, metrics, and the OpenAI HTTP port (with the
same TLS and keys). The flags override what `hybridgen
serve` and the systemd unit set from outside (the unit passes the key file that systemd's
LoadCredential= copies into $CREDENTIALS_DIRECTORY). The upstream defaults to
<server.runtime_dir>/cpu.sock, where the CPU daemon listens.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses

import structlog

from hybridgen.config.file import ConfigError, load_config
from hybridgen.config.sections import ServerConfig
from hybridgen.gateway.proxy_backend import ProxyBackend
from hybridgen.runtime import log as hlog
from hybridgen.runtime.prestart import wait_for_go
from hybridgen.runtime.process_exit import exit_with
from hybridgen.runtime.startup_error import startup_failed
from hybridgen.serving.metrics import Metrics
from hybridgen.serving.server import serve

log = structlog.get_logger()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m hybridgen.gateway.main", description=__doc__)
    ap.add_argument("--config", default=None, help="hybridgen_config.yaml (default: built-in)")
    ap.add_argument("--upstream", default=None, help="the CPU daemon, unix:PATH")
    ap.add_argument("--host", default=None, help="override server.host")
    ap.add_argument("--port", type=int, default=None, help="override server.port")
    ap.add_argument("--metrics-port", type=int, default=None, help="override server.metrics_port")
    ap.add_argument("--http-port", type=int, default=None, help="override server.http_port")
    ap.add_argument("--api-key-file", default=None, help="override server.api_key_file")
    return ap.parse_args(argv)


_FLAGS = ("host", "port", "metrics_port", "http_port", "api_key_file")
"""The server keys a flag overrides."""


def with_flags(section: ServerConfig, args: argparse.Namespace) -> ServerConfig:
    """The config's server section with the flags given on the command line."""
    given = {k: getattr(args, k) for k in _FLAGS if getattr(args, k) is not None}
    return dataclasses.replace(section, **given)


def main(argv: list[str] | None = None) -> int:
    wait_for_go()  # started ahead by serve's supervisor: its imports are done, its turn waits
    args = parse_args(argv)
    hlog.configure(json=True)
    try:
        section = load_config(args.config).server
    except ConfigError as exc:
        return startup_failed("hybridgen-gateway", str(exc))
    server = with_flags(section, args)
    upstream = args.upstream or f"unix:{section.runtime_dir}/cpu.sock"
    structlog.contextvars.bind_contextvars(process="gateway", instance=section.instance)
    metrics = Metrics()
    backend = ProxyBackend(upstream, metrics, section.max_message_bytes)
    with contextlib.suppress(KeyboardInterrupt):
        try:
            asyncio.run(serve(backend, server, metrics))
        except (ConfigError, OSError) as exc:  # an unreadable key or certificate file, the
            # address or the metrics port in use (logged by serve): restarting cannot help
            return startup_failed("hybridgen-gateway", str(exc))
        except Exception:
            log.exception("gateway_failed")
            return 1
    return 0


if __name__ == "__main__":
    exit_with(main)
