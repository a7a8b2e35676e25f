"""The OpenAI-compatible HTTP API of `hybridgen serve`, driven with the real `openai` client:
completions and chat, streamed and not, n = 2, logprobs; each against gRPC Generate with the
same request on the same server (greedy text, seeded samples, logprobs), bad parameters
(400 naming them), and a client that leaves mid-stream (its KV is freed)."""

from __future__ import annotations

import json
import re
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest

from hybridgen.models.tokenizer import Tokenizer
from hybridgen.v1 import generation_pb2 as pb
from tests.served import DefaultServer

pytestmark = pytest.mark.slow  # a served stack driven by the openai client: ~40 s in all

PROMPT = "The capital of the small country is a city where the people"
MESSAGES = [
    {"role": "system", "content": "You answer in one sentence."},
    {"role": "user", "content": "Where do the people of the small country live?"},
]


@pytest.fixture(scope="module")
def model(checkpoint: Any) -> Path:
    return Path(checkpoint("llama3"))


@pytest.fixture(scope="module")
def server(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DefaultServer]:
    srv = DefaultServer(tmp_path_factory.mktemp("openai"), model=model)
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def client(server: DefaultServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key="none")


def generate(server: DefaultServer, **fields: Any) -> tuple[str, list[pb.TokenLogprob], str]:
    """gRPC Generate: (text, logprobs, finish reason name)."""
    sampling = fields.pop("sampling", {"temperature": 0.0})
    request = pb.GenerateRequest(sampling=pb.SamplingParams(**sampling), **fields)
    text, logprobs, finish = "", [], ""
    for reply in server.stub.Generate(request, timeout=120):
        text += reply.text
        logprobs += reply.logprobs.tokens
        finish = pb.FinishReason.Name(reply.finish_reason)
    return text, logprobs, finish


def chat_prompt(model: Path) -> str:
    return Tokenizer.from_dir(model).apply_chat_template(MESSAGES)


def test_models_lists_the_served_model(client: openai.OpenAI, model: Path) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [str(model)]
    assert client.models.retrieve(str(model)).id == str(model)  # GET /v1/models/{model}
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("no-such-model")


def test_the_gateway_loads_the_model_before_ready(server: DefaultServer) -> None:
    """The HTTP API's model facts (torch and the tokenizer in the gateway) load before the
    gateway reports READY, not in the first HTTP call (~9 s on a 2-core machine)."""
    log = (server.run_dir / "gateway.log").read_text()
    assert log.index('"http_model_loaded"') < log.index('"gateway_serving"')


def test_completion_greedy_text_equals_generate(
    server: DefaultServer, client: openai.OpenAI, model: Path
) -> None:
    expected, _, _ = generate(server, prompt=PROMPT, max_tokens=24, ignore_eos=True)
    out = client.completions.create(  # the folder's name names the model too
        model=model.name,
        prompt=PROMPT,
        max_tokens=24,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert out.choices[0].text == expected and expected
    assert out.choices[0].finish_reason == "length"
    assert out.usage is not None and out.usage.completion_tokens == 24
    assert out.usage.prompt_tokens == len(server.tokenize(PROMPT))


def test_completion_stream_with_usage(server: DefaultServer, client: openai.OpenAI) -> None:
    expected, _, _ = generate(server, prompt=PROMPT, max_tokens=24, ignore_eos=True)
    stream = client.completions.create(
        model=server_model(client),
        prompt=PROMPT,
        max_tokens=24,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 24
    assert all(c.usage is None for c in chunks[:-1])
    assert {c.object for c in chunks} == {"text_completion"}  # the usage chunk's too


def server_model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


@pytest.mark.parametrize("stream", [False, True])
def test_chat_greedy_text_equals_generate_of_the_template(
    server: DefaultServer, client: openai.OpenAI, model: Path, stream: bool
) -> None:
    prompt = chat_prompt(model)
    expected, _, _ = generate(
        server, prompt=prompt, add_special_tokens=False, max_tokens=20, ignore_eos=True
    )
    kwargs: dict[str, Any] = {"model": str(model), "messages": MESSAGES, "temperature": 0}
    kwargs |= {"max_completion_tokens": 20, "extra_body": {"ignore_eos": True}}
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kwargs))
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        assert chunks[-1].choices[0].finish_reason == "length"
    else:
        out = client.chat.completions.create(**kwargs)
        text = out.choices[0].message.content or ""
        assert out.choices[0].message.role == "assistant"
        assert out.usage is not None
        assert out.usage.prompt_tokens == len(server.tokenize(prompt, add_special_tokens=False))
    assert text == expected and expected


def test_chat_without_max_tokens_runs_to_the_context_end(
    server: DefaultServer, client: openai.OpenAI, model: Path
) -> None:
    out = client.chat.completions.create(
        model=str(model), messages=MESSAGES, temperature=0, extra_body={"ignore_eos": True}
    )
    assert out.usage is not None
    assert out.usage.prompt_tokens + out.usage.completion_tokens == server.info().max_model_len


def test_n_2_greedy_shares_the_prompt(server: DefaultServer, client: openai.OpenAI) -> None:
    """Both samples are Generate's text, and the second computed no full block of the
    prompt again: it started from the first one's cached blocks."""
    prompt = "A prompt no other test sends, long enough for several blocks. " * 3
    before = server.info().prefix_cached_tokens
    out = client.completions.create(
        model=server_model(client),
        prompt=prompt,
        n=2,
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    full_blocks = (len(server.tokenize(prompt)) - 1) // 16 * 16
    assert server.info().prefix_cached_tokens - before == full_blocks > 0
    expected, _, _ = generate(server, prompt=prompt, max_tokens=8, ignore_eos=True)
    assert [c.text for c in out.choices] == [expected, expected]
    assert [c.index for c in out.choices] == [0, 1]
    assert out.usage is not None and out.usage.completion_tokens == 16


def test_n_2_seeded_samples_are_generates_with_seed_and_seed_plus_1(
    server: DefaultServer, client: openai.OpenAI
) -> None:
    expected = [
        generate(
            server,
            prompt=PROMPT,
            max_tokens=16,
            ignore_eos=True,
            sampling={"temperature": 1.0, "seed": seed},
        )[0]
        for seed in (7, 8)
    ]
    stream = client.completions.create(
        model=server_model(client),
        prompt=PROMPT,
        n=2,
        max_tokens=16,
        temperature=1.0,
        seed=7,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    texts = ["", ""]
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == expected and texts[0] != texts[1]


def test_completion_logprobs_equal_generates(
    server: DefaultServer, client: openai.OpenAI, model: Path
) -> None:
    _, expected, _ = generate(
        server,
        prompt=PROMPT,
        max_tokens=6,
        ignore_eos=True,
        sampling={"temperature": 0.0, "logprobs": 3},
    )
    out = client.completions.create(
        model=server_model(client),
        prompt=PROMPT,
        max_tokens=6,
        temperature=0,
        logprobs=3,
        extra_body={"ignore_eos": True},
    )
    lp = out.choices[0].logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    assert lp.token_logprobs == pytest.approx([t.logprob for t in expected], abs=1e-6)
    # Keyed by token text, as OpenAI's format is: tokens that decode alike collapse.
    decode = Tokenizer.from_dir(model).decode
    tops = [{decode([x.token_id]): x.logprob for x in reversed(t.top)} for t in expected]
    assert [set(top) for top in lp.top_logprobs] == [set(top) for top in tops]
    assert all(len(t.top) == 3 for t in expected)
    best = [max(top.values()) for top in lp.top_logprobs]
    assert best == pytest.approx(lp.token_logprobs, abs=1e-6)  # greedy: the top one


def test_chat_logprobs_stream(server: DefaultServer, client: openai.OpenAI, model: Path) -> None:
    prompt = chat_prompt(model)
    _, expected, _ = generate(
        server,
        prompt=prompt,
        add_special_tokens=False,
        max_tokens=5,
        ignore_eos=True,
        sampling={"temperature": 0.0, "logprobs": 2},
    )
    stream = client.chat.completions.create(
        model=str(model),
        messages=MESSAGES,
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    entries = [
        e
        for c in stream
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content or []
    ]
    assert [e.logprob for e in entries] == pytest.approx([t.logprob for t in expected], abs=1e-6)
    assert all(len(e.top_logprobs) == 2 for e in entries)


@pytest.mark.parametrize(
    ("chat", "extra", "param"),
    [
        (False, {"temperature": -1}, "temperature"),
        (False, {"top_p": 1.5}, "top_p"),
        (False, {"max_tokens": 0}, "max_tokens"),
        (False, {"n": 0}, "n"),
        (False, {"logprobs": 99}, "logprobs"),
        (False, {"stop": [""]}, "stop"),
        (False, {"seed": -3}, "seed"),
        (False, {"prompt": "word " * 600}, "prompt"),
        (False, {"prompt": [[1, 10**7]]}, "prompt_token_ids"),
        (False, {"echo": True}, "echo"),
        (False, {"presence_penalty": "lots"}, "presence_penalty"),
        (True, {"max_completion_tokens": 0}, "max_completion_tokens"),
        (True, {"top_logprobs": 3}, "top_logprobs"),
        (True, {"logprobs": True, "top_logprobs": 50}, "top_logprobs"),
        (True, {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        (True, {"response_format": {"type": "json_object"}}, "response_format"),
        (True, {"messages": [{"role": "user", "content": "hi " * 600}]}, "messages"),
        (
            True,
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages[0].content[0]",
        ),
        (True, {"messages": [{"role": "user"}]}, "messages[0].content"),
        (True, {"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ],
)
def test_bad_parameters_get_400_naming_them(
    client: openai.OpenAI, chat: bool, extra: dict[str, Any], param: str
) -> None:
    body: dict[str, Any] = {"model": server_model(client), "max_tokens": 4}
    body |= {"messages": MESSAGES} if chat else {"prompt": PROMPT}
    body |= extra
    path = "/chat/completions" if chat else "/completions"
    with pytest.raises(openai.BadRequestError) as err:
        client.post(path, body=body, cast_to=object)
    error = err.value.body
    assert isinstance(error, dict) and error["param"] == param, error
    assert error["type"] == "invalid_request_error" and error["message"]
    if param == "max_completion_tokens":  # the client's word, never the internal max_tokens
        assert "max_tokens" not in error["message"].replace(param, ""), error["message"]


def test_unknown_parameters_are_ignored(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model=server_model(client),
        prompt=PROMPT,
        max_tokens=2,
        user="me",
        extra_body={"frobnicate": 3, "tool_choice": "none"},
    )
    assert out.usage is not None and out.usage.completion_tokens >= 1


def test_an_unknown_model_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="gpt-9", prompt=PROMPT, max_tokens=2)
    assert isinstance(err.value.body, dict) and err.value.body["code"] == "model_not_found"


def http(server: DefaultServer, path: str, body: Any = None) -> tuple[int, Any, str]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{server.http_port}{path}", data=data)
    request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            raw = reply.read().decode()
            status = reply.status
    except urllib.error.HTTPError as exc:
        raw, status = exc.read().decode(), exc.code
    try:
        return status, json.loads(raw), raw
    except json.JSONDecodeError:
        return status, None, raw


def test_tokenize_detokenize_health_metrics(server: DefaultServer) -> None:
    status, body, _ = http(server, "/tokenize", {"prompt": PROMPT})
    assert status == 200 and body["tokens"] == server.tokenize(PROMPT)
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 512
    status, body, _ = http(server, "/detokenize", {"tokens": server.tokenize(PROMPT, False)})
    assert status == 200 and body["prompt"] == PROMPT
    status, body, _ = http(server, "/detokenize", {"tokens": [10**8]})
    assert status == 400 and body["error"]["param"] == "tokens"
    assert http(server, "/health")[0] == 200
    status, _, text = http(server, "/metrics")
    assert status == 200 and "hybridgen_time_to_first_token_seconds_bucket" in text
    status, body, _ = http(server, "/v1/nowhere")
    assert status == 404 and body["error"]["message"]
    status, body, _ = http(server, "/v1/completions", "not an object")
    assert status == 400 and body["error"]["param"] == "body"


def cancelled(server: DefaultServer) -> float:
    text = http(server, "/metrics")[2]
    match = re.search(r'hybridgen_requests_total\{finish_reason="cancelled"\} (\S+)', text)
    return float(match.group(1)) if match else 0.0


def wait_idle(server: DefaultServer) -> None:
    deadline = time.monotonic() + 10
    while (info := server.info()).kv_blocks_used or info.running_requests:
        assert time.monotonic() < deadline, "the request still holds its KV"
        time.sleep(0.05)


def test_a_disconnect_mid_stream_frees_the_kv(server: DefaultServer, client: openai.OpenAI) -> None:
    before = cancelled(server)
    stream = client.completions.create(
        model=server_model(client),
        prompt=PROMPT,
        max_tokens=400,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    for i, _ in enumerate(stream):
        if i == 3:
            break
    assert server.info().kv_blocks_used > 0  # still generating: 400 tokens take a while
    stream.close()
    wait_idle(server)
    assert cancelled(server) == before + 1


def test_a_disconnect_while_waiting_for_a_whole_answer_frees_the_kv(
    server: DefaultServer, client: openai.OpenAI
) -> None:
    before = cancelled(server)
    # The client gives up long before the answer can be whole: 476 tokens fill the context
    # (512 with the prompt's 36); 400 tokens with a 1 s timeout sometimes finished first.
    with pytest.raises(openai.APITimeoutError):
        client.with_options(timeout=0.25, max_retries=0).completions.create(
            model=server_model(client),
            prompt=PROMPT,
            max_tokens=476,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
    wait_idle(server)
    assert cancelled(server) == before + 1


def test_grpc_still_answers(server: DefaultServer) -> None:
    with pytest.raises(grpc.RpcError):
        generate(server, prompt="", max_tokens=2)
    assert generate(server, prompt=PROMPT, max_tokens=2)[2] == "FINISH_REASON_LENGTH"
