"""Who may call the public API: API keys, checked the same way by every front end.

Keys come from `server.api_key_file`, one a line; blank lines and lines starting with # are
skipped, surrounding whitespace is not part of a key. A client sends the header
`authorization: Bearer KEY`. The check hashes the presented key and compares the digest
with every configured key's digest (hmac.compare_digest), so its time depends neither on
which key matched nor on how much of a wrong key was right.

The gRPC front end installs `AuthInterceptor`: every call but health and reflection needs a
key, and one without gets UNAUTHENTICATED before its request is even parsed. An HTTP front end calls
`ApiKeys.allows` with its Authorization header.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any

import grpc

from hybridgen.config.engine import ConfigError

OPEN_PREFIXES = (
    "/grpc.health.v1.Health/",
    "/grpc.reflection.v1alpha.ServerReflection/",
    "/grpc.reflection.v1.ServerReflection/",
)
"""gRPC methods that need no key: health (load balancers and supervisors probe it without
one) and reflection, which describes only the public API (grpcurl needs it to call even
health; `server.reflection: false` turns it off)."""
REFUSAL = "a valid API key is needed: send the header 'authorization: Bearer <key>'"


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def read_keys(path: str | Path) -> list[str]:
    """The keys of a key file: one a line, blank lines and lines starting with # skipped."""
    keys = [k.strip() for k in Path(path).read_text(encoding="utf-8").splitlines()]
    return [k for k in keys if k and not k.startswith("#")]


class ApiKeys:
    """The accepted keys, kept as SHA-256 digests."""

    def __init__(self, keys: Iterable[str]) -> None:
        self._digests = tuple(_digest(k) for k in keys)
        if not self._digests:
            raise ValueError("ApiKeys needs at least one key")

    @classmethod
    def load(cls, path: str | Path, key: str = "server.api_key_file") -> ApiKeys:
        """The keys in `path`; ConfigError naming `key` when it is unreadable or has none."""
        try:
            keys = read_keys(path)
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{key}={str(path)!r}: cannot read the key file: {exc}") from exc
        if not keys:
            raise ConfigError(f"{key}={str(path)!r} has no keys: write one key per line")
        return cls(keys)

    def allows(self, authorization: str | None) -> bool:
        """Whether an Authorization header value is `Bearer <one of the keys>`."""
        if authorization is None:
            return False
        scheme, _, key = authorization.strip().partition(" ")
        presented = _digest(key.strip())
        matched = False
        for digest in self._digests:  # all of them, whatever matched: constant time
            matched |= hmac.compare_digest(digest, presented)
        return matched and scheme.lower() == "bearer"


def _header(metadata: Any, name: str) -> str | None:
    for key, value in metadata or ():
        if key == name:
            return value if isinstance(value, str) else None
    return None


async def _refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSAL)


async def _refuse_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSAL)
    yield b""  # unreachable (abort raises); makes this an async generator, as streams are


def _refusing(handler: grpc.RpcMethodHandler | None) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that answers UNAUTHENTICATED; it takes the
    request as raw bytes, so nothing of it is parsed."""
    if handler is not None and handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(_refuse_stream)
    if handler is not None and handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(_refuse)
    if handler is not None and handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(_refuse_stream)
    return grpc.unary_unary_rpc_method_handler(_refuse)  # unknown methods too: no probing


class AuthInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Lets a call through when it carries a valid key or is a health check."""

    def __init__(self, keys: ApiKeys) -> None:
        self.keys = keys

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        method: str = details.method  # type: ignore[attr-defined]
        if method.startswith(OPEN_PREFIXES):
            return handler
        metadata = details.invocation_metadata  # type: ignore[attr-defined]
        if self.keys.allows(_header(metadata, "authorization")):
            return handler
        return _refusing(handler)
