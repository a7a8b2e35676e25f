"""The CPU daemon's side of a request: the gateway's `Backend`, served over the rings.

    generate()  -> NEW_SEQ (prompt ids + sampling params, through the c2g arena)
    heartbeat   -> STEP_RESULT tickets -> the request's asyncio.Queue (call_soon_threadsafe)
    generate()  -> incremental detokenization and stop strings (TextStream) -> Delta
    a stop string, a cancel or a closed stream -> ABORT: the GPU daemon frees the KV at once

The GPU daemon owns the model; this side holds only the tokenizer and the model facts the
GPU daemon reports (STATS) once it is up.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import secrets
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any

import structlog

from hybridgen.cpu_daemon.heartbeat import CpuHeartbeat
from hybridgen.engine.request_output import RequestOutput
from hybridgen.engine.step_errors import ErrorCode, StepFailed
from hybridgen.engine.validation import InvalidRequest, check_text_size, validate_request
from hybridgen.ipc.channels import Channels
from hybridgen.ipc.messages import (
    PROMPT_OPEN,
    encode_append,
    encode_new_seq,
    encode_prompt_chunk,
)
from hybridgen.ipc.ticket import Op
from hybridgen.models.chat import ChatMessage, chat_prompt_ids
from hybridgen.models.tokenizer import Tokenizer
from hybridgen.runtime.percentile import p99
from hybridgen.sampling.candidates import sample_candidates
from hybridgen.sampling.params import SamplingParams
from hybridgen.serving.backend import BackendUnavailable
from hybridgen.serving.delta import Delta, to_delta
from hybridgen.serving.stream_input import PromptFeed, PromptPart, start_feeding
from hybridgen.serving.text import TextStream

if TYPE_CHECKING:
    from hybridgen.serving.service import GenerateInput

log = structlog.get_logger()


class RingBackend:
    """Backend whose engine is the GPU daemon on the other end of the rings."""

    def __init__(self, channels: Channels, tokenizer: Tokenizer) -> None:
        self._ch, self._tokenizer = channels, tokenizer
        self._loop: asyncio.AbstractEventLoop | None = None
        self._heartbeat: CpuHeartbeat | None = None
        self._info: dict[str, Any] = {}
        self._info_ready = asyncio.Event()
        self._info_fresh = asyncio.Event()
        self._queues: dict[int, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._ids = itertools.count(1)
        self._dead: str | None = None
        self._backpressure = 0  # the GPU daemon's reasons for not admitting (0: none)
        self._waiting = 0

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._heartbeat = CpuHeartbeat(
            self._ch,
            self._post_result,
            self._post_info,
            self._post_dead,
            self._post_backpressure,
            self._post_lost,
        )
        self._heartbeat.start()
        self._heartbeat.send(Op.STATS, 0)
        await self._info_ready.wait()

    async def stop(self) -> None:
        if self._heartbeat is not None:
            await asyncio.to_thread(self._heartbeat.stop)

    def ready(self) -> bool:
        return self._info_ready.is_set() and self._dead is None

    @property
    def dead(self) -> str | None:
        """Why the GPU daemon is considered dead, or None while it is alive."""
        return self._dead

    async def model_info(self) -> dict[str, Any]:
        """Fresh pool figures from the GPU daemon (within 1 s, else the last known)."""
        self._check_alive()
        assert self._heartbeat is not None
        self._info_fresh.clear()
        self._heartbeat.send(Op.STATS, 0)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._info_fresh.wait(), timeout=1.0)
        return {
            **self._info,
            "queued_requests": self._waiting,
            "ring_occupancy_g2c": self._ch.g2c.occupancy() / self._ch.g2c.capacity,
            "cpu_heartbeat_jitter_p99_ms": p99(self._heartbeat.stats.jitter_ms),
            "gpu_backpressure": self._backpressure,
        }

    async def tokenize(self, text: str, add_special_tokens: bool) -> list[int]:
        self._check_alive()
        max_len = self._info["max_model_len"]
        check_text_size("text", text, self._tokenizer.max_text_bytes(max_len), max_len)
        # On a worker thread, with the GIL released (Tokenizer.encode): the event loop keeps
        # streaming and the heartbeat keeps beating while a long prompt is tokenized.
        return await asyncio.to_thread(self._tokenizer.encode, text, add_special_tokens)

    async def tokenize_chat(
        self, messages: Sequence[ChatMessage], add_generation_prompt: bool
    ) -> list[int]:
        self._check_alive()
        max_len = self._info["max_model_len"]
        text = "".join(m.content for m in messages)
        check_text_size("messages", text, self._tokenizer.max_text_bytes(max_len), max_len)
        return await asyncio.to_thread(
            chat_prompt_ids, self._tokenizer, messages, add_generation_prompt
        )

    async def validate(
        self, prompt_ids: Sequence[int], params: SamplingParams, partial: bool = False
    ) -> None:
        self._check_alive()
        info = self._info
        validate_request(prompt_ids, params, info["vocab_size"], info["max_model_len"], partial)

    async def generate(
        self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams, stop: list[str]
    ) -> AsyncIterator[Delta]:
        self._check_alive()
        prompt = list(prompt_ids)
        async with contextlib.aclosing(self._run(prompt, params, stop, None)) as deltas:
            async for delta in deltas:
                yield delta

    async def stream_generate(
        self, req: GenerateInput, start: PromptPart, parts: AsyncIterator[PromptPart]
    ) -> AsyncIterator[Delta]:
        self._check_alive()
        info, params = self._info, req.params
        feed = PromptFeed(
            self._tokenizer,
            req.add_special_tokens,
            info["vocab_size"],
            info["max_model_len"],
            params.max_tokens,
        )
        feed.push(start)
        prompt = list(feed.token_ids)
        stream = self._run(prompt, params, list(req.stop), (feed, parts))
        async with contextlib.aclosing(stream) as deltas:
            async for delta in deltas:
                yield delta

    async def _run(
        self,
        prompt: list[int],
        params: SamplingParams,
        stop: list[str],
        streamed: tuple[PromptFeed, AsyncIterator[PromptPart]] | None,
    ) -> AsyncGenerator[Delta, None]:
        """NEW_SEQ, then step results to Deltas until the request ends. `streamed`: the prompt
        is open, and its parts go to the GPU daemon as APPEND_PROMPT meanwhile."""
        assert self._heartbeat is not None
        rid = next(self._ids)
        q: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._queues[rid] = q
        self._waiting += 1
        started = done = False
        if params.seed is None:  # drawn here, so that a CPU-side pick uses the same seed
            params = dataclasses.replace(params, seed=secrets.randbits(63))
        feeding = self._submit(rid, prompt, params, streamed, q)
        text: TextStream | None = None
        try:
            while not done:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item  # the GPU daemon died (nothing to abort then), or a bad part
                if item.error is not None:
                    done = True  # the GPU daemon refused or failed it, and dropped it
                    if item.error.code is not ErrorCode.INVALID_ARGUMENT:
                        raise item.error
                    field, _, message = str(item.error).partition(": ")
                    raise InvalidRequest(field, message)
                if item.candidates is not None:  # placements.sample: cpu, the pick is ours
                    self._pick(rid, params, item)
                    continue
                if not started:
                    started = True
                    self._waiting -= 1
                if text is None:  # a streamed prompt is complete by its first token
                    ids = streamed[0].token_ids if streamed else prompt
                    text = TextStream(self._tokenizer, ids, stop)
                done = item.finished
                delta = to_delta(item, text)
                yield delta
                if delta.finished:
                    break
        finally:
            if feeding is not None:
                feeding.cancel()
            if not started:
                self._waiting -= 1
            self._queues.pop(rid, None)
            if not done and self._dead is None:
                self._heartbeat.send(Op.ABORT, rid)

    def _submit(
        self,
        rid: int,
        prompt: list[int],
        params: SamplingParams,
        streamed: tuple[PromptFeed, AsyncIterator[PromptPart]] | None,
        q: asyncio.Queue[RequestOutput | BaseException],
    ) -> asyncio.Task[None] | None:
        """Send NEW_SEQ; for a streamed prompt, start the task that sends its parts."""
        heartbeat = self._heartbeat
        assert heartbeat is not None
        payload = encode_new_seq(prompt, params)
        flags = PROMPT_OPEN if streamed else 0
        heartbeat.send(Op.NEW_SEQ, rid, payload, (len(prompt), 0, 0, 0), flags)
        if streamed is None:
            return None

        def send(keep: int, ids: list[int], last: bool) -> None:
            chunk = encode_prompt_chunk(ids)
            heartbeat.send(Op.APPEND_PROMPT, rid, chunk, (len(ids), keep, 0, 0), last)

        return start_feeding(streamed[1], streamed[0], send, q.put_nowait)

    def _pick(self, rid: int, params: SamplingParams, item: RequestOutput) -> None:
        """Pick the token from a step's candidates and send it back (APPEND_TOKENS)."""
        assert params.seed is not None and item.candidates is not None
        assert self._heartbeat is not None
        token, logprob = sample_candidates(item.candidates, params, params.seed, item.output_tokens)
        self._heartbeat.send(Op.APPEND_TOKENS, rid, encode_append(token, logprob))

    async def abort(self, request_id: str) -> None:
        """Requests are aborted by closing their stream (generate's finally)."""

    def queue_depth(self) -> int:
        return self._waiting

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise BackendUnavailable(f"the GPU daemon is unavailable: {self._dead}")
        if not self._info_ready.is_set():
            raise BackendUnavailable("the model is loading")

    # -- called on the heartbeat thread -------------------------------------------------

    def _call(self, fn: Any, *args: Any) -> None:
        assert self._loop is not None
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody is listening
            self._loop.call_soon_threadsafe(fn, *args)

    def _post_result(self, result: RequestOutput) -> None:
        self._call(self._deliver, result)

    def _deliver(self, result: RequestOutput) -> None:
        q = self._queues.get(int(result.request_id))
        if q is not None:  # a result for a request that was already cancelled is dropped
            q.put_nowait(result)

    def _post_info(self, info: dict[str, Any]) -> None:
        def apply() -> None:
            self._info = info
            self._info_ready.set()
            self._info_fresh.set()

        self._call(apply)

    def _post_backpressure(self, reasons: int, waiting: int) -> None:
        # While the GPU daemon cannot take work, it degrades: hybrid-aware regions shift
        # toward this daemon (placement/degrade.py) until the pressure ends.
        assert self._heartbeat is not None
        self._heartbeat.send(Op.BACKPRESSURE, 0, flags=int(reasons != 0))

        def apply() -> None:
            # Requests keep waiting in the engine's queue; the gateway's admission limit
            # (server.max_queue over queued requests) answers RESOURCE_EXHAUSTED when it fills.
            log.warning("gpu_backpressure", reasons=reasons, waiting=waiting)
            self._backpressure = reasons

        self._call(apply)

    def _post_lost(self, request_id: int, reason: str) -> None:
        def apply() -> None:
            q = self._queues.get(request_id)
            if q is not None:
                message = f"request {request_id} failed: {reason}; retry it"
                q.put_nowait(StepFailed(ErrorCode.DATA_LOSS, message))

        self._call(apply)

    def _post_dead(self, reason: str) -> None:
        def apply() -> None:
            log.error("gpu_daemon_dead", reason=reason)
            self._dead = reason
            for q in self._queues.values():
                q.put_nowait(BackendUnavailable(f"the GPU daemon died: {reason}"))

        self._call(apply)
