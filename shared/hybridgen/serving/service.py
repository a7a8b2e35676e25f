"""GenerationService over grpc.aio: protobuf in, Backend calls, protobuf out.

A Generate call's path: the lenient deserializer (`_lenient`) -> `from_pb` (protobuf to a
GenerateInput, first checks) -> `admit` (availability, tokenization, `backend.validate`,
the admission queue) -> `backend.generate` Deltas -> `deltas` (metrics; a client that
leaves aborts the request) -> `to_pb` -> the client. The HTTP API (serving/openai_http.py)
takes the same path from `admit` on. StreamGenerate (streaming input) admits its start and
hands the rest of the prompt to `backend.stream_generate` (serving/stream_input.py).
`grpc_errors` turns exceptions into status codes: bad input is INVALID_ARGUMENT naming the
field, never UNKNOWN or INTERNAL.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import structlog
from google.protobuf import descriptor_pb2, descriptor_pool, message, message_factory

from hybridgen.engine.sequence import FinishReason
from hybridgen.engine.step_errors import ErrorCode, StepFailed
from hybridgen.engine.validation import InvalidRequest
from hybridgen.models.chat import ChatMessage, InvalidChat
from hybridgen.sampling.params import (
    MAX_STOP_TOKEN_IDS,
    InvalidSamplingParameter,
    SamplingParams,
)
from hybridgen.serving.backend import Backend, BackendUnavailable
from hybridgen.serving.delta import Delta
from hybridgen.serving.metrics import Metrics
from hybridgen.serving.stop_strings import MAX_STOP_STRINGS, StopStringError, validate_stops
from hybridgen.serving.stream_input import PartReader, PromptPart
from hybridgen.v1 import generation_pb2 as pb
from hybridgen.v1 import generation_pb2_grpc as pb_grpc

log = structlog.get_logger()

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["GenerationService"].full_name
DEFAULT_MAX_TOKENS = 16
MAX_REQUEST_ID_LEN = 256
# SamplingParams fields that the request's `sampling` message carries one-to-one.
_SAMPLING_FIELDS = tuple(pb.SamplingParams.DESCRIPTOR.fields_by_name)
_FINISH_PB = {
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.STOP_SEQUENCE: pb.FINISH_REASON_STOP_SEQUENCE,
    FinishReason.CANCELLED: pb.FINISH_REASON_CANCELLED,
}


WRITE_GRACE_S = 2.0
"""How long past server.request_timeout_s a call's last messages may take to reach a client
before the call is cut off (DEADLINE_EXCEEDED): its streams end themselves at the limit."""


class QueueFull(RuntimeError):
    """The admission queue is full."""


class RequestTimedOut(RuntimeError):
    """The call ran past server.request_timeout_s; it was aborted and its KV freed."""


class ServerStopping(BackendUnavailable):
    """The call was still running when the server's drain grace ran out: it was ended with
    this status (UNAVAILABLE, HTTP 503) rather than cut off, and its KV freed."""


_STATUS: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (InvalidChat, grpc.StatusCode.INVALID_ARGUMENT),
    (InvalidSamplingParameter, grpc.StatusCode.INVALID_ARGUMENT),
    (StopStringError, grpc.StatusCode.INVALID_ARGUMENT),
    (QueueFull, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (BackendUnavailable, grpc.StatusCode.UNAVAILABLE),
    (RequestTimedOut, grpc.StatusCode.DEADLINE_EXCEEDED),
)

_STEP_STATUS = {code: getattr(grpc.StatusCode, code.name) for code in ErrorCode}
"""A failed step's ErrorCode as the status of the same name."""


# -- protobuf at the edge -------------------------------------------------------------------


@dataclass(frozen=True)
class Undecodable:
    """A request that protobuf refused to parse (stands in for the message)."""

    field: str
    """The offending field, e.g. prompt or stop[1]."""
    problem: str
    """What is wrong with it."""


@dataclass(frozen=True)
class GenerateInput:
    """A Generate request with protobuf left behind."""

    request_id: str
    """Client's id, or a generated one."""
    prompt: str | None
    """Text prompt, or None when token ids were given."""
    prompt_token_ids: Sequence[int]
    """Token-id prompt (empty when text or messages were given); the request's own container,
    not copied before its length is checked."""
    messages: tuple[ChatMessage, ...]
    """A chat to render with the model's template (empty when a prompt was given)."""
    add_generation_prompt: bool
    """With messages: open an assistant turn at the end."""
    add_special_tokens: bool
    """Tokenize a text prompt with BOS and the like."""
    params: SamplingParams
    """Sampling parameters, max_tokens and stop token ids."""
    stop: tuple[str, ...]
    """Stop strings."""


def _bytes_mirror(desc: Any) -> type[message.Message]:
    """A copy of message type `desc` whose string fields are bytes, in a private pool: it
    parses what the real type rejects as bad UTF-8, so the bad field can be named."""
    file_proto = descriptor_pb2.FileDescriptorProto()
    desc.file.CopyToProto(file_proto)
    for msg in file_proto.message_type:
        if msg.name == desc.name:
            for f in msg.field:
                if f.type == descriptor_pb2.FieldDescriptorProto.TYPE_STRING:
                    f.type = descriptor_pb2.FieldDescriptorProto.TYPE_BYTES
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file_proto)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName(desc.full_name))


def _diagnose(mirror: type[message.Message], data: bytes, error: Exception) -> Undecodable:
    """Name the field that failed to parse (the first string field with bad UTF-8)."""
    try:
        raw = mirror.FromString(data)
    except message.DecodeError:
        return Undecodable("request", f"is not a valid protobuf message: {error}")
    for field, value in raw.ListFields():
        if field.type != field.TYPE_BYTES:
            continue
        single = isinstance(value, bytes)
        for i, item in enumerate([value] if single else value):
            try:
                item.decode("utf-8")
            except UnicodeDecodeError as exc:
                return Undecodable(
                    field.name if single else f"{field.name}[{i}]",
                    f"is not valid UTF-8 (byte {exc.start}: {exc.reason}); send UTF-8 text",
                )
    return Undecodable("request", f"cannot be parsed: {error}")


def _lenient(cls: type[message.Message]) -> Callable[[bytes], message.Message | Undecodable]:
    """A request deserializer that never raises: grpc would answer INTERNAL for a parse error
    (protobuf rejects invalid UTF-8 in string fields); the servicer answers INVALID_ARGUMENT."""
    mirror = _bytes_mirror(cls.DESCRIPTOR)

    def parse(data: bytes) -> message.Message | Undecodable:
        try:
            return cls.FromString(data)
        except message.DecodeError as exc:
            try:
                return _diagnose(mirror, data, exc)
            except Exception:  # a raising deserializer would reach the client as UNKNOWN
                log.exception("request_diagnosis_failed")
                return Undecodable("request", f"cannot be parsed: {exc}")

    return parse


def _parsed(request: Any) -> Any:
    if isinstance(request, Undecodable):
        raise InvalidRequest(request.field, request.problem)
    return request


async def _parsed_all(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
    async for request in requests:
        yield _parsed(request)


def from_pb(request: pb.GenerateRequest | Undecodable, partial: bool = False) -> GenerateInput:
    """GenerateRequest -> GenerateInput; raises InvalidRequest for what only the API defines
    (ranges of the sampling values are left to backend.validate). `partial`: StreamGenerate's
    start, whose prompt may be empty."""
    req: pb.GenerateRequest = _parsed(request)
    given = [f for f in ("prompt", "prompt_token_ids", "messages") if getattr(req, f)]
    if len(given) > 1:
        raise InvalidRequest(
            given[0],
            f"give one of prompt, prompt_token_ids and messages, not {' and '.join(given)}",
        )
    if not given and not partial:
        raise InvalidRequest(
            "prompt",
            "is empty, and so are prompt_token_ids and messages (an empty list is no list):"
            " give prompt (text), prompt_token_ids (at least one token) or messages (at least"
            " one message)",
        )
    if len(req.request_id) > MAX_REQUEST_ID_LEN:
        raise InvalidRequest("request_id", f"is longer than {MAX_REQUEST_ID_LEN} characters")
    # Counts are checked before the repeated fields are copied: a message of millions of
    # entries is refused in O(1).
    if len(req.stop) > MAX_STOP_STRINGS:
        raise StopStringError(
            f"stop: at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(req.stop)}"
        )
    if len(req.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequest(
            "stop_token_ids",
            f"has {len(req.stop_token_ids)} ids; at most {MAX_STOP_TOKEN_IDS} are allowed",
        )
    stop = validate_stops(list(req.stop))  # StopStringError names stop[i] and the limits
    sampling = {f: getattr(req.sampling, f) for f in _SAMPLING_FIELDS if req.sampling.HasField(f)}
    params = SamplingParams(
        **sampling,
        max_tokens=req.max_tokens if req.HasField("max_tokens") else DEFAULT_MAX_TOKENS,
        stop_token_ids=tuple(req.stop_token_ids),
        ignore_eos=req.ignore_eos,
    )
    return GenerateInput(
        request_id=req.request_id or f"req-{uuid.uuid4().hex}",
        prompt=req.prompt or None,
        prompt_token_ids=req.prompt_token_ids,
        messages=tuple(ChatMessage(m.role, m.content) for m in req.messages),
        add_generation_prompt=(
            req.add_generation_prompt if req.HasField("add_generation_prompt") else True
        ),
        add_special_tokens=req.add_special_tokens if req.HasField("add_special_tokens") else True,
        params=params,
        stop=tuple(stop),
    )


def to_pb(request_id: str, delta: Delta) -> pb.GenerateResponse:
    """Delta -> GenerateResponse; the last one carries finish_reason and usage."""
    resp = pb.GenerateResponse(request_id=request_id, token_ids=delta.token_ids, text=delta.text)
    if delta.logprobs is not None:
        for lp in delta.logprobs:
            tok = resp.logprobs.tokens.add(token_id=lp.token_id, logprob=lp.logprob)
            for token_id, logprob in lp.top:
                tok.top.add(token_id=token_id, logprob=logprob)
    if delta.finished:
        assert delta.finish_reason is not None
        resp.finish_reason = _FINISH_PB[delta.finish_reason]
        resp.usage.prompt_tokens = delta.prompt_tokens
        resp.usage.completion_tokens = delta.completion_tokens
    return resp


def model_info_to_pb(info: dict[str, Any]) -> pb.GetModelInfoResponse:
    known = pb.GetModelInfoResponse.DESCRIPTOR.fields_by_name
    fields = {k: v for k, v in info.items() if k in known}
    # The maps are keyed by batch size, which JSON (the rings' stats) gives as text.
    for name, value in fields.items():
        entry = known[name].message_type
        if entry is not None and entry.GetOptions().map_entry:
            fields[name] = {int(k): v for k, v in value.items()}
    return pb.GetModelInfoResponse(**fields)


# -- errors to status codes -----------------------------------------------------------------

R = TypeVar("R")
Handler = Callable[["GenerationService", Any, grpc.aio.ServicerContext], Awaitable[R]]


def grpc_errors(method: Handler[R]) -> Handler[R]:
    """Map the exceptions of a servicer coroutine to status codes; anything unexpected is
    logged and answered INTERNAL without internals in the details."""

    @functools.wraps(method)
    async def wrapper(
        self: GenerationService, request: Any, context: grpc.aio.ServicerContext
    ) -> R:
        try:
            return await method(self, request, context)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:
            code = next((c for t, c in _STATUS if isinstance(exc, t)), None)
            if isinstance(exc, StepFailed):
                code = _STEP_STATUS[exc.code]
            if code is None:
                log.exception("internal_error", rpc=method.__name__)
                code, details = grpc.StatusCode.INTERNAL, "internal error (see the server log)"
            else:
                details = str(exc)
                log.info("request_rejected", rpc=method.__name__, code=code.name, details=details)
            self.metrics.rejected.labels(code=code.name).inc()
            await context.abort(code, details)
            raise AssertionError("unreachable: context.abort raises") from exc

    return wrapper


# -- the servicer ---------------------------------------------------------------------------


class GenerationService(pb_grpc.GenerationServiceServicer):
    """hybridgen.v1.GenerationService over a Backend."""

    def __init__(
        self, backend: Backend, metrics: Metrics, max_queue: int, request_timeout_s: float = 0.0
    ) -> None:
        self.backend = backend
        self.metrics = metrics
        self.max_queue = max_queue
        self.request_timeout_s = request_timeout_s
        """Longest a Generate call may run (DEADLINE_EXCEEDED, KV freed); 0: no limit."""
        self.draining = False
        """Set on shutdown: new calls get UNAVAILABLE while running ones finish."""
        self._stop_at: float | None = None
        """When running calls end with ServerStopping (stop_calls_at), as a loop.time()."""
        self._limits: dict[asyncio.Timeout, float | None] = {}
        """The time limits in force (time_limit), with their own deadline (None: none)."""
        self._reserved = 0
        """Admitted requests whose stream has not started yet (see `admit`)."""

    @grpc_errors
    async def Generate(
        self, request: pb.GenerateRequest | Undecodable, context: grpc.aio.ServicerContext
    ) -> None:
        arrival = time.monotonic()
        req = _bound(from_pb, request)
        start = asyncio.get_running_loop().time()
        async with self.time_limit(start):
            prompt_ids = await self.admit(req)
        stream = self.backend.generate(req.request_id, prompt_ids, req.params, list(req.stop))
        deltas = self.deltas(req.request_id, stream, lambda: arrival, self.deadline(start))
        async with self.time_limit(start, WRITE_GRACE_S):
            await _write(req.request_id, deltas, context)

    @grpc_errors
    async def StreamGenerate(
        self, requests: AsyncIterator[object], context: grpc.aio.ServicerContext
    ) -> None:
        messages = _parsed_all(requests)
        first = await anext(messages, None)
        if first is None or not first.HasField("start"):
            raise InvalidRequest("start", "the first message must be start (a GenerateRequest)")
        req = _bound(functools.partial(from_pb, partial=True), first.start)
        if req.messages:
            raise InvalidRequest(
                "start.messages", "is not streamed: give prompt or prompt_token_ids parts"
            )
        self._check_available()
        await self.backend.validate(req.prompt_token_ids, req.params, partial=True)
        self._reserve()
        log.info("request_admitted", streamed=True, **_summary(req.params))
        text = True if req.prompt else (False if req.prompt_token_ids else None)
        reader = PartReader(messages, text)
        start = PromptPart(req.prompt or "", tuple(req.prompt_token_ids))
        stream = self.backend.stream_generate(req, start, reader.parts())
        # TTFT counts from the last part: what a speaker waits for.
        begun = asyncio.get_running_loop().time()
        deltas = self.deltas(req.request_id, stream, lambda: reader.last_at, self.deadline(begun))
        async with self.time_limit(begun, WRITE_GRACE_S):
            await _write(req.request_id, deltas, context)

    async def admit(self, req: GenerateInput, count: int = 1) -> list[int]:
        """What every front end does before a request streams: availability, the prompt's
        ids (text and chat tokenized off the event loop, bounded first), the backend's checks
        and the admission queue, with room for `count` requests (n samples of one prompt).
        Returns the prompt's ids."""
        self._check_available()
        prompt_ids = req.prompt_token_ids
        if req.prompt is not None:
            prompt_ids = await self._tokenize_prompt(req.prompt, req.add_special_tokens)
        elif req.messages:
            prompt_ids = await self.backend.tokenize_chat(req.messages, req.add_generation_prompt)
        await self.backend.validate(prompt_ids, req.params)
        prompt_ids = list(prompt_ids)  # a copy of what is now known to fit the context
        self._reserve(count)
        log.info("request_admitted", prompt_tokens=len(prompt_ids), **_summary(req.params))
        return prompt_ids

    def deadline(self, start: float) -> float | None:
        """When server.request_timeout_s ends a call that began at `start` (a loop.time());
        None: no limit."""
        return start + self.request_timeout_s if self.request_timeout_s else None

    @contextlib.asynccontextmanager
    async def time_limit(
        self, start: float | None = None, grace_s: float = 0.0
    ) -> AsyncIterator[None]:
        """server.request_timeout_s (plus `grace_s`) around a call (or a part of one that
        began at `start`, a loop.time()): past it the call ends with DEADLINE_EXCEEDED
        (RequestTimedOut), and its stream's abort frees the KV. A call whose streams end
        themselves at the deadline (`deltas`) takes WRITE_GRACE_S: the limit then cuts off
        only a writer still blocked after it (a client that stopped reading)."""
        begun = asyncio.get_running_loop().time() if start is None else start
        own_at = self.deadline(begun)
        own_at = None if own_at is None else own_at + grace_s
        try:
            async with asyncio.timeout_at(_earliest(own_at, self._stop_at)) as deadline:
                self._limits[deadline] = own_at
                try:
                    yield
                finally:
                    del self._limits[deadline]
        except TimeoutError:
            if not deadline.expired():
                raise
            if own_at is None or (self._stop_at is not None and self._stop_at <= own_at):
                raise ServerStopping(
                    "the server is stopping: this request was still running when its drain "
                    "grace ran out, so it was ended here; retry it"
                ) from None
            raise self._timed_out() from None

    def _timed_out(self) -> RequestTimedOut:
        return RequestTimedOut(
            f"the request ran longer than {self.request_timeout_s:g} s "
            "(server.request_timeout_s) before its first token; it was stopped and its KV freed"
        )

    def stop_calls_at(self, when: float) -> None:
        """On shutdown: calls still running at `when` (a loop.time()) end with ServerStopping,
        a status their clients can read, before the servers' grace cuts the connections."""
        self._stop_at = when
        for deadline, own in self._limits.items():
            deadline.reschedule(_earliest(own, when))

    def _reserve(self, count: int = 1) -> None:
        """Take `count` places in the admission queue or raise QueueFull. Each is held until
        its stream starts in `deltas` (then the backend counts it), or is given back with
        `release` by a front end whose request ended before."""
        if self.backend.queue_depth() + self._reserved + count > self.max_queue:
            raise QueueFull(
                f"admission queue is full ({self.max_queue} requests waiting); retry later"
            )
        self._reserved += count

    async def _tokenize_prompt(self, prompt: str, add_special_tokens: bool) -> list[int]:
        """The prompt's ids; the backend's errors about its `text` name the prompt field."""
        try:
            return await self.backend.tokenize(prompt, add_special_tokens)
        except InvalidRequest as exc:
            if exc.field != "text":
                raise
            raise InvalidRequest("prompt", str(exc).partition(": ")[2]) from None

    def release(self, count: int = 1) -> None:
        """Give back admitted places whose streams will not start."""
        self._reserved -= count

    async def deltas(
        self,
        request_id: str,
        stream: AsyncIterator[Delta],
        arrival: Callable[[], float],
        deadline: float | None = None,
    ) -> AsyncIterator[Delta]:
        """A backend's stream on its way to a client, measured; a client that goes away
        (this iterator closed early, or its task cancelled) aborts the request at once. Its
        first step hands the admission's place to the backend, which counts the request as
        it starts (no await between). At `deadline` (a loop.time(): server.request_timeout_s)
        a request that has tokens ends there with finish reason length, keeping what it sent
        (as llama.cpp's time limit does; text the backend still held back, such as a possible
        stop-string prefix, is not sent); one without any ends with RequestTimedOut."""
        self._reserved -= 1
        outcome, last, tokens, prompt_tokens = "error", 0.0, 0, 0
        refused = False  # the backend refused it before it ran: nothing of it to abort
        try:
            async with contextlib.aclosing(stream):  # type: ignore[type-var]
                while True:
                    timer = asyncio.timeout_at(deadline)
                    try:
                        async with timer:
                            delta = await anext(stream)
                    except StopAsyncIteration:
                        break
                    except TimeoutError:
                        if not timer.expired():
                            raise
                        outcome = "time_limit"
                        if not tokens:
                            raise self._timed_out() from None
                        yield Delta((), "", None, True, FinishReason.LENGTH, prompt_tokens, tokens)
                        return
                    last = self._observe(delta, arrival(), last, first=tokens == 0)
                    tokens += len(delta.token_ids)
                    prompt_tokens = delta.prompt_tokens
                    if delta.finish_reason is not None:
                        outcome = delta.finish_reason.value
                    yield delta
        except InvalidRequest:
            # Before its first message (a request_id already running): the id is another
            # call's, which an abort would end.
            refused = last == 0.0
            raise
        except (asyncio.CancelledError, GeneratorExit):
            outcome = "cancelled"  # the client went away or its deadline passed
            raise
        finally:
            if outcome in ("error", "cancelled", "time_limit") and not refused:
                await self.backend.abort(request_id)  # frees the KV now, not at GC
            self.metrics.requests.labels(finish_reason=outcome).inc()
            log.info("request_finished", finish_reason=outcome, completion_tokens=tokens)

    def _observe(self, delta: Delta, arrival: float, last: float, first: bool) -> float:
        """Record TTFT, or the inter-token latency of a Delta's tokens (a message of n tokens
        counts n gaps of 1/n); returns the time of this Delta."""
        n = len(delta.token_ids)
        if not n:
            return last
        now = time.monotonic()
        if first:
            self.metrics.ttft.observe(now - arrival)
            return now
        for _ in range(n):
            self.metrics.inter_token_latency.observe((now - last) / n)
        return now

    @grpc_errors
    async def Tokenize(
        self, request: pb.TokenizeRequest | Undecodable, context: grpc.aio.ServicerContext
    ) -> pb.TokenizeResponse:
        req: pb.TokenizeRequest = _parsed(request)
        self._check_available()
        if req.messages and req.text:
            raise InvalidRequest("text", "give either text or messages, not both")
        if req.messages:
            generation = (
                req.add_generation_prompt if req.HasField("add_generation_prompt") else True
            )
            messages = [ChatMessage(m.role, m.content) for m in req.messages]
            ids = await self.backend.tokenize_chat(messages, generation)
            return pb.TokenizeResponse(token_ids=ids)
        add = req.add_special_tokens if req.HasField("add_special_tokens") else True
        return pb.TokenizeResponse(token_ids=await self.backend.tokenize(req.text, add))

    @grpc_errors
    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest | Undecodable, context: grpc.aio.ServicerContext
    ) -> pb.GetModelInfoResponse:
        _parsed(request)
        self._check_available()
        info = await self.backend.model_info()
        return model_info_to_pb({**info, "max_queue": self.max_queue})

    def _check_available(self) -> None:
        if self.draining:
            raise BackendUnavailable("the server is draining; retry on another replica")
        if not self.backend.ready():
            raise BackendUnavailable("the model is loading or its backend is down; retry later")


def _earliest(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else min(a, b)


def _summary(params: SamplingParams) -> dict[str, Any]:
    return {"max_tokens": params.max_tokens, "temperature": params.temperature}


def _bound(parse: Callable[[Any], GenerateInput], request: Any) -> GenerateInput:
    """Parse a request with its id bound to the log lines (each RPC runs in its own task and
    context), the client's before parsing, so that a refusal names it too."""
    structlog.contextvars.clear_contextvars()
    if not isinstance(request, Undecodable) and request.request_id:
        structlog.contextvars.bind_contextvars(request_id=request.request_id)
    req = parse(request)
    structlog.contextvars.bind_contextvars(request_id=req.request_id)
    return req


async def _write(
    request_id: str, deltas: AsyncIterator[Delta], context: grpc.aio.ServicerContext
) -> None:
    async with contextlib.aclosing(deltas):  # type: ignore[type-var]
        async for delta in deltas:
            await context.write(to_pb(request_id, delta))


def add_to_server(service: GenerationService, server: grpc.aio.Server) -> None:
    """Register the service with lenient request deserializers (see `_lenient`)."""
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            service.Generate,
            request_deserializer=_lenient(pb.GenerateRequest),
            response_serializer=pb.GenerateResponse.SerializeToString,
        ),
        "StreamGenerate": grpc.stream_stream_rpc_method_handler(
            service.StreamGenerate,
            request_deserializer=_lenient(pb.StreamGenerateRequest),
            response_serializer=pb.GenerateResponse.SerializeToString,
        ),
        "Tokenize": grpc.unary_unary_rpc_method_handler(
            service.Tokenize,
            request_deserializer=_lenient(pb.TokenizeRequest),
            response_serializer=pb.TokenizeResponse.SerializeToString,
        ),
        "GetModelInfo": grpc.unary_unary_rpc_method_handler(
            service.GetModelInfo,
            request_deserializer=_lenient(pb.GetModelInfoRequest),
            response_serializer=pb.GetModelInfoResponse.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)
