"""A gateway built by `gateway.server.build` and run on an event loop of its own thread, so
that tests drive it with blocking clients (grpc, grpcurl, raw sockets); and a scripted
backend that streams a token every `period_s` without any model.

Not a test module."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from hybridgen.config.sections import ServerConfig
from hybridgen.engine.sequence import FinishReason
from hybridgen.engine.validation import check_text_size, validate_request
from hybridgen.sampling.params import SamplingParams
from hybridgen.serving.backend import Backend
from hybridgen.serving.delta import Delta
from hybridgen.serving.metrics import Metrics
from hybridgen.serving.server import Gateway, build

VOCAB, MAX_LEN = 1000, 128


class ScriptedBackend:
    """Tokens 0, 1, 2, ... every `period_s`; text is one token per byte (as a byte tokenizer:
    at most MAX_LEN bytes fit)."""

    def __init__(self, period_s: float = 0.0) -> None:
        self.period_s = period_s
        self.running: set[str] = set()
        self.aborted: list[str] = []
        self.started: list[str] = []

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    def ready(self) -> bool:
        return True

    async def model_info(self) -> dict[str, Any]:
        return {"model": "scripted", "vocab_size": VOCAB, "max_model_len": MAX_LEN}

    async def tokenize(self, text: str, add_special_tokens: bool) -> list[int]:
        check_text_size("text", text, MAX_LEN, MAX_LEN)
        return list(text.encode())

    async def validate(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        validate_request(prompt_ids, params, VOCAB, MAX_LEN)

    async def generate(
        self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams, stop: list[str]
    ) -> AsyncIterator[Delta]:
        self.started.append(request_id)
        self.running.add(request_id)
        try:
            for i in range(params.max_tokens):
                await asyncio.sleep(self.period_s)
                last = i + 1 == params.max_tokens
                finish = FinishReason.LENGTH if last else None
                yield Delta((i,), f"{i} ", None, last, finish, len(prompt_ids), i + 1)
        finally:
            self.running.discard(request_id)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def queue_depth(self) -> int:
        return 0


class InProcessGateway:
    """A built and started gateway on a background event loop."""

    def __init__(self, backend: Backend, config: ServerConfig) -> None:
        self.backend = backend
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.gateway: Gateway = self.run(self._start(config))

    async def _start(self, config: ServerConfig) -> Gateway:
        gateway = await build(self.backend, config, Metrics())
        await gateway.server.start()
        await self.backend.start()
        await gateway.health.set("", 1)  # SERVING
        return gateway

    def run(self, coroutine: Any) -> Any:
        """Run a coroutine on the gateway's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout=120)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.gateway.port}"

    def stop(self) -> None:
        self.run(self.gateway.server.stop(0))
        self.run(self.backend.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        self.loop.close()


@contextmanager
def serving(backend: Backend, **settings: Any) -> Iterator[InProcessGateway]:
    """A gateway on a free loopback port with these server-section settings."""
    config = ServerConfig(**{"port": 0, "metrics_port": 0, **settings})
    gateway = InProcessGateway(backend, config)
    try:
        yield gateway
    finally:
        gateway.stop()
