"""`hybridgen serve` (the three processes) on tiny Qwen2-MoE, Qwen3-MoE and DeepSeek-V2
checkpoints with Cold-Weights: the experts in the shared expert arena (native), a 4-slot
device cache in the GPU daemon, the CPU daemon computing uncached experts, and the streamed
tokens HF's greedy ones (fp32). Qwen2-MoE's shared expert and DeepSeek-V2's shared experts
stay with the router in the GPU daemon; DeepSeek-V2's MLA caches its latent in the Hot pool."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from hybridgen.v1 import generation_pb2 as pb
from tests.hf_reference import hf_greedy, sample_prompts
from tests.test_serving import Server, wait_serving

NEW_TOKENS = 12


@pytest.fixture(scope="module", params=["qwen2_moe", "qwen3_moe", "deepseek_v2"])
def served(  # type: ignore[no-untyped-def]
    request: pytest.FixtureRequest, checkpoint, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, Server]]:
    kind = request.param
    config = (
        "model:\n  max_model_len: 256\n  max_num_seqs: 2\n  dtype: float32\n"
        "cold_weights:\n  expert_cache_slots: 4\n  cpu_max_tokens: 1\n"
    )
    srv = Server(checkpoint(kind), tmp_path_factory.mktemp(f"serve_{kind}"), engine_config=config)
    wait_serving(srv.port, proc=srv.proc)
    yield kind, srv
    assert srv.stop() == 0
    assert srv.segments() == [], "a clean stop leaves nothing in /dev/shm"


@pytest.mark.slow
def test_served_qwen_moe_matches_hf(served: tuple[str, Server], checkpoint) -> None:  # type: ignore[no-untyped-def]
    kind, server = served
    path = checkpoint(kind)
    prompts = sample_prompts(path, 2, [9, 40])
    expected = hf_greedy(path, prompts, NEW_TOKENS)
    assert [server.greedy(p, NEW_TOKENS) for p in prompts] == expected
    info = server.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
    assert info.cpu_daemon_experts > 0 and info.cpu_daemon_experts == info.cpu_experts
    assert info.gpu_experts > 0 and info.expert_bytes_h2d > 0
    assert 0 < info.expert_cache_hit_rate < 1
