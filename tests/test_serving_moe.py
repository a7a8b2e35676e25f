"""`hybridgen serve` with Cold-Weights: the experts live in the shared expert arena, the GPU
daemon fetches some into its device cache, the CPU daemon computes the others (EXPERT_RUN
over the x2c/c2x rings) while the device works, and the streamed tokens are HF's greedy
ones (tiny Mixtral, fp32)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from hybridgen.v1 import generation_pb2 as pb
from tests.hf_reference import hf_greedy, sample_prompts
from tests.test_serving import Server, wait_serving

NEW_TOKENS = 12


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:  # type: ignore[no-untyped-def]
    config = (
        "model:\n  max_model_len: 256\n  max_num_seqs: 2\n  dtype: float32\n"
        "cold_weights:\n  expert_cache_slots: 4\n  cpu_max_tokens: 1\n"
    )
    srv = Server(checkpoint("mixtral"), tmp_path_factory.mktemp("serve_moe"), engine_config=config)
    wait_serving(srv.port, proc=srv.proc)
    yield srv
    assert srv.stop() == 0
    assert srv.segments() == [], "a clean stop leaves nothing in /dev/shm"


@pytest.mark.slow
def test_served_moe_matches_hf_with_the_cpu_daemon_computing_experts(
    server: Server, checkpoint
) -> None:  # type: ignore[no-untyped-def]
    path = checkpoint("mixtral")
    prompts = sample_prompts(path, 2, [9, 40])
    expected = hf_greedy(path, prompts, NEW_TOKENS)
    assert [server.greedy(p, NEW_TOKENS) for p in prompts] == expected
    info = server.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
    # Decode steps route one token per expert: uncached ones went to the CPU daemon.
    assert info.cpu_daemon_experts > 0 and info.cpu_daemon_experts == info.cpu_experts
    assert info.gpu_experts > 0 and info.expert_bytes_h2d > 0
    assert 0 < info.expert_cache_hit_rate < 1
    row = next(r for r in info.op_regions if r.name == "moe_experts")
    assert row.measured["overlapped"] == 1.0  # the CPU daemon computes beside the device
