"""`ProxyBackend`: the Backend protocol over gRPC to an upstream that serves the same public
hybridgen.v1.GenerationService (the CPU daemon, on a unix socket).

    gateway service -> ProxyBackend.generate -> upstream Generate (streaming)
    upstream GenerateResponse -> Delta -> gateway service -> client

The upstream does the work (detokenization, stop strings, KV); this side keeps only what lets
the gateway answer without a round trip: readiness (a grpc.health.v1 poll every 0.25 s), the
model's limits for `validate`, and the count of requests waiting for their first token.

Failure handling: a dead upstream closes the socket, which fails in-flight calls at once; a
hung one (socket open, no answers) is detected by health checks timing out, after which the
in-flight calls are cut. Either way the client sees UNAVAILABLE, never a hang.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
import structlog
from google.protobuf.json_format import MessageToDict
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hybridgen.engine.sequence import FinishReason
from hybridgen.engine.step_errors import ErrorCode, StepFailed
from hybridgen.engine.validation import InvalidRequest, validate_request
from hybridgen.models.chat import ChatMessage
from hybridgen.sampling.params import SamplingParams
from hybridgen.serving.backend import BackendUnavailable
from hybridgen.serving.delta import Delta, TokenLogprob
from hybridgen.serving.metrics import Metrics
from hybridgen.serving.service import SERVICE_NAME, QueueFull
from hybridgen.serving.stream_input import PromptPart
from hybridgen.v1 import generation_pb2 as pb
from hybridgen.v1 import generation_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from hybridgen.serving.service import GenerateInput

log = structlog.get_logger()

POLL_S = 0.25
"""How often the upstream's health is checked."""
# Long enough that a busy upstream (a CPU-heavy step holding its event loop) is not taken for
# dead; a dead one fails the check at once (connection refused), not at this timeout.
_CHECK_TIMEOUT_S = 1.0
# Consecutive timed-out checks after which the upstream is taken as hung and in-flight calls
# are cut (a dead upstream's calls fail on their own when its socket closes).
_HUNG_CHECKS = 2
# Model info (pool gauges) is refreshed every this many polls while the upstream serves.
_INFO_EVERY = 4
_UNARY_TIMEOUT_S = 30.0
_ABORTED = "aborted"
_CHANNEL_OPTIONS = [
    # The channel retries a lost upstream on its own; short backoffs let a restarted daemon be
    # found within a poll or two instead of after gRPC's default of up to 120 s.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 500),
]
_SAMPLING_FIELDS = tuple(pb.SamplingParams.DESCRIPTOR.fields_by_name)
_FINISH = {
    pb.FINISH_REASON_STOP: FinishReason.STOP,
    pb.FINISH_REASON_LENGTH: FinishReason.LENGTH,
    pb.FINISH_REASON_STOP_SEQUENCE: FinishReason.STOP_SEQUENCE,
    pb.FINISH_REASON_CANCELLED: FinishReason.CANCELLED,
}
# Codes that mean "the upstream is not there (or going away)": the client may retry.
_GONE = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.UNKNOWN,
)


class UpstreamRejected(InvalidRequest):
    """The upstream answered INVALID_ARGUMENT; str() is its details, passed on verbatim."""

    def __init__(self, details: str) -> None:
        ValueError.__init__(self, details)
        self.field = details.split(":", 1)[0].split("=", 1)[0]


class UpstreamFailed(RuntimeError):
    """The upstream answered an unexpected status (its bug); the client gets INTERNAL."""


def upstream_error(exc: grpc.aio.AioRpcError) -> Exception:
    """The gateway-side exception for an upstream status (the service maps it to a code)."""
    code, details = exc.code(), exc.details() or ""
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return UpstreamRejected(details)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return QueueFull(details)
    if code in _GONE:
        return BackendUnavailable(f"the upstream is unavailable ({code.name}): {details}")
    if code == grpc.StatusCode.INTERNAL:  # the request's step failed upstream
        return StepFailed(ErrorCode.INTERNAL, details)
    if code == grpc.StatusCode.DATA_LOSS:  # a ticket of it was corrupted upstream
        return StepFailed(ErrorCode.DATA_LOSS, details)
    return UpstreamFailed(f"upstream answered {code.name}: {details}")


# -- protobuf at the edge -------------------------------------------------------------------


def request_to_pb(
    request_id: str, prompt_ids: Sequence[int], params: SamplingParams, stop: Sequence[str]
) -> pb.GenerateRequest:
    """The upstream GenerateRequest equivalent to an admitted request."""
    sampling = {f: getattr(params, f) for f in _SAMPLING_FIELDS}
    return pb.GenerateRequest(
        request_id=request_id,
        prompt_token_ids=prompt_ids,
        max_tokens=params.max_tokens,
        sampling=pb.SamplingParams(**{k: v for k, v in sampling.items() if v is not None}),
        stop=stop,
        stop_token_ids=params.stop_token_ids,
        ignore_eos=params.ignore_eos,
    )


def delta_from_pb(
    resp: pb.GenerateResponse, prompt_tokens: int, completion_before: int, logprobs: bool
) -> Delta:
    """GenerateResponse -> Delta; usage is only on the last message, so counts in between
    are kept here."""
    finish = _FINISH.get(resp.finish_reason)
    lps = None
    if logprobs:
        lps = tuple(
            TokenLogprob(t.token_id, t.logprob, tuple((x.token_id, x.logprob) for x in t.top))
            for t in resp.logprobs.tokens
        )
    return Delta(
        token_ids=tuple(resp.token_ids),
        text=resp.text,
        logprobs=lps,
        finished=finish is not None,
        finish_reason=finish,
        prompt_tokens=resp.usage.prompt_tokens if finish else prompt_tokens,
        completion_tokens=(
            resp.usage.completion_tokens if finish else completion_before + len(resp.token_ids)
        ),
    )


def info_from_pb(resp: pb.GetModelInfoResponse) -> dict[str, Any]:
    """GetModelInfoResponse -> EngineBackend.model_info's dict (max_queue is the gateway's)."""
    info: dict[str, Any] = {}
    for field in resp.DESCRIPTOR.fields:
        value = getattr(resp, field.name)
        if isinstance(value, bool | int | float | str):
            info[field.name] = value
        elif field.name == "op_regions":
            info[field.name] = [MessageToDict(r, preserving_proto_field_name=True) for r in value]
        elif field.message_type is not None and field.message_type.GetOptions().map_entry:
            info[field.name] = dict(value)  # decode_step_ms, mixed_step_ms
        else:
            info[field.name] = sorted(value)  # eos_token_ids
    del info["max_queue"]
    return info


# -- the backend ----------------------------------------------------------------------------


@dataclass
class _Call:
    """One upstream Generate in flight."""

    call: Any
    """The grpc.aio UnaryStreamCall."""
    cut: str | None = None
    """Why this side cancelled it (_ABORTED, or why the upstream is taken as lost)."""
    failed: BaseException | None = None
    """Why forwarding a streamed prompt's parts failed (this side cancelled the call)."""


async def _forward(
    entry: _Call, first: pb.GenerateRequest, parts: AsyncIterator[PromptPart]
) -> None:
    """Write a streamed prompt to the upstream call: the start, then each part as it comes;
    the upstream's side closes after the last. A bad part (InvalidRequest from the reader)
    cancels the call and is what the request fails with."""
    try:
        await entry.call.write(pb.StreamGenerateRequest(start=first))
        async for part in parts:
            chunk = pb.PromptChunk(text=part.text, token_ids=part.token_ids, last=part.last)
            await entry.call.write(pb.StreamGenerateRequest(chunk=chunk))
            if part.last:
                await entry.call.done_writing()
    except InvalidRequest as exc:
        entry.failed = exc
        entry.call.cancel()
    except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
        pass  # the call ended (its reader reports why)


def _task_cancelling() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


class ProxyBackend:
    """Backend that forwards to an upstream GenerationService at `target`."""

    def __init__(
        self, target: str, metrics: Metrics | None = None, max_message_bytes: int = 64 * 2**20
    ) -> None:
        """`max_message_bytes`: the largest message either way (the gateway's own limit)."""
        self.target = target
        self._metrics = metrics
        self._options = [
            *_CHANNEL_OPTIONS,
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
        ]
        self._channel: grpc.aio.Channel | None = None
        self._stub: pb_grpc.GenerationServiceStub | None = None
        self._health: health_pb2_grpc.HealthStub | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._ready = False
        self._stopping = False
        self._info: dict[str, Any] | None = None
        """The upstream's last model info; None until it serves, cleared when it is lost."""
        self._calls: dict[str, _Call] = {}
        self._waiting = 0

    async def start(self) -> None:
        self._channel = grpc.aio.insecure_channel(self.target, options=self._options)
        self._stub = pb_grpc.GenerationServiceStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        await self._poll(timeouts=0, tick=0)  # so that ready() is right on return
        self._watcher = asyncio.create_task(self._watch())
        log.info("upstream_watch_started", target=self.target, ready=self._ready)

    async def stop(self) -> None:
        self._stopping = True
        self._ready = False
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
        self._cut_all("the server is shutting down")
        if self._channel is not None:
            await self._channel.close()

    def ready(self) -> bool:
        return self._ready and not self._stopping

    async def model_info(self) -> dict[str, Any]:
        info = await self._fetch_info()
        return {**info, "queued_requests": self._waiting}

    async def tokenize(self, text: str, add_special_tokens: bool) -> list[int]:
        request = pb.TokenizeRequest(text=text, add_special_tokens=add_special_tokens)
        try:
            resp = await self._stub_or_raise().Tokenize(request, timeout=_UNARY_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            raise upstream_error(exc) from exc
        return list(resp.token_ids)

    async def tokenize_chat(
        self, messages: Sequence[ChatMessage], add_generation_prompt: bool
    ) -> list[int]:
        request = pb.TokenizeRequest(
            messages=[pb.ChatMessage(role=m.role, content=m.content) for m in messages],
            add_generation_prompt=add_generation_prompt,
        )
        try:
            resp = await self._stub_or_raise().Tokenize(request, timeout=_UNARY_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            raise upstream_error(exc) from exc
        return list(resp.token_ids)

    async def validate(
        self, prompt_ids: Sequence[int], params: SamplingParams, partial: bool = False
    ) -> None:
        info = self._info if self._info is not None else await self._fetch_info()
        validate_request(prompt_ids, params, info["vocab_size"], info["max_model_len"], partial)

    async def generate(
        self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams, stop: list[str]
    ) -> AsyncIterator[Delta]:
        stub = self._stub_or_raise()
        if request_id in self._calls:
            raise InvalidRequest("request_id", f"{request_id!r} is already running")
        request = request_to_pb(request_id, prompt_ids, params, stop)
        entry = _Call(stub.Generate(request, wait_for_ready=False))
        stream = self._follow(request_id, entry, len(prompt_ids), params.logprobs is not None)
        async with contextlib.aclosing(stream) as deltas:
            async for delta in deltas:
                yield delta

    async def stream_generate(
        self, req: GenerateInput, start: PromptPart, parts: AsyncIterator[PromptPart]
    ) -> AsyncIterator[Delta]:
        """The upstream's StreamGenerate; the parts are forwarded as they come (the upstream
        tokenizes them)."""
        stub = self._stub_or_raise()
        if req.request_id in self._calls:
            raise InvalidRequest("request_id", f"{req.request_id!r} is already running")
        first = request_to_pb(req.request_id, start.token_ids, req.params, req.stop)
        first.prompt, first.add_special_tokens = start.text, req.add_special_tokens
        entry = _Call(stub.StreamGenerate(wait_for_ready=False))
        forwarding = asyncio.create_task(_forward(entry, first, parts))
        try:
            stream = self._follow(req.request_id, entry, 0, req.params.logprobs is not None)
            async with contextlib.aclosing(stream) as deltas:
                async for delta in deltas:
                    yield delta
        finally:
            forwarding.cancel()

    async def _follow(
        self, request_id: str, entry: _Call, prompt_tokens: int, logprobs: bool
    ) -> AsyncGenerator[Delta, None]:
        """An upstream call's Deltas, with the waiting count; ending early cancels the call
        (the upstream aborts the request and frees its KV)."""
        # Counted before the first await (see EngineBackend.generate).
        self._calls[request_id] = entry
        self._waiting += 1
        started = upstream_done = False
        try:
            completion = 0
            deltas = self._read(entry, prompt_tokens, logprobs)
            async with contextlib.aclosing(deltas):
                async for delta in deltas:
                    if not started:
                        started = True
                        self._waiting -= 1
                    completion = delta.completion_tokens
                    yield delta
            upstream_done = True
        except BaseException as exc:
            upstream_done = not isinstance(exc, GeneratorExit | asyncio.CancelledError)
            aborted = entry.cut == _ABORTED and isinstance(exc, asyncio.CancelledError)
            if aborted and not _task_cancelling():  # abort() from elsewhere: end it cleanly
                yield _cancelled(prompt_tokens, completion)
                return
            raise
        finally:
            if not started:
                self._waiting -= 1
            if self._calls.get(request_id) is entry:
                del self._calls[request_id]
            if not upstream_done:
                entry.call.cancel()

    async def _read(
        self, entry: _Call, prompt_tokens: int, logprobs: bool
    ) -> AsyncGenerator[Delta, None]:
        """The upstream stream's Deltas up to its end; errors become gateway exceptions."""
        completion, finished = 0, False
        while True:
            try:
                resp = await entry.call.read()
            except grpc.aio.AioRpcError as exc:
                raise upstream_error(exc) from exc
            except asyncio.CancelledError:
                if entry.failed is not None and not _task_cancelling():
                    raise entry.failed from None  # a bad part: the call was cancelled for it
                if entry.cut in (None, _ABORTED) or _task_cancelling():
                    raise
                raise BackendUnavailable(entry.cut) from None  # the watchdog cut it
            if resp is grpc.aio.EOF:
                if finished:
                    return
                raise BackendUnavailable("the upstream ended the stream without finishing it")
            delta = delta_from_pb(resp, prompt_tokens, completion, logprobs)
            completion, finished = delta.completion_tokens, delta.finished
            yield delta

    async def abort(self, request_id: str) -> None:
        entry = self._calls.get(request_id)
        if entry is not None and not entry.call.done():
            entry.cut = _ABORTED
            entry.call.cancel()

    def queue_depth(self) -> int:
        return self._waiting

    def _stub_or_raise(self) -> pb_grpc.GenerationServiceStub:
        if self._stopping:
            raise BackendUnavailable("the server is shutting down")
        if self._stub is None:
            raise BackendUnavailable("the upstream connection is not open")
        return self._stub

    async def _fetch_info(self) -> dict[str, Any]:
        """GetModelInfo from the upstream; refreshes the cache and the pool gauges."""
        try:
            resp = await self._stub_or_raise().GetModelInfo(
                pb.GetModelInfoRequest(), timeout=_UNARY_TIMEOUT_S
            )
        except grpc.aio.AioRpcError as exc:
            raise upstream_error(exc) from exc
        info = info_from_pb(resp)
        self._info = info
        if self._metrics is not None:
            total = max(info["kv_blocks_total"], 1)
            self._metrics.kv_usage.labels(tier="hot").set(info["kv_blocks_used"] / total)
            self._metrics.running.set(info["running_requests"])
            self._metrics.set_kv_tiers(info)
            self._metrics.gpu_mem_peak.set(info["gpu_mem_peak_reserved_mb"] * 2**20)
            for ring in ("c2g", "g2c"):
                self._metrics.ring_occupancy.labels(ring=ring).set(info[f"ring_occupancy_{ring}"])
            for daemon in ("gpu", "cpu"):
                jitter = info[f"{daemon}_heartbeat_jitter_p99_ms"] / 1e3
                self._metrics.heartbeat_jitter.labels(daemon=daemon).set(jitter)
        return info

    # -- upstream health ---------------------------------------------------------------------

    async def _watch(self) -> None:
        timeouts, tick = 0, 0
        while True:
            await asyncio.sleep(POLL_S)
            tick += 1
            try:
                timeouts = await self._poll(timeouts, tick)
            except Exception as exc:  # the watcher must outlive any surprise; next poll retries
                log.exception("upstream_poll_failed", error=repr(exc))
                self._set_ready(False, "poll failed")

    async def _poll(self, timeouts: int, tick: int) -> int:
        """One health check; returns the count of consecutive timed-out checks."""
        assert self._health is not None
        request = health_pb2.HealthCheckRequest(service=SERVICE_NAME)
        try:
            resp = await self._health.Check(request, timeout=_CHECK_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            self._set_ready(False, f"{exc.code().name}: {exc.details()}")
            if exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                return 0
            if timeouts + 1 == _HUNG_CHECKS:
                self._cut_all("the upstream stopped answering")
            return timeouts + 1
        if resp.status != health_pb2.HealthCheckResponse.SERVING:
            self._set_ready(False, "upstream NOT_SERVING")
        elif not self._ready or self._info is None or tick % _INFO_EVERY == 0:
            try:
                await self._fetch_info()  # the upstream may be a new process: new limits
            except (BackendUnavailable, UpstreamFailed) as exc:
                self._set_ready(False, str(exc))
                return 0
            self._set_ready(True, "upstream SERVING")
        return 0

    def _set_ready(self, ready: bool, why: str) -> None:
        if ready != self._ready:  # a healthy upstream is news, not a warning
            report = log.info if ready else log.warning
            report("upstream_health_changed", serving=ready, why=why, target=self.target)
        self._ready = ready
        if not ready:
            self._info = None  # refetched when the upstream serves again

    def _cut_all(self, reason: str) -> None:
        """Cancel every in-flight upstream call; their streams end with BackendUnavailable."""
        for entry in self._calls.values():
            if not entry.call.done():
                entry.cut = reason
                entry.call.cancel()


def _cancelled(prompt_tokens: int, completion: int) -> Delta:
    return Delta((), "", None, True, FinishReason.CANCELLED, prompt_tokens, completion)
