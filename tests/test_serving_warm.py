"""`hybridgen serve` with a Warm tier: the GPU daemon spills KV to the Warm pool and the CPU
daemon computes attention over it (attn_warm cpu, over the w2c/c2w rings), sequences that
each fit Hot take turns there, and the streamed tokens are still HF's greedy ones."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from hybridgen.models.spec import parse_config
from hybridgen.v1 import generation_pb2 as pb
from tests.hf_reference import hf_greedy, sample_prompts
from tests.test_serving import Server, wait_serving

NEW_TOKENS = 16


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:  # type: ignore[no-untyped-def]
    path = checkpoint("llama3")
    spec = parse_config(path / "config.json")
    hot_mb = 64 * spec.kv_bytes_per_token(torch.float32) / 2**20  # 64 tokens of Hot
    config = (
        "model:\n  max_model_len: 192\n  max_num_seqs: 2\n  max_num_batched_tokens: 32\n"
        "  dtype: float32\n"
        f"kv_cache:\n  hot_region_mb: {hot_mb}\n  warm_region_mb: 2\n  warm_codec: lossless\n"
        "  block_size: 16\n  hot_turn_tokens: 4\n  warm_draft_tokens: 3\n  spill_policy: always\n"
        "placements:\n  attn_warm: cpu\n"
    )
    srv = Server(path, tmp_path_factory.mktemp("serve_warm"), engine_config=config)
    wait_serving(srv.port, proc=srv.proc)
    yield srv
    assert srv.stop() == 0
    assert srv.segments() == [], "a clean stop leaves nothing in /dev/shm"


@pytest.mark.slow
def test_served_long_prompt_through_warm_matches_hf(server: Server, checkpoint) -> None:  # type: ignore[no-untyped-def]
    path = checkpoint("llama3")
    prompt = sample_prompts(path, 1, [150])[0]
    expected = hf_greedy(path, [prompt], NEW_TOKENS)[0]
    assert server.greedy(prompt, NEW_TOKENS) == expected
    info = server.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
    assert info.warm_blocks_total > 0 and info.hot_hit_rate < 0.6
    assert info.cpu_attention_ms > 0 and info.warm_decompress_p50_ms > 0
    assert info.warm_drafted_tokens > 0  # checked by the CPU daemon, 4 rows at a time
    logs = Path(server.log.name).parent / "run" / server.instance
    assert "attn_warm_worker_serving" in (logs / "cpu.log").read_text()  # the CPU daemon answered
    assert "attn_warm_link_down" not in (logs / "gpu.log").read_text()  # ... every request
    # The next turn starts from the first one's KV, held in Warm: GetModelInfo counts it.
    second = prompt + expected + sample_prompts(path, 2, [150, 8])[1]
    assert server.greedy(second, NEW_TOKENS) == hf_greedy(path, [second], NEW_TOKENS)[0]
    info = server.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
    assert info.prefix_warm_hits >= 1 and info.prefix_warm_tokens >= 128
    saved = info.prefix_hot_tokens + info.prefix_warm_tokens + info.prefix_cold_tokens
    assert saved == info.prefix_cached_tokens


@pytest.mark.slow
def test_served_sequences_that_fit_hot_one_at_a_time_take_turns(server: Server, checkpoint) -> None:  # type: ignore[no-untyped-def]
    """Hot holds 64 tokens: two 20-token prompts with 40 new tokens each fit it one at a
    time. With kv_cache.hot_turn_tokens: 4 both stream at once, taking turns in Hot (first
    come, first served, the second would start only when the first ended), with HF's tokens.
    40 new tokens (not 16) keep the first running long enough for the second's call to reach
    a loaded machine's server (16 took ~90 ms here, and one CI run's second call came later)."""
    path = checkpoint("llama3")
    prompts = sample_prompts(path, 2, [20, 21])
    new_tokens = 40
    expected = hf_greedy(path, prompts, new_tokens)
    times: list[list[float]] = [[], []]
    got: list[list[int]] = [[], []]

    def stream(i: int) -> None:
        request = pb.GenerateRequest(
            prompt_token_ids=prompts[i],
            max_tokens=new_tokens,
            ignore_eos=True,
            sampling=pb.SamplingParams(temperature=0.0),
        )
        for reply in server.stub.Generate(request, timeout=120):
            got[i] += reply.token_ids
            times[i] += [time.monotonic()] * len(reply.token_ids)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=150)
    assert got == expected
    (a0, a1), (b0, b1) = (times[0][0], times[0][-1]), (times[1][0], times[1][-1])
    assert a0 < b1 and b0 < a1  # each streamed while the other did
    info = server.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
    assert info.spill_policy == "always" and info.spill_decisions_turns >= 1
    assert info.spill_last_choice == "turns (policy)"
    deadline = time.monotonic() + 30  # `serve --explain` prints once serving
    while "prefix cache: " not in server.log_path.read_text() and time.monotonic() < deadline:
        time.sleep(0.2)
    explained = server.log_path.read_text()
    assert "spill policy: always; decisions so far: wait 0" in explained
    assert "prefix cache: " in explained
