"""`placements.sample: cpu` through the three processes: the GPU daemon sends each row's
top-k logits, the CPU daemon picks the token and sends it back. The tokens are the same as
with the device sampler: greedy always, seeded draws while top_k <= the candidate count."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from hybridgen.config.engine import EngineConfig
from hybridgen.engine.engine import Engine
from hybridgen.sampling.params import SamplingParams
from hybridgen.v1 import generation_pb2 as pb
from tests.hf_reference import hf_greedy, sample_prompts
from tests.test_serving import Server, wait_serving


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:  # type: ignore[no-untyped-def]
    srv = Server(
        checkpoint("llama3"),
        tmp_path_factory.mktemp("serve-cpu-sampling"),
        extra_config="placements:\n  sample: cpu\n",
    )
    wait_serving(srv.port, proc=srv.proc)
    yield srv
    assert srv.stop() == 0
    assert srv.segments() == []


def generate(server: Server, prompt: list[int], **sampling: float) -> list[int]:
    request = pb.GenerateRequest(
        prompt_token_ids=prompt,
        max_tokens=20,
        ignore_eos=True,
        sampling=pb.SamplingParams(**sampling),
    )
    return [t for r in server.stub.Generate(request, timeout=60) for t in r.token_ids]


@pytest.mark.slow
def test_greedy_matches_transformers(server: Server, checkpoint) -> None:  # type: ignore[no-untyped-def]
    path = checkpoint("llama3")
    prompt = sample_prompts(path, 1, 31)[0]
    assert generate(server, prompt, temperature=0.0) == hf_greedy(path, [prompt], 20)[0]


@pytest.mark.slow
def test_seeded_draw_matches_the_device_sampler(server: Server, checkpoint) -> None:  # type: ignore[no-untyped-def]
    path = checkpoint("llama3")
    prompt = sample_prompts(path, 1, 12)[0]
    params = SamplingParams(temperature=0.9, top_k=16, seed=5, max_tokens=20, ignore_eos=True)
    device = Engine(EngineConfig(model=str(path), device="cpu", dtype="float32"))
    expected = device.generate([prompt], params)[0].token_ids
    assert generate(server, prompt, temperature=0.9, top_k=16, seed=5) == expected
