"""EngineBackend: the Backend protocol (serving/backend.py) over the Engine in this process,
run on one thread of its own.

The product puts the CPU and GPU daemons behind the protocol; EngineBackend is the
single-process stand-in. A request's path through it:

    generate()  -> _Submit on the command queue
    engine thread: engine.add_request, then engine.step() in a loop
                -> each RequestOutput to the request's asyncio.Queue (loop.call_soon_threadsafe)
    generate()  -> incremental detokenization, stop strings -> Delta -> the service
    cancel      -> generate()'s finally -> _Abort on the command queue -> engine.abort (KV freed)

The engine is not thread-safe: every engine call happens on the engine thread, except
`validate`, which reads only the model's vocabulary size and context length (fixed after load).
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import structlog

from hybridgen.config.engine import EngineConfig
from hybridgen.engine.engine import Engine
from hybridgen.engine.info import MIB, counter_info, engine_info, memory_info, step_info
from hybridgen.engine.request_output import RequestOutput
from hybridgen.engine.step_errors import ErrorCode, StepFailed
from hybridgen.engine.validation import (
    InvalidRequest,
    UncheckedRequest,
    check_text_size,
    validate_request,
)
from hybridgen.models.chat import ChatMessage, chat_prompt_ids
from hybridgen.models.tokenizer import Tokenizer
from hybridgen.sampling.params import SamplingParams
from hybridgen.serving.delta import Delta, to_delta
from hybridgen.serving.metrics import Metrics
from hybridgen.serving.stream_input import PromptFeed, PromptPart, start_feeding
from hybridgen.serving.text import TextStream

if TYPE_CHECKING:
    from hybridgen.serving.service import GenerateInput

from hybridgen.serving.backend import BackendUnavailable

log = structlog.get_logger()

# How long the idle engine thread blocks on its command queue before looking again.
_IDLE_WAIT_S = 0.25


@dataclass(frozen=True)
class _Submit:
    """Start a request (engine thread command)."""

    request_id: str
    """The request's id."""
    prompt_ids: list[int]
    """Its prompt."""
    params: SamplingParams
    """Its sampling parameters."""
    sink: Callable[[RequestOutput | BaseException], None]
    """Hands an output (or the request's error) to the request's asyncio queue."""
    prompt_open: bool = False
    """Streaming input: _Extend commands bring the rest of the prompt."""


@dataclass(frozen=True)
class _Extend:
    """Extend an open prompt (engine thread command; Engine.extend_prompt's arguments)."""

    request_id: str
    """The request's id."""
    keep: int
    """Prompt tokens kept."""
    token_ids: list[int]
    """Tokens after them."""
    last: bool
    """The prompt is complete."""


@dataclass(frozen=True)
class _Abort:
    """Abort a request (engine thread command)."""

    request_id: str
    """The request's id."""


_STOP = object()
"""Command: leave the engine loop."""


@dataclass(frozen=True)
class _PoolSnapshot:
    """Engine counters as of the last step, published by the engine thread."""

    kv_blocks_used: int = 0
    """Blocks held by sequences."""
    running_requests: int = 0
    """Sequences running."""
    tiers: tuple[tuple[str, float | int | str], ...] = ()
    """info.counter_info() items."""
    steps: tuple[tuple[str, tuple[tuple[int, float], ...]], ...] = ()
    """info.step_info(): the measured step times by field name and batch size bucket."""


def _post(
    loop: asyncio.AbstractEventLoop, q: asyncio.Queue[RequestOutput | BaseException]
) -> Callable[[RequestOutput | BaseException], None]:
    def sink(item: RequestOutput | BaseException) -> None:
        # RuntimeError: the loop closed under us (process exit), so nobody is listening.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(q.put_nowait, item)

    return sink


class EngineBackend:
    """Backend over an in-process Engine driven by one background thread."""

    def __init__(self, config: EngineConfig, metrics: Metrics | None = None) -> None:
        self._config = config
        self._metrics = metrics
        self._commands: queue.Queue[object] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._engine: Engine | None = None
        self._tokenizer: Tokenizer | None = None
        self._info: dict[str, Any] = {}
        self._snapshot = _PoolSnapshot()
        self._dead: str | None = None
        self._stopping = False
        self._active: set[str] = set()
        self._waiting = 0
        # Engine thread only: where each running request's outputs go.
        self._sinks: dict[str, Callable[[RequestOutput | BaseException], None]] = {}

    # -- event loop side -------------------------------------------------------------------

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        loaded: asyncio.Future[None] = loop.create_future()
        self._thread = threading.Thread(
            target=self._run, args=(loop, loaded), name="hybridgen-engine", daemon=True
        )
        self._thread.start()
        await loaded

    async def stop(self) -> None:
        if self._thread is None:
            return
        self._stopping = True
        self._commands.put(_STOP)
        await asyncio.to_thread(self._thread.join)
        self._thread = None

    def ready(self) -> bool:
        return self._engine is not None and self._dead is None and not self._stopping

    async def model_info(self) -> dict[str, Any]:
        self._check_alive()
        assert self._engine is not None
        snap = self._snapshot
        return {
            **self._info,
            **dict(snap.tiers),
            **memory_info(self._engine.device),  # allocator counters: safe off the engine thread
            "kv_blocks_used": snap.kv_blocks_used,
            "running_requests": snap.running_requests,
            "queued_requests": self._waiting,
            **{name: dict(by_rows) for name, by_rows in snap.steps},
        }

    async def tokenize(self, text: str, add_special_tokens: bool) -> list[int]:
        self._check_alive()
        assert self._tokenizer is not None and self._engine is not None
        max_len = self._engine.max_model_len
        check_text_size("text", text, self._tokenizer.max_text_bytes(max_len), max_len)
        # The tokenizer is separate from the engine's mutable state and the Rust tokenizer is
        # thread-safe, so it runs on a worker rather than queueing behind a step.
        return await asyncio.to_thread(self._tokenizer.encode, text, add_special_tokens)

    async def tokenize_chat(
        self, messages: Sequence[ChatMessage], add_generation_prompt: bool
    ) -> list[int]:
        self._check_alive()
        assert self._tokenizer is not None and self._engine is not None
        max_len = self._engine.max_model_len
        text = "".join(m.content for m in messages)
        check_text_size("messages", text, self._tokenizer.max_text_bytes(max_len), max_len)
        return await asyncio.to_thread(
            chat_prompt_ids, self._tokenizer, messages, add_generation_prompt
        )

    async def validate(
        self, prompt_ids: Sequence[int], params: SamplingParams, partial: bool = False
    ) -> None:
        self._check_alive()
        assert self._engine is not None
        engine = self._engine  # only its fixed model limits are read
        validate_request(prompt_ids, params, engine.spec.vocab_size, engine.max_model_len, partial)

    async def generate(
        self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams, stop: list[str]
    ) -> AsyncIterator[Delta]:
        stream = self._request(request_id, list(prompt_ids), params, stop, None)
        async with contextlib.aclosing(stream) as deltas:
            async for delta in deltas:
                yield delta

    async def stream_generate(
        self, req: GenerateInput, start: PromptPart, parts: AsyncIterator[PromptPart]
    ) -> AsyncIterator[Delta]:
        self._check_alive()
        engine = self._engine
        assert self._tokenizer is not None and engine is not None
        feed = PromptFeed(
            self._tokenizer,
            req.add_special_tokens,
            engine.spec.vocab_size,
            engine.max_model_len,
            req.params.max_tokens,
        )
        feed.push(start)
        prompt = list(feed.token_ids)
        stream = self._request(req.request_id, prompt, req.params, list(req.stop), (feed, parts))
        async with contextlib.aclosing(stream) as deltas:
            async for delta in deltas:
                yield delta

    async def _request(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        stop: list[str],
        streamed: tuple[PromptFeed, AsyncIterator[PromptPart]] | None,
    ) -> AsyncGenerator[Delta, None]:
        """Submit, then the engine's outputs as Deltas. `streamed`: the prompt is open, and
        its parts go to the engine thread as _Extend commands meanwhile."""
        self._check_alive()
        if request_id in self._active:
            raise InvalidRequest("request_id", f"{request_id!r} is already running")
        assert self._tokenizer is not None
        q: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        sink = _post(asyncio.get_running_loop(), q)
        # Counted before the first await, so that the service's queue check and this
        # increment cannot interleave with another request's.
        self._active.add(request_id)
        self._waiting += 1
        started = engine_done = False
        self._commands.put(_Submit(request_id, prompt_ids, params, sink, streamed is not None))
        feeding = None
        if streamed is not None:

            def send(keep: int, ids: list[int], last: bool) -> None:
                self._commands.put(_Extend(request_id, keep, ids, last))

            feeding = start_feeding(streamed[1], streamed[0], send, q.put_nowait)
        text: TextStream | None = None
        try:
            # The engine may have died between the first check and the put; if it died after
            # this check, its thread fails the queued submit itself (_fail_all).
            self._check_alive()
            while not engine_done:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item  # the engine refused or lost it (a late abort is ignored)
                if not started:
                    started = True
                    self._waiting -= 1
                if text is None:  # a streamed prompt is complete by its first token
                    ids = streamed[0].token_ids if streamed else prompt_ids
                    text = TextStream(self._tokenizer, ids, stop)
                engine_done = item.finished
                delta = to_delta(item, text)
                yield delta
                if delta.finished:
                    break  # a stop string ended it before the engine did
        finally:
            if feeding is not None:
                feeding.cancel()
            if not started:
                self._waiting -= 1
            self._active.discard(request_id)
            if not engine_done:
                self._commands.put(_Abort(request_id))

    async def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    def queue_depth(self) -> int:
        return self._waiting

    def _check_alive(self) -> None:
        if self._stopping:
            raise BackendUnavailable("the server is shutting down")
        if self._dead is not None:
            raise BackendUnavailable(f"the engine failed: {self._dead}")
        if self._engine is None or self._thread is None:
            raise BackendUnavailable("the model is not loaded")

    # -- engine thread ---------------------------------------------------------------------

    def _run(self, loop: asyncio.AbstractEventLoop, loaded: asyncio.Future[None]) -> None:
        try:
            engine = Engine(self._config)
        except BaseException as exc:
            loop.call_soon_threadsafe(_settle, loaded, exc)
            return
        self._tokenizer = engine.loaded.tokenizer
        self._info = engine_info(engine)
        if self._metrics is not None:  # read at each scrape, not at every step
            device = engine.device
            self._metrics.gpu_mem_peak.set_function(
                lambda: memory_info(device)["gpu_mem_peak_reserved_mb"] * MIB
            )
        self._engine = engine
        loop.call_soon_threadsafe(_settle, loaded, None)
        try:
            self._serve(engine)
        except Exception as exc:
            log.exception("engine_failed")
            self._dead = repr(exc)
            self._fail_all(BackendUnavailable(f"the engine failed: {exc!r}"))
        else:
            self._fail_all(BackendUnavailable("the server is shutting down"))

    def _serve(self, engine: Engine) -> None:
        """Apply commands, step while there is work, publish counters; until _STOP."""
        while True:
            for command in self._drain(block=not engine.has_unfinished()):
                if command is _STOP:
                    return
                self._apply(engine, command)
            if engine.has_unfinished():
                outs = engine.step()
                self._publish(engine)  # before the tokens go out, so a client sees it
                for out in outs:
                    sink = self._sinks.get(out.request_id)
                    if out.finished:
                        self._sinks.pop(out.request_id, None)
                    if sink is not None:
                        sink(out if out.error is None else out.error)
            self._publish(engine)

    def _drain(self, block: bool) -> list[object]:
        commands = []
        try:
            if block:
                commands.append(self._commands.get(timeout=_IDLE_WAIT_S))
            while True:
                commands.append(self._commands.get_nowait())
        except queue.Empty:
            return commands

    def _apply(self, engine: Engine, command: object) -> None:
        if isinstance(command, _Submit):
            try:
                engine.add_request(
                    command.request_id, command.prompt_ids, command.params, command.prompt_open
                )
            except UncheckedRequest as exc:  # validate() passed it: a bug in front of the engine
                command.sink(_internal(exc))
                return
            self._sinks[command.request_id] = command.sink
        elif isinstance(command, _Extend) and command.request_id in self._sinks:
            try:
                engine.extend_prompt(
                    command.request_id, command.keep, command.token_ids, command.last
                )
            except (InvalidRequest, UncheckedRequest) as exc:  # PromptFeed checked the chunk
                self._sinks.pop(command.request_id)(_internal(exc))
                engine.abort(command.request_id)
        # A late abort (the request already finished) finds no sink; that is fine.
        elif isinstance(command, _Abort) and command.request_id in self._sinks:
            del self._sinks[command.request_id]
            engine.abort(command.request_id)
            log.info("request_aborted", request_id=command.request_id)

    def _publish(self, engine: Engine) -> None:
        tiers = tuple(counter_info(engine).items())
        steps = tuple(
            (name, tuple(sorted(by_rows.items()))) for name, by_rows in step_info(engine).items()
        )
        snap = _PoolSnapshot(engine.pool.num_used, len(engine.scheduler.running), tiers, steps)
        if snap == self._snapshot:
            return
        self._snapshot = snap  # one reference assignment: readers see old or new, never half
        if self._metrics is not None:
            total = max(self._info["kv_blocks_total"], 1)
            self._metrics.kv_usage.labels(tier="hot").set(snap.kv_blocks_used / total)
            self._metrics.running.set(snap.running_requests)
            self._metrics.set_kv_tiers(dict(snap.tiers))

    def _fail_all(self, error: BaseException) -> None:
        """Fail running requests and any submit still queued (the thread is leaving)."""
        for sink in self._sinks.values():
            sink(error)
        self._sinks.clear()
        for command in self._drain(block=False):
            if isinstance(command, _Submit):
                command.sink(error)


def _settle(future: asyncio.Future[None], error: BaseException | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


def _internal(error: Exception) -> StepFailed:
    """A request or chunk the engine refused although validate() or PromptFeed passed it: a
    bug in front of the engine, answered INTERNAL in the engine's words."""
    log.error("unchecked_request", error=str(error))
    return StepFailed(ErrorCode.INTERNAL, str(error))
