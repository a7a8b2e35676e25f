"""The OpenAI-compatible HTTP API, in the gateway process beside gRPC (`server.http_port`).

    POST /v1/completions, /v1/chat/completions   (stream: server-sent events, data: [DONE])
    GET  /v1/models    POST /tokenize, /detokenize    GET /health, /metrics

A request takes the gRPC path from the service's `admit` on: the same checks, the same
admission queue, the same backend and the same `deltas` (metrics; a client that goes away
aborts its requests and frees their KV). Chat messages are rendered with the model's chat
template (the tokenizer of the served model, loaded here once) and tokenized like a text
prompt. `n` samples of one prompt share its KV: the first sample computes the prompt, the
others start once it has (its full blocks are then in the prefix cache).

Errors are OpenAI's error object: 400 naming the parameter, 401 without a valid API key
(when an `authorize` check is given), 404 for an unknown model or path, 429 when the
admission queue is full, 503 while loading, draining or with a daemon down.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import structlog
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from hybridgen.engine.sequence import FinishReason
from hybridgen.engine.step_errors import ErrorCode, StepFailed
from hybridgen.engine.validation import InvalidRequest
from hybridgen.models.default_model import shown_name
from hybridgen.models.tokenizer import ChatTemplateError, Tokenizer
from hybridgen.models.tokenizer_source import load_tokenizer
from hybridgen.sampling.params import InvalidSamplingParameter
from hybridgen.serving.backend import BackendUnavailable
from hybridgen.serving.delta import Delta
from hybridgen.serving.openai_request import (
    OpenAIRequest,
    chat_messages,
    completion_prompts,
    parse,
    sample_inputs,
)
from hybridgen.serving.openai_response import DONE, Responder, event
from hybridgen.serving.service import (
    WRITE_GRACE_S,
    GenerateInput,
    GenerationService,
    QueueFull,
    RequestTimedOut,
)
from hybridgen.serving.stop_strings import StopStringError

log = structlog.get_logger()

Authorize = Callable[[str | None], bool]
"""An API-key check: the request's Authorization header (None when absent) -> allowed."""

# (exception, HTTP status, OpenAI error type, the gRPC status name it counts as in metrics)
_ERRORS: tuple[tuple[type[BaseException], int, str, str], ...] = (
    (InvalidRequest, 400, "invalid_request_error", "INVALID_ARGUMENT"),
    (InvalidSamplingParameter, 400, "invalid_request_error", "INVALID_ARGUMENT"),
    (StopStringError, 400, "invalid_request_error", "INVALID_ARGUMENT"),
    (ChatTemplateError, 400, "invalid_request_error", "INVALID_ARGUMENT"),
    (QueueFull, 429, "rate_limit_exceeded", "RESOURCE_EXHAUSTED"),
    (BackendUnavailable, 503, "service_unavailable", "UNAVAILABLE"),
    (RequestTimedOut, 504, "timeout_error", "DEADLINE_EXCEEDED"),
    # gone while sending its body: no one reads the answer, and it is no server error
    (ClientDisconnect, 499, "client_closed_request", "CANCELLED"),
)
_STEP_ERRORS = {
    ErrorCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    ErrorCode.RESOURCE_EXHAUSTED: (429, "rate_limit_exceeded"),
    ErrorCode.INTERNAL: (500, "internal_error"),
}
WARM_POLL_S = 0.2
"""How often `warm` looks whether the backend is ready."""
_END = object()
"""A choice's stream ended (on the multiplexing queue)."""


class ApiError(Exception):
    """An error answered as is: HTTP status, OpenAI type, param, code."""

    def __init__(
        self, status: int, message: str, kind: str, param: str | None = None, code: str = ""
    ) -> None:
        super().__init__(message)
        self.status, self.kind, self.param, self.code = status, kind, param, code or None


class ClientGone(Exception):
    """The client closed the connection before its answer was ready."""


@dataclasses.dataclass(frozen=True)
class _NoToken:
    """A choice that server.request_timeout_s ended before its first token (Choices)."""

    index: int
    delta: Delta
    """Its last Delta should another choice have tokens: empty, finish reason length."""
    error: RequestTimedOut
    """Its error should none have any."""


class Choices:
    """The running choices of one request (n samples of each admitted prompt), started at
    once; iterate for (choice index, Delta) as they come. `close` cancels what still runs
    (each aborts its request, freeing its KV) and gives back the admission places of
    samples that never started."""

    def __init__(
        self,
        service: GenerationService,
        admitted: list[tuple[GenerateInput, list[int]]],
        n: int,
        deadline: float | None,
    ) -> None:
        """`deadline`: server.request_timeout_s's end for every choice (service.deltas)."""
        self._service = service
        self._deadline = deadline
        self._q: asyncio.Queue[object] = asyncio.Queue()
        self._entered = 0
        self._tasks = []
        for p, (inp, ids) in enumerate(admitted):
            prefilled = asyncio.Event()
            for j, sample in enumerate(sample_inputs(inp, n)):
                run = self._run(p * n + j, sample, ids, prefilled, j > 0)
                self._tasks.append(asyncio.create_task(run))
        self._closed = False

    async def __aiter__(self) -> AsyncIterator[tuple[int, Delta]]:
        running, tokens = len(self._tasks), False
        while running:
            item = await self._q.get()
            if item is _END:
                running -= 1
            elif isinstance(item, _NoToken):
                # server.request_timeout_s came before this choice's first token: while
                # another has tokens the answer keeps them (this one ends empty, length), else
                # the request times out.
                if not tokens:
                    raise item.error
                yield item.index, item.delta
            elif isinstance(item, BaseException):
                raise item  # one failed: the caller closes them all
            else:
                tokens = tokens or bool(item[1].token_ids)  # type: ignore[index]
                yield item  # type: ignore[misc]

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._service.release(len(self._tasks) - self._entered)

    async def _run(
        self,
        index: int,
        inp: GenerateInput,
        prompt_ids: list[int],
        prefilled: asyncio.Event,
        after_first: bool,
    ) -> None:
        """One sample's Deltas onto the queue. A later sample of a prompt waits until the
        first has its first token: the prompt's blocks are then cached, and it starts from
        them."""
        arrival = time.monotonic()
        try:
            if after_first:
                await prefilled.wait()
            backend = self._service.backend
            stream = backend.generate(inp.request_id, prompt_ids, inp.params, list(inp.stop))
            deltas = self._service.deltas(inp.request_id, stream, lambda: arrival, self._deadline)
            self._entered += 1  # deltas takes the admitted place over at once (no await)
            async with contextlib.aclosing(deltas):  # type: ignore[type-var]
                async for delta in deltas:
                    prefilled.set()
                    self._q.put_nowait((index, delta))
        except RequestTimedOut as exc:
            empty = Delta((), "", None, True, FinishReason.LENGTH, len(prompt_ids), 0)
            self._q.put_nowait(_NoToken(index, empty, exc))
        except Exception as exc:
            self._q.put_nowait(exc)
        finally:
            prefilled.set()  # the others go on even if this one failed or was cancelled
            self._q.put_nowait(_END)


class _EventStream(StreamingResponse):
    """A server-sent event stream that closes its choices however the response ends
    (finished, failed, or the client gone before or while it streamed)."""

    def __init__(self, events: AsyncIterator[str], close: Callable[[], Awaitable[None]]) -> None:
        super().__init__(events, media_type="text/event-stream")
        self._close = close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._close()


def error_body(message: str, kind: str, param: str | None, code: str | None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class OpenAIApi:
    """The routes over one GenerationService."""

    def __init__(
        self,
        service: GenerationService,
        authorize: Authorize | None = None,
        max_body_bytes: int = 16 << 20,
        cors_origins: tuple[str, ...] = (),
    ) -> None:
        self.service = service
        self._authorize = authorize
        self.cors_origins = cors_origins
        """server.cors_origins: who may call from a browser page of another origin."""
        self.max_body_bytes = max_body_bytes
        """Largest request body read (server.max_message_mb, as a gRPC message)."""
        self._model: tuple[str, Tokenizer, int] | None = None
        """The served model's name as the API shows it (shown_name), its tokenizer and context."""
        self._served = ""
        """The served model as the backend names it (a path): what a request may name."""
        self._model_lock = asyncio.Lock()
        self._started = int(time.time())

    def app(self) -> Starlette:
        guard = self._guarded
        routes = [
            Route("/v1/completions", guard(self.completions), methods=["POST"]),
            Route("/v1/chat/completions", guard(self.chat_completions), methods=["POST"]),
            Route("/v1/models", guard(self.models), methods=["GET"]),
            Route("/v1/models/{model:path}", guard(self.model), methods=["GET"]),
            Route("/tokenize", guard(self.tokenize), methods=["POST"]),
            Route("/detokenize", guard(self.detokenize), methods=["POST"]),
            Route("/metrics", guard(self.metrics), methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),  # open, as gRPC health is
        ]
        middleware = []
        if self.cors_origins:
            # Preflights are answered before the routes (and the API key check: a browser
            # sends none with them); the answers carry Access-Control-Allow-Origin.
            cors = Middleware(
                CORSMiddleware,
                allow_origins=list(self.cors_origins),
                allow_methods=["GET", "POST"],
                allow_headers=["*"],
            )
            middleware.append(cors)
        return Starlette(
            routes=routes, middleware=middleware, exception_handlers={HTTPException: _http_error}
        )

    # -- routes ------------------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        body = await self._json(request)
        model, _, _ = await self._model_facts(body)
        req = parse(body, False, completion_prompts(body))
        return await self._answer(request, req, model)

    async def chat_completions(self, request: Request) -> Response:
        body = await self._json(request)
        model, tokenizer, _ = await self._model_facts(body)
        messages = chat_messages(body)
        add_prompt = body.get("add_generation_prompt", True)
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_prompt is True)
        req = parse(body, True, [text])
        return await self._answer(request, req, model)

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [await self._model_entry({})]})

    async def model(self, request: Request) -> Response:
        """GET /v1/models/{model} (the client's models.retrieve): the served model's entry,
        404 for any other name."""
        return JSONResponse(await self._model_entry({"model": request.path_params["model"]}))

    async def _model_entry(self, body: dict[str, Any]) -> dict[str, Any]:
        model, _, max_len = await self._model_facts(body)
        return {
            "id": model,
            "object": "model",
            "created": self._started,
            "owned_by": "hybridgen",
            "max_model_len": max_len,
        }

    async def tokenize(self, request: Request) -> Response:
        body = await self._json(request)
        _, tokenizer, max_len = await self._model_facts(body)
        if "messages" in body:
            add = body.get("add_generation_prompt", True) is True
            text = tokenizer.apply_chat_template(chat_messages(body), add_generation_prompt=add)
            special = body.get("add_special_tokens", False)
        else:
            prompt, special = body.get("prompt"), body.get("add_special_tokens", True)
            if not isinstance(prompt, str):
                raise InvalidRequest("prompt", "must be a string (or give messages)")
            text = prompt
        if not isinstance(special, bool):
            raise InvalidRequest("add_special_tokens", "must be true or false")
        self._check_available()
        ids = await self.service.backend.tokenize(text, special)
        return JSONResponse({"count": len(ids), "max_model_len": max_len, "tokens": ids})

    async def detokenize(self, request: Request) -> Response:
        body = await self._json(request)
        _, tokenizer, _ = await self._model_facts(body)
        ids, vocab = body.get("tokens"), tokenizer.vocab_size
        if not isinstance(ids, list) or not all(_is_id(t, vocab) for t in ids):
            raise InvalidRequest("tokens", f"must be a list of token ids in [0, {vocab})")
        return JSONResponse({"prompt": tokenizer.decode(ids, skip_special_tokens=False)})

    async def health(self, request: Request) -> Response:
        try:
            self._check_available()
        except BackendUnavailable as exc:
            return _error_response(ApiError(503, str(exc), "service_unavailable"))
        return Response(status_code=200)

    async def metrics(self, request: Request) -> Response:
        registry = self.service.metrics.registry
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    # -- generation --------------------------------------------------------------------------

    async def _answer(self, request: Request, req: OpenAIRequest, model: str) -> Response:
        """Admit every prompt, then stream or collect its choices, all of it within
        server.request_timeout_s (as a gRPC call)."""
        start = asyncio.get_running_loop().time()
        _, tokenizer, max_len = await self._model_facts({})
        admitted = []
        try:
            async with self.service.time_limit(start):
                for inp in req.inputs:
                    inp = await self._ready_input(inp, req, max_len)
                    admitted.append((inp, await self.service.admit(inp, count=req.n)))
        except BaseException as exc:
            self.service.release(req.n * len(admitted))
            raise _renamed(exc, req) from None
        responder = Responder(req, model, tokenizer)
        choices = Choices(self.service, admitted, req.n, self.service.deadline(start))
        deltas = _within(self.service, start, choices.__aiter__())
        if req.stream:
            return _EventStream(_events(responder, deltas, req), choices.close)
        try:
            await _unless_gone(request, _collect(responder, deltas))
        except ClientGone:
            log.info("client_gone", request_id=req.inputs[0].request_id)
            return Response(status_code=499)
        except Exception as exc:
            raise _renamed(exc, req) from None
        finally:
            await choices.close()
        return JSONResponse(responder.body())

    async def _ready_input(
        self, inp: GenerateInput, req: OpenAIRequest, max_len: int
    ) -> GenerateInput:
        """A chat without max_tokens generates to the end of the context: its prompt is
        tokenized here to know how far that is."""
        if not req.to_context_end:
            return inp
        self._check_available()
        assert inp.prompt is not None
        ids = await self.service.backend.tokenize(inp.prompt, inp.add_special_tokens)
        params = dataclasses.replace(inp.params, max_tokens=max(1, max_len - len(ids)))
        return dataclasses.replace(inp, prompt=None, prompt_token_ids=tuple(ids), params=params)

    # -- helpers -----------------------------------------------------------------------------

    def _guarded(
        self, handler: Callable[[Request], Awaitable[Response]]
    ) -> Callable[[Request], Awaitable[Response]]:
        """The API-key check, then the handler, with its exceptions as OpenAI errors."""

        async def route(request: Request) -> Response:
            try:
                if self._authorize is not None and not self._authorize(
                    request.headers.get("authorization")
                ):
                    raise ApiError(
                        401,
                        "missing or wrong API key",
                        "invalid_request_error",
                        None,
                        "invalid_api_key",
                    )
                return await handler(request)
            except Exception as exc:
                error = _api_error(exc)
                self.service.metrics.rejected.labels(code=_grpc_name(error.status)).inc()
                return _error_response(error)

        return route

    async def warm(self) -> None:
        """Load the served model's name, tokenizer and length as soon as the backend is
        ready: the first HTTP call would. A failure is logged; the first call tries again."""
        while not self.service.backend.ready():
            await asyncio.sleep(WARM_POLL_S)
        try:
            await self._model_facts({})
        except Exception as exc:
            log.warning("http_model_not_loaded", error=str(exc))
        else:
            log.info("http_model_loaded", model=self._model[0] if self._model else None)

    @staticmethod
    def _names(named: str, served: str) -> bool:
        """Whether a request's `model` names the served one, in any case: its path, a path of
        the same name, or for the default model its name (`model.name_or_path`'s default) or
        its Hugging Face id (HuggingFaceTB/SmolLM2-135M-Instruct, the name users type)."""
        name = Path(named).name.lower()
        shown = shown_name(served).lower()
        return name in (Path(served).name.lower(), shown) or named.lower() == shown

    async def _json(self, request: Request) -> dict[str, Any]:
        return _parse_json(await _body(request, self.max_body_bytes))

    def _check_available(self) -> None:
        if self.service.draining:
            raise BackendUnavailable("the server is draining; retry on another replica")
        if not self.service.backend.ready():
            raise BackendUnavailable("the model is loading or its backend is down; retry later")

    async def _model_facts(self, body: Any) -> tuple[str, Tokenizer, int]:
        """The served model's name, its tokenizer and max_model_len (loaded once); a body
        that names another model gets 404."""
        if self._model is None:
            self._check_available()
            async with self._model_lock:
                if self._model is None:
                    info = await self.service.backend.model_info()
                    tokenizer = await asyncio.to_thread(load_tokenizer, info["model"])
                    self._served = info["model"]
                    self._model = (shown_name(self._served), tokenizer, int(info["max_model_len"]))
        model = self._model
        named = body.get("model") if isinstance(body, dict) else None
        if named is not None and not isinstance(named, str):
            raise InvalidRequest("model", f"must be a string, got {named!r}")
        # The served name, or a path to a folder of that name (tools load the tokenizer
        # from the path they name the model with), or the default model's own name.
        if named is not None and not self._names(named, self._served):
            raise ApiError(
                404,
                f"the model {named!r} does not exist; this server serves {model[0]!r}",
                "invalid_request_error",
                "model",
                "model_not_found",
            )
        return model


async def _events(
    responder: Responder, deltas: AsyncIterator[tuple[int, Delta]], req: OpenAIRequest
) -> AsyncIterator[str]:
    """The server-sent events of a streamed answer; an error mid-stream is an error event."""
    for chunk in responder.first_chunks():
        yield event(chunk)
    try:
        async for index, delta in deltas:
            payload = responder.chunk(index, delta)
            if payload is not None:
                yield event(payload)
        if req.include_usage:
            yield event(responder.usage_chunk())
    except Exception as exc:
        error = _api_error(_renamed(exc, req))
        yield event(error_body(str(error), error.kind, error.param, error.code))
    yield DONE


async def _within(
    service: GenerationService, start: float, deltas: AsyncIterator[tuple[int, Delta]]
) -> AsyncIterator[tuple[int, Delta]]:
    """The choices' Deltas, each awaited within the time limit (not around the yield: it
    cancels the waiting task, not the one sending to the client). server.request_timeout_s
    ends each choice in service.deltas, keeping what it generated; this limit, WRITE_GRACE_S
    later, and the server's stop are the backstops."""
    while True:
        async with service.time_limit(start, WRITE_GRACE_S):
            try:
                item = await anext(deltas)
            except StopAsyncIteration:
                return
        yield item


async def _collect(responder: Responder, deltas: AsyncIterator[tuple[int, Delta]]) -> None:
    async for index, delta in deltas:
        responder.add(index, delta)


async def _unless_gone(request: Request, work: Awaitable[None]) -> None:
    """Run `work`; if the client disconnects first, cancel it and raise ClientGone."""
    task = asyncio.ensure_future(work)

    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(gone())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            raise ClientGone
    task.result()


async def _body(request: Request, limit: int) -> bytes:
    """The request's body, refused (413) past `limit` bytes before more of it is read."""

    def too_large(size: str) -> ApiError:
        return ApiError(
            413,
            f"the request body is {size} bytes, more than the {limit} that "
            "server.max_message_mb allows",
            "invalid_request_error",
            "body",
            "request_too_large",
        )

    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large(declared)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(f"over {limit}")
        chunks.append(chunk)
    return b"".join(chunks)


def _parse_json(raw: bytes) -> dict[str, Any]:
    too_deep = InvalidRequest("body", "nests arrays or objects too deeply")
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:  # ValueError: JSONDecodeError, and an
        # integer past Python's 4,300 digits
        raise InvalidRequest("body", f"is not valid JSON: {exc}") from None
    except RecursionError:
        raise too_deep from None
    if not isinstance(body, dict):
        raise InvalidRequest("body", "must be a JSON object")
    try:
        _check_unicode(body, "")
    except RecursionError:  # a depth json.loads took, with this walk's frames on top
        raise too_deep from None
    return body


def _check_unicode(value: Any, path: str) -> None:
    """JSON may escape half a UTF-16 pair (\\ud800) that is no Unicode character, and no
    UTF-8 text can carry it: the first string (or key) holding one is refused by its path."""
    if isinstance(value, str):
        try:
            value.encode()  # at C speed: a prompt may be megabytes
        except UnicodeEncodeError as exc:
            at = exc.start
            raise InvalidRequest(
                path or "body",
                f"holds a lone UTF-16 surrogate (U+{ord(value[at]):04X} at character {at}), "
                "which is not Unicode text: send valid UTF-8",
            ) from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_unicode(key, path or "body")
            _check_unicode(item, f"{path}.{key}" if path else key)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_unicode(item, f"{path}[{i}]")


def _api_error(exc: BaseException) -> ApiError:
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, StepFailed):
        status, kind = _STEP_ERRORS[exc.code]
        return ApiError(status, str(exc), kind)
    for cls, status, kind, _ in _ERRORS:
        if isinstance(exc, cls):
            return ApiError(status, str(exc), kind, _param(exc))
    log.error("internal_error", error=repr(exc), exc_info=exc)
    return ApiError(500, "internal error (see the server log)", "internal_error")


def _renamed(exc: BaseException, req: OpenAIRequest) -> BaseException:
    """An error naming an internal field, as the parameter the client sent."""
    field = _param(exc)
    if field is None or isinstance(exc, ApiError):
        return exc
    name = field.split("[")[0]
    param = req.aliases.get(name, name)
    if req.chat and name in ("prompt", "prompt_token_ids"):
        param = "messages"
    error = _api_error(exc)
    if name in req.aliases:  # the client's own word throughout: max_completion_tokens=0 ...
        message = re.sub(rf"\b{re.escape(name)}\b", param, str(exc))
    else:
        message = str(exc) if param == name else f"{param} ({exc})"
    return ApiError(error.status, message, error.kind, param, error.code or "")


def _param(exc: BaseException) -> str | None:
    """The parameter an error names (its field, with any index: stop[1] -> stop)."""
    field = getattr(exc, "field", None)
    if field is None and isinstance(exc, StopStringError):
        field = "stop"
    if field is None and isinstance(exc, ChatTemplateError):
        field = "messages"
    return field


def _grpc_name(status: int) -> str:
    """The metrics' code label of an HTTP error, as gRPC names it: a client's mistake is never
    INTERNAL (an alert on INTERNAL is an alert on the server)."""
    names = {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 404: "NOT_FOUND"}
    names |= {413: "RESOURCE_EXHAUSTED", 429: "RESOURCE_EXHAUSTED", 503: "UNAVAILABLE"}
    names |= {499: "CANCELLED", 504: "DEADLINE_EXCEEDED"}
    return names.get(status, "INVALID_ARGUMENT" if 400 <= status < 500 else "INTERNAL")


def _error_response(error: ApiError) -> JSONResponse:
    body = error_body(str(error), error.kind, error.param, error.code)
    return JSONResponse(body, status_code=error.status)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return _error_response(ApiError(exc.status_code, f"{request.url.path}: {exc.detail}", kind))


def _is_id(token: Any, vocab: int) -> bool:
    return isinstance(token, int) and not isinstance(token, bool) and 0 <= token < vocab
