"""The gateway standalone, in one process (development and tests): the model loaded here
(EngineBackend), or `--upstream` forwarding to a daemon that serves the same API:

    python -m hybridgen.gateway.standalone --model tiny-llama --port 50051
    python -m hybridgen.gateway.standalone --model tiny-llama --listen unix:/run/hybridgen/cpu.sock
    python -m hybridgen.gateway.standalone --upstream unix:/run/hybridgen/cpu.sock --port 50051

The product's gateway is `python -m hybridgen.gateway.main` (`hybridgen serve` runs it).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys

import structlog

from hybridgen.config import schema
from hybridgen.config.engine import ConfigError, EngineConfig
from hybridgen.config.sections import ServerConfig
from hybridgen.gateway.proxy_backend import ProxyBackend
from hybridgen.runtime import log as hlog
from hybridgen.serving.backend import Backend
from hybridgen.serving.engine_backend import EngineBackend
from hybridgen.serving.metrics import Metrics
from hybridgen.serving.server import serve

log = structlog.get_logger()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m hybridgen.gateway.standalone", description=__doc__)
    p.add_argument("--model", default="tiny-llama", help="checkpoint directory or preset name")
    p.add_argument("--host", default=ServerConfig.host)
    p.add_argument("--port", type=int, default=ServerConfig.port)
    p.add_argument("--listen", default=None, help="host:port or unix:/path (default: HOST:PORT)")
    p.add_argument(
        "--upstream",
        default=None,
        help="forward to the GenerationService at this address (e.g. unix:/path/cpu.sock) "
        "instead of loading --model here",
    )
    p.add_argument("--metrics-port", type=int, default=ServerConfig.metrics_port, help="0: off")
    p.add_argument("--http-port", type=int, default=0, help="OpenAI HTTP API port; 0: off")
    p.add_argument("--max-queue", type=int, default=ServerConfig.max_queue)
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--gpu-memory-mb", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=EngineConfig.max_num_seqs)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--decode-steps", type=int, default=EngineConfig.decode_steps)
    p.add_argument("--log-console", action="store_true", help="readable logs instead of JSON")
    return p.parse_args(argv)


def _backend(args: argparse.Namespace, metrics: Metrics) -> Backend | None:
    """ProxyBackend for --upstream, else EngineBackend; None (logged) for bad engine flags."""
    if args.upstream is not None:
        return ProxyBackend(args.upstream, metrics)
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
        return None
    return EngineBackend(engine, metrics)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    hlog.configure(json=not args.log_console)
    flags = ("host", "port", "metrics_port", "http_port", "max_queue")
    try:  # the flags are the server section's keys, checked by its schema
        server = schema.build(ServerConfig, {k: getattr(args, k) for k in flags}, "server.")
    except ConfigError as exc:
        log.error("bad_argument", error=str(exc))
        return 2
    metrics = Metrics()
    backend = _backend(args, metrics)
    if backend is None:
        return 2
    with contextlib.suppress(KeyboardInterrupt):
        try:
            asyncio.run(serve(backend, server, metrics, args.listen))
        except Exception:
            return 1  # already logged with its traceback
    return 0


if __name__ == "__main__":
    sys.exit(main())
