"""Host memory as a prefix cache across conversations: finished turns written back to Warm,
evicted Warm blocks kept in Cold, the next turn loaded from either beyond what Hot holds, the
counters by tier, and the gate that stops the copies when nothing comes back; tokens are HF's."""

from __future__ import annotations

import time

import pytest
import torch

from hybridgen.cli.explain import prefix_lines
from hybridgen.engine.engine import Engine
from hybridgen.kvtiers.prefix_cache import (
    COST_SAMPLES,
    EXPLORE_EVERY,
    MIN_SAMPLES,
    KeepGate,
    PrefixHits,
)
from hybridgen.kvtiers.warm_pool import HEADER_SIZE, slot_bytes_for
from hybridgen.kvtiers.warm_tier import warm_codec_for
from hybridgen.sampling.params import SamplingParams
from hybridgen.serving.service import model_info_to_pb
from tests.engine_helpers import small_engine
from tests.hf_reference import hf_greedy, sample_prompts

NEW = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)


def test_gate_keeps_while_kept_blocks_come_back() -> None:
    """Copies pay while the share of kept blocks taken back times what they save beats their
    cost; a run of blocks nobody takes back shuts the gate, except every EXPLORE_EVERY-th
    candidate, so that reuse starting again reopens it."""
    gate = KeepGate()
    assert gate.pays(None) and gate.pays(1e-3)  # nothing measured: keep
    for _ in range(MIN_SAMPLES):
        gate.kept_blocks(100, 100 * 1e-5)  # 10 us a block to keep
    gate.returned_blocks(MIN_SAMPLES * 100)
    assert gate.pays(1e-3)  # all came back, 1 ms to recompute
    gate.kept_blocks(20_000, 0.2)  # distinct prompts: nothing comes back
    assert gate.share < 0.01
    answers = [gate.pays(1e-3) for _ in range(2 * EXPLORE_EVERY)]
    assert answers.count(True) == 2 and gate.shut == 2 * EXPLORE_EVERY - 2
    gate.returned_blocks(20_000)  # a chat workload starts
    assert gate.pays(1e-3)
    assert not gate.pays(5e-6)  # cheaper to compute than to copy: never


def test_declined_blocks_a_request_misses_reopen_the_gate() -> None:
    """A gate shut while Hot held every history (nothing came back from Warm) learns what
    shutting costs: the blocks of a declined candidate that a later prefix runs on into
    count as returned, once, from the chain's first missing block on; they reopen it."""
    gate = KeepGate()
    for _ in range(MIN_SAMPLES):
        gate.kept_blocks(1_000, 1_000 * 1e-4)  # 100 us a block; none comes back
    assert not gate.pays(3e-3)  # a share of 1.6 %; they pay from 3.4 % at 3 ms a block
    turn = [bytes([i]) * 8 for i in range(200)]
    gate.declined(turn)
    share = gate.share
    assert gate.missed([b"elsewhere", *turn]) == 0  # the chain must run on into them
    assert gate.missed(turn[:150]) == 150 and gate.recomputed == 150
    assert gate.share > share and gate.pays(3e-3)  # 6.7 % of the candidates came back
    assert gate.missed(turn) == 0  # counted once: no longer declined
    assert gate.missed(turn[150:]) == 50 and gate.recomputed == 200


def test_one_slow_copy_does_not_shut_the_gate() -> None:
    """The gate's costs are medians of the latest timings: a first copy slowed 100 times (the
    first writes into fresh pool memory, a preempted process) neither shuts the gate nor,
    among copies of the usual cost, moves it; copies that stay slow do."""
    gate = KeepGate()
    gate.kept_blocks(4, 4 * 1e-2)  # 10 ms a block, once
    for _ in range(MIN_SAMPLES - 1):
        assert gate.keep_s is None and gate.pays(1e-3)
        gate.kept_blocks(4, 4 * 1e-4)  # 100 us a block, as copies take
    gate.returned_blocks(12)
    assert gate.keep_s == 1e-4 and gate.pays(1e-3)
    assert all(gate.pays(1e-3) for _ in range(2 * EXPLORE_EVERY)) and gate.shut == 0
    for _ in range(COST_SAMPLES):
        gate.kept_blocks(4, 4 * 1e-2)
    gate.returned_blocks(4 * COST_SAMPLES)
    assert gate.keep_s == 1e-2 and not gate.pays(1e-3)


def test_hits_by_tier() -> None:
    hits = PrefixHits()
    hits.add(hot=2, warm=3, cold=0, block_size=16)
    hits.add(hot=0, warm=0, cold=1, block_size=16)
    assert hits.info() == {
        "prefix_hot_hits": 1,
        "prefix_warm_hits": 1,
        "prefix_cold_hits": 1,
        "prefix_hot_tokens": 32,
        "prefix_warm_tokens": 48,
        "prefix_cold_tokens": 16,
    }


def generate(engine: Engine, prompt: list[int]) -> list[int]:
    return engine.generate([prompt], GREEDY)[0].token_ids


def chat(engine: Engine, path, system: list[int], users: list[list[int]]) -> list[int]:  # type: ignore[no-untyped-def]
    """Conversation A's first turn, B's (which takes most of Hot, evicting A's blocks there),
    then A's second turn; returns the second turn's tokens, checked against HF's."""
    first = system + users[0]
    answer = generate(engine, first)
    assert answer == hf_greedy(path, [first], NEW)[0]
    other = system + users[1]
    assert generate(engine, other) == hf_greedy(path, [other], NEW)[0]
    second = first + answer + users[2]
    got = generate(engine, second)
    assert got == hf_greedy(path, [second], NEW)[0]
    return got


def test_the_next_turn_loads_its_history_from_warm(checkpoint) -> None:  # type: ignore[no-untyped-def]
    """Hot holds 12 blocks of 8 tokens. A's first turn (a 16-token system prompt shared by
    both conversations and 24 user tokens, 16 answered) is written back to Warm when it ends;
    B's turn evicts it from Hot; A's second turn takes Hot's head of it and Warm's rest, so
    only its new tokens are computed. Without a Warm tier the same turn computes most of its
    history again."""
    path = checkpoint("llama3")
    system, *users = sample_prompts(path, 4, [16, 24, 60, 16])
    kept = (16 + 24 + NEW - 1) // 8  # A's full computed blocks after its first turn
    engine = small_engine(path, num_kv_blocks=12, max_model_len=96, warm_pool_mb=2)
    chat(engine, path, system, users)
    hits = engine.scheduler.prefix_hits
    assert engine.offload is not None and engine.offload.kept_blocks >= kept
    assert hits.warm_hits == 1 and hits.warm_tokens > 0
    assert hits.hot_hits == 2  # B took the system prompt from Hot, A's second turn its head
    assert hits.hot_tokens - 16 + hits.warm_tokens == kept * 8  # all of A's history reused
    check_model_info_and_metrics(engine)
    engine.release()

    hot_only = small_engine(path, num_kv_blocks=12, max_model_len=96)
    chat(hot_only, path, system, users)
    assert hot_only.scheduler.prefix_hit_tokens < hits.hot_tokens + hits.warm_tokens - 16
    hot_only.release()


def check_model_info_and_metrics(engine: Engine) -> None:
    """The prefix counters by tier survive GetModelInfo's protobuf and land in the Prometheus
    gauges (the spill decisions': test_spill_policy.py)."""
    from hybridgen.engine.info import engine_info
    from hybridgen.serving.metrics import Metrics

    stats = engine.tier_stats()
    pb = model_info_to_pb({**engine_info(engine), **stats, "max_queue": 1})
    assert pb.spill_policy == "auto"
    for tier in ("hot", "warm", "cold"):
        assert getattr(pb, f"prefix_{tier}_tokens") == stats[f"prefix_{tier}_tokens"]
        assert getattr(pb, f"prefix_{tier}_hits") == stats[f"prefix_{tier}_hits"]
    assert pb.warm_kept_blocks == stats["warm_kept_blocks"] > 0
    assert pb.spill_warm_block_us == pytest.approx(stats["spill_warm_block_us"])
    assert pb.spill_warm_block_us > 0
    line = prefix_lines(pb)[0]  # what `hybridgen serve --explain` prints
    assert line.startswith(f"prefix cache: {pb.prefix_cached_tokens} prompt tokens not computed")
    assert f"warm {pb.prefix_warm_hits} requests / {pb.prefix_warm_tokens} tokens" in line
    metrics = Metrics()
    metrics.set_kv_tiers(stats)
    value = metrics.registry.get_sample_value
    assert value("hybridgen_prefix_hit_tokens", {"tier": "warm"}) == stats["prefix_warm_tokens"]
    assert value("hybridgen_prefix_hits", {"tier": "hot"}) == stats["prefix_hot_hits"]
    assert value("hybridgen_warm_kept_blocks") == stats["warm_kept_blocks"]


def test_evicted_warm_blocks_come_back_from_cold(checkpoint) -> None:  # type: ignore[no-untyped-def]
    """The same chat with a Warm pool of 9 slots: B's written-back blocks evict A's from
    Warm, which keeps them in Cold (lz4); A's second turn promotes them back, and its tokens
    are still HF's."""
    path = checkpoint("llama3")
    system, *users = sample_prompts(path, 4, [16, 24, 60, 16])
    engine = small_engine(path, num_kv_blocks=12, max_model_len=96, warm_pool_mb=1)
    warm = engine.warm
    assert warm is not None
    slot = slot_bytes_for(warm_codec_for(engine.spec, "lossless", 8, "native"), 2)
    engine.release()
    engine = small_engine(
        path, num_kv_blocks=12, max_model_len=96, warm_pool_mb=(HEADER_SIZE + 9 * slot) / 2**20
    )
    assert engine.warm is not None and engine.warm.pool.capacity == 9
    chat(engine, path, system, users)
    hits = engine.scheduler.prefix_hits
    assert engine.warm.stats.cold_blocks > 0 and engine.warm.stats.promoted_blocks > 0
    assert hits.cold_hits == 1 and hits.cold_tokens > 0
    engine.release()


def test_idle_blocks_age_to_cold_only_when_warm_runs_short(checkpoint) -> None:  # type: ignore[no-untyped-def]
    """`age` leaves Warm alone while a quarter of it is free; when less is, it moves blocks
    idle past cold_threshold_ms to Cold until a quarter is free again."""
    path = checkpoint("llama3")
    engine = small_engine(
        path, num_kv_blocks=12, max_model_len=96, warm_pool_mb=2, cold_threshold_ms=1
    )
    warm = engine.warm
    assert warm is not None
    generate(engine, sample_prompts(path, 1, [60])[0])  # 9 blocks written back
    time.sleep(0.01)
    assert warm.age() == 0 and len(warm.cold) == 0  # most of Warm is free
    quarter = warm.pool.capacity / 4
    held = warm.pool.alloc(warm.pool.num_free - int(quarter) + 2)  # other sequences fill it
    assert warm.age() == 3 and len(warm.cold) == 3  # until a quarter is free
    assert warm.pool.num_free - 1 < quarter <= warm.pool.num_free
    warm.pool.free(held)
    engine.release()


def test_writes_back_stop_when_they_do_not_pay(checkpoint) -> None:  # type: ignore[no-untyped-def]
    """With a block's copy measured dearer than its recompute the gate shuts: finished
    turns are not written back (counted as skipped), and the next turn computes what Hot
    no longer holds, with the same tokens."""
    path = checkpoint("llama3")
    system, *users = sample_prompts(path, 4, [16, 24, 60, 16])
    engine = small_engine(path, num_kv_blocks=12, max_model_len=96, warm_pool_mb=2)
    assert engine.offload is not None
    gate = engine.offload.keep_gate
    for _ in range(MIN_SAMPLES):
        gate.kept_blocks(1, 10.0)  # ten seconds a block: never worth it
    gate.kept_blocks = lambda n, s: None  # type: ignore[method-assign]
    engine.step_times.per_unit = 1e-6  # and a block computes in microseconds
    chat(engine, path, system, users)
    assert engine.offload.kept_blocks <= 2 * 7  # explored at most once every EXPLORE_EVERY
    assert gate.shut >= 1 and engine.tier_stats()["warm_keep_skipped"] == gate.shut
    engine.release()


def test_a_shut_gate_reopens_when_histories_outgrow_hot(checkpoint) -> None:  # type: ignore[no-untyped-def]
    """The gate shut by an earlier phase (candidates that never came back) declines A's
    first turn; B's turn evicts it from Hot; A's second turn computes those blocks again,
    and the gate learns it: its own end is written back, and GetModelInfo counts the
    blocks computed again. Tokens are HF's."""
    path = checkpoint("llama3")
    system, *users = sample_prompts(path, 4, [16, 24, 60, 16])
    engine = small_engine(path, num_kv_blocks=12, max_model_len=96, warm_pool_mb=2)
    assert engine.offload is not None
    gate, offload = engine.offload.keep_gate, engine.offload
    for _ in range(MIN_SAMPLES):
        gate.kept_blocks(1, 1e-4)  # 100 us to copy a block
    engine.scheduler._recompute_block_s = lambda seq: 0.02  # type: ignore[method-assign]
    # 20 ms to compute one: copies pay from a share of 0.503 %. An earlier phase left 1,000
    # candidate blocks with 4.9 back (decayed): 0.49 %, shut.
    gate.offered, gate.returned = 1_000.0, 4.9
    assert not gate.pays(0.02)
    chat(engine, path, system, users)
    assert gate.shut >= 1  # A's first turn (and B's) were declined
    assert gate.recomputed > 0 and engine.tier_stats()["warm_keep_recomputed"] == gate.recomputed
    pb = model_info_to_pb({**engine.tier_stats(), "max_queue": 1})
    assert pb.warm_keep_recomputed == gate.recomputed
    assert f"({gate.recomputed} of their blocks computed again)" in prefix_lines(pb)[0]
    assert offload.kept_blocks > 0  # A's second turn, after the gate reopened
    assert engine.scheduler.prefix_hits.warm_hits == 0
    engine.release()


@pytest.mark.parametrize("reuse", [True, False])
def test_prefix_reuse_off_keeps_nothing(checkpoint, reuse: bool) -> None:  # type: ignore[no-untyped-def]
    path = checkpoint("llama3")
    engine = small_engine(
        path, num_kv_blocks=12, max_model_len=96, warm_pool_mb=2, prefix_reuse=reuse
    )
    generate(engine, sample_prompts(path, 1, [60])[0])
    assert engine.offload is not None and (engine.offload.kept_blocks > 0) == reuse
    engine.release()


def test_a_write_back_that_fails_costs_no_request_and_no_slot(
    checkpoint, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    """A finished turn's write-back whose encode runs out of device memory (the GPU daemon
    died of it in B6 (i) on the H200 at 08336d0): the turn still ends with HF's tokens, the
    write-back is counted as failed, the Warm slots it took are free again, and the next turn
    (computed again where Hot lost its history) is HF's too."""
    path = checkpoint("llama3")
    system, *users = sample_prompts(path, 4, [16, 24, 60, 16])
    engine = small_engine(path, num_kv_blocks=12, max_model_len=96, warm_pool_mb=2)
    assert engine.offload is not None
    pool = engine.offload.tier.pool
    free = pool.num_free

    def no_memory(*args: object) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory (test)")

    monkeypatch.setattr(pool, "store_many", no_memory)
    chat(engine, path, system, users)  # every turn's tokens checked against HF's
    assert engine.offload.keep_failed == 3 and engine.offload.kept_blocks == 0
    assert pool.num_free == free
    from hybridgen.cli.explain import prefix_lines
    from hybridgen.engine.info import engine_info
    from hybridgen.serving.service import model_info_to_pb

    pb = model_info_to_pb({**engine_info(engine), **engine.tier_stats(), "max_queue": 1})
    assert pb.warm_keep_failed == 3 and ", 3 failed, " in prefix_lines(pb)[0]
    engine.release()


def test_a_failed_steps_requests_write_nothing_back(checkpoint) -> None:  # type: ignore[no-untyped-def]
    """A step that raises ends its requests without writing their KV back to Warm (it may be
    incomplete, and the failure may be the device out of memory); the next request is HF's."""
    from hybridgen.engine.step_faults import FaultDrill

    path = checkpoint("llama3")
    first, second = sample_prompts(path, 2, [40, 40])
    engine = small_engine(path, num_kv_blocks=12, max_model_len=96, warm_pool_mb=2)
    assert engine.offload is not None
    engine.faults = FaultDrill("3:error")
    engine.add_request("r0", first, GREEDY)
    errors = [o.error for _ in range(8) for o in engine.step() if o.error is not None]
    assert errors and not engine.has_unfinished()
    assert engine.offload.kept_blocks == 0 and engine.offload.keep_failed == 0
    assert generate(engine, second) == hf_greedy(path, [second], NEW)[0]
    engine.release()
