"""uvicorn on the gateway's own event loop, beside the gRPC server: the HTTP port
(server.http_port) serves the OpenAI API (serving/openai_http.py).

The socket is bound here, as the gRPC port is (a taken port fails the start with the
address in the error, and no SO_REUSEPORT: a second server on the port is refused), and
uvicorn is driven through its startup / main_loop / shutdown steps rather than `serve`,
which would install its own signal handlers over the gateway's.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from typing import Any

import uvicorn
from starlette.types import ASGIApp

from hybridgen.config.sections import TlsConfig


class HttpServer:
    """An ASGI app served on host:port until `stop`."""

    def __init__(
        self, app: ASGIApp, host: str, port: int, grace_s: float, tls: TlsConfig | None = None
    ) -> None:
        """`tls`: serve HTTPS with the gRPC port's certificate (and client CA: mutual TLS)."""
        secure: dict[str, Any] = {}
        if tls is not None and tls.enabled:
            secure = {"ssl_certfile": tls.cert_file, "ssl_keyfile": tls.key_file}
            if tls.client_ca_file is not None:
                secure |= {"ssl_ca_certs": tls.client_ca_file, "ssl_cert_reqs": ssl.CERT_REQUIRED}
        self._config = uvicorn.Config(
            app,
            lifespan="off",
            log_config=None,
            access_log=False,
            timeout_graceful_shutdown=max(1, round(grace_s)),
            **secure,
        )
        self._server = uvicorn.Server(self._config)
        self._host, self._port = host, port
        self._sock: socket.socket | None = None
        self._ticks: asyncio.Task[None] | None = None

    async def start(self) -> int:
        """Bind and serve; returns the bound port (the port asked, or a free one for 0)."""
        family, kind, proto, _, address = socket.getaddrinfo(
            self._host, self._port, type=socket.SOCK_STREAM
        )[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
            sock.listen(self._config.backlog)
            sock.set_inheritable(False)
        except OSError:
            sock.close()
            raise
        self._sock = sock
        self._config.load()
        self._server.lifespan = self._config.lifespan_class(self._config)
        await self._server.startup(sockets=[sock])
        self._ticks = asyncio.create_task(self._server.main_loop())  # date header, exit flag
        return int(sock.getsockname()[1])

    async def stop(self) -> None:
        """Stop accepting; let running responses finish for up to the grace period."""
        if self._ticks is None:
            return
        self._server.should_exit = True
        await self._ticks
        await self._server.shutdown(sockets=[self._sock] if self._sock else None)
        self._ticks = None
