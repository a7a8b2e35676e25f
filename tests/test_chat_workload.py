"""The multi-turn chat workload (bench/make_chat_workload.py) and its replay by the load
client (--chat): the file, the turns each conversation sends, and a served run on the CPU
whose prefix hits by tier come back in the JSON."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from hybridgen.benchmarks.chat_replay import replay_on
from hybridgen.benchmarks.chat_workload import WorkloadError, dump, load, make
from hybridgen.models.spec import parse_config

ROOT = Path(__file__).resolve().parents[1]


def test_contexts_grow_to_the_drawn_lengths(tmp_path: Path) -> None:
    work = make(48, 6, 2048, 128, (8192, 24576), think_s=1.0, seed=3)
    contexts = [c.context(2048) for c in work.conversations]
    assert len(contexts) == 48 and min(contexts) >= 8192 and max(contexts) <= 24576
    assert max(contexts) - min(contexts) > 8192  # spread over the range, not one length
    for c in work.conversations:
        assert len(c.user_tokens) == 6 and c.answer_tokens == (128,) * 6
        even = sum(c.user_tokens) / 6
        assert all(0.75 / 1.25 * even <= u <= 1.25 / 0.75 * even for u in c.user_tokens[:-1])
    assert work.turns == 288 and work.max_context == max(contexts)
    path = tmp_path / "chat.json"
    dump(work, path)
    assert load(path) == work
    assert make(48, 6, 2048, 128, (8192, 24576), 1.0, seed=3) == work  # the seed decides


def test_token_ids_share_the_system_prompt_within_a_run_only() -> None:
    work = make(3, 2, 16, 4, (64, 96), seed=1)
    system, users = work.token_ids(vocab=1000, run=0)
    again, _ = work.token_ids(vocab=1000, run=0)
    other, other_users = work.token_ids(vocab=1000, run=1)
    assert system == again != other and len(system) == 16
    assert [len(u) for u in users[0]] == list(work.conversations[0].user_tokens)
    assert users != other_users
    assert all(125 <= t < 1000 for turn in users for ids in turn for t in ids)


def test_bad_files_name_the_field(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"kind": "something else"}))
    with pytest.raises(WorkloadError, match="kind is not 'hybridgen-chat-workload'"):
        load(path)
    data = make(2, 2, 8, 4, (40, 50)).to_json()
    data["conversations"][1]["answer_tokens"] = [4]  # type: ignore[index]
    path.write_text(json.dumps(data))
    with pytest.raises(WorkloadError, match=r"conversations\[1\] needs as many answers as turns"):
        load(path)
    with pytest.raises(WorkloadError, match="context low 20 is below the system prompt"):
        make(2, 2, 16, 4, (20, 30))


class FakeStub:
    """A GenerationService that answers `max_tokens` ids (its call count, repeated) after a
    short delay, recording each prompt and how many calls were in flight."""

    def __init__(self) -> None:
        self.prompts: list[list[int]] = []
        self.in_flight, self.most = 0, 0

    def Generate(self, request: Any, timeout: float) -> Any:
        self.prompts.append(list(request.prompt_token_ids))
        answer = [len(self.prompts)] * request.max_tokens

        async def stream() -> Any:
            self.in_flight += 1
            self.most = max(self.most, self.in_flight)
            await asyncio.sleep(0.01)
            for token in answer:
                yield SimpleNamespace(token_ids=[token])
            self.in_flight -= 1

        return stream()


def test_each_turn_sends_the_history_with_the_answers_given() -> None:
    """Turn t's prompt is the system prompt, the earlier turns' user tokens and the answers
    the server gave, then its own user tokens; at most `concurrency` conversations run, and a
    next turn waits for its answer plus the think time."""
    work = make(4, 3, 8, 2, (30, 40), think_s=0.02, seed=5)
    stub = FakeStub()
    start = time.monotonic()
    streams = asyncio.run(replay_on(stub, work, 1000, 0, concurrency=2, timeout=10))
    assert len(streams) == len(stub.prompts) == 12 and stub.most == 2
    system, users = work.token_ids(1000, 0)
    by_conv: dict[int, list[tuple[int, list[int]]]] = {}
    for call, prompt in enumerate(stub.prompts, 1):  # each starts with its first user turn
        head = prompt[len(system) :]
        conv = next(i for i, u in enumerate(users) if head[: len(u[0])] == u[0])
        by_conv.setdefault(conv, []).append((call, prompt))
    for conv, turns in by_conv.items():
        history = list(system)
        for t, (call, prompt) in enumerate(turns):
            assert prompt == history + users[conv][t]
            history = prompt + [call] * 2  # the answer it got
    assert all(s.error is None and sum(s.counts) == 2 for s in streams)
    assert time.monotonic() - start >= 2 * 0.01 * 3  # two rounds of three turns at least


@pytest.mark.slow
def test_served_chat_run_reports_prefix_hits_by_tier(checkpoint, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Three conversations of three turns at once through `hybridgen serve` on the CPU, Hot
    (112 tokens) holding one conversation (of 100-112 tokens) but not two, so a turn run
    between two of another conversation evicts the tail of its history: every turn streams,
    and the JSON carries the load client's figures and what the prefix cache saved, by tier,
    part of it from Warm (turns whose history Hot no longer held)."""
    path = checkpoint("llama3")
    spec = parse_config(path / "config.json")
    hot_mb = 112 * spec.kv_bytes_per_token(torch.float32) / 2**20
    config = tmp_path / "hybridgen_config.yaml"
    config.write_text(
        "model:\n  max_model_len: 128\n  max_num_seqs: 4\n  max_num_batched_tokens: 32\n"
        "  dtype: float32\n"
        f"kv_cache:\n  hot_region_mb: {hot_mb}\n  warm_region_mb: 4\n  block_size: 8\n"
        "  warm_codec: lossless\n"
    )
    work = tmp_path / "chat.json"
    shape = "--conversations 3 --turns 3 --system-tokens 16 --answer-tokens 8 --think-s 0.05"
    make_cmd = [sys.executable, str(ROOT / "bench/make_chat_workload.py"), *shape.split()]
    make_cmd += ["--context", "100", "112", "--out", str(work)]
    assert subprocess.run(make_cmd, capture_output=True, timeout=120).returncode == 0
    out = tmp_path / "chat_run.json"
    flags = "--device cpu --concurrency 3 --runs 1 --warmup 1 --name chat"
    cmd = [sys.executable, "-m", "hybridgen.benchmarks.load", *flags.split(), "--chat", str(work)]
    cmd += ["--config", str(config), "--model", str(path), "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert any(line.startswith("prefix cache: ") for line in done.stdout.splitlines())
    result = json.loads(out.read_text())
    run = result["runs"][0]
    assert run["requests"] == 9 and run["failed"] == 0 and run["tokens"] == 9 * 8
    assert result["median"]["ttft_ms_p50"] > 0 and result["median"]["steady_tok_s"] is None
    counts = run["counters"]
    saved = sum(counts[f"prefix_{t}_tokens"] for t in ("hot", "warm", "cold"))
    assert saved == counts["prefix_cached_tokens"] > 0
    seen = json.dumps(counts)  # the keep gate measures: say what it saw
    assert counts["warm_kept_blocks"] > 0 and counts["prefix_warm_tokens"] > 0, seen
    assert result["workload"]["kind"] == "chat" and result["workload"]["turns"] == 9
    assert result["server_info"]["spill_policy"] == "auto"
    spent = run["server_time"]  # the engine's time by phase, Warm loads under schedule
    assert spent["schedule"] > 0 and spent["prefill"] > 0 and spent["wall"] > 0
    passes = run["server_passes"]  # each turn's first token from its prompt's pass
    decode_rows = sum(p["passes"] * p["rows_per_pass"] for p in passes.values())
    assert decode_rows == pytest.approx(9 * 8 - 9) and passes["prefill"]["passes"] > 0
    assert result["server"]["serve_exit_code"] == 0
