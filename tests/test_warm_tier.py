"""The engine's Warm tier on the CPU: Hot blocks spilled to compressed host memory, attended
in each attn_warm mode, and swapped there on preemption, with HF's exact greedy tokens."""

from __future__ import annotations

import time
import uuid

import pytest

from hybridgen.config.engine import ConfigError, EngineConfig
from hybridgen.engine.engine import Engine
from hybridgen.engine.scheduler import ScheduledBatch
from hybridgen.sampling.params import SamplingParams
from tests.engine_helpers import reference_tokens, small_engine
from tests.hf_reference import hf_greedy, sample_prompts

NEW_TOKENS = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["cpu", "gpu", "split"])
def test_long_prompts_beyond_a_tiny_hot_pool_match_hf(checkpoint, mode: str) -> None:  # type: ignore[no-untyped-def]
    """Hot holds 6 blocks (48 tokens); two prompts of 150 and 97 tokens plus 32 new tokens
    each live mostly in Warm (lossless), and every decode step attends both tiers."""
    path = checkpoint("llama3")
    prompts = sample_prompts(path, 2, [150, 97])
    expected = hf_greedy(path, prompts, NEW_TOKENS)
    unbudgeted = small_engine(path).generate(prompts, GREEDY)
    assert [c.token_ids for c in unbudgeted] == expected
    engine = small_engine(
        path, num_kv_blocks=6, max_num_seqs=2, warm_pool_mb=2, attn_warm=mode, warm_split=0.5
    )
    assert [c.token_ids for c in engine.generate(prompts, GREEDY)] == expected
    st = engine.warm.stats  # type: ignore[union-attr]
    assert st.spilled_blocks >= (150 + 97 + 2 * NEW_TOKENS) // 8 - 6 - 2
    assert st.warm_keys > 3 * st.hot_keys  # most keys were read from Warm
    if mode != "gpu":
        assert st.cpu.calls > 0 and st.cpu.decode_s > 0
    if mode != "cpu":
        assert st.h2d_bytes > 0
    warm = engine.warm
    assert warm is not None  # finished: every used slot is held by the prefix index alone
    assert warm.pool.num_free + warm.index.evictable() == warm.pool.capacity
    engine.release()


@pytest.mark.slow
def test_split_copies_the_cpu_queries_before_queuing_the_device_share(  # type: ignore[no-untyped-def]
    checkpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Mode (c) overlaps: at every layer the CPU share's queries reach the host before the
    device's share is queued (on CUDA a copy after it would wait for that share to finish,
    and the two would run one after the other), and the CPU computes from that copy."""
    from hybridgen.kvtiers import warm_context

    path = checkpoint("llama3")
    engine = small_engine(
        path, num_kv_blocks=6, max_num_seqs=2, warm_pool_mb=2, attn_warm="split", warm_split=0.5
    )
    tier = engine.warm
    assert tier is not None
    order: list[str] = []
    copies: list[object] = []
    real_host, real_device, real_cpu = warm_context._to_host, tier.device_partial, tier.cpu_partial

    def to_host(q):  # type: ignore[no-untyped-def]
        order.append("host")
        copies.append(out := real_host(q))
        return out

    def device_partial(*args, **kwargs):  # type: ignore[no-untyped-def]
        order.append("device")
        return real_device(*args, **kwargs)

    def cpu_partial(layer, q, *args, **kwargs):  # type: ignore[no-untyped-def]
        assert q is copies[-1]
        order.append("cpu")
        return real_cpu(layer, q, *args, **kwargs)

    monkeypatch.setattr(warm_context, "_to_host", to_host)
    monkeypatch.setattr(tier, "device_partial", device_partial)
    monkeypatch.setattr(tier, "cpu_partial", cpu_partial)
    engine.generate(sample_prompts(path, 1, [150]), GREEDY)
    assert order and order[:3] == ["host", "device", "cpu"]
    assert order == ["host", "device", "cpu"] * (len(order) // 3)
    engine.release()


@pytest.mark.slow
def test_a_prompt_that_fits_hot_waits_instead_of_spilling(checkpoint) -> None:  # type: ignore[no-untyped-def]
    """Hot holds 12 blocks (96 tokens). Two sequences of 60 + 8 tokens each fit it alone but
    not together: the second waits for the first instead of pushing it into Warm, so no block
    moves. A 150-token prompt cannot fit Hot at all: it is admitted beside the running one,
    and its blocks spill."""
    path = checkpoint("llama3")
    fits = sample_prompts(path, 2, [60, 61])
    short = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    expected = hf_greedy(path, fits, 8)
    engine = small_engine(path, num_kv_blocks=12, warm_pool_mb=2)
    assert [c.token_ids for c in engine.generate(fits, short)] == expected
    assert engine.warm is not None and engine.warm.stats.spilled_blocks == 0
    assert engine.scheduler.kv_short is False  # drained; it was set while r1 waited

    engine.add_request("fits", fits[0], short)
    engine.step()
    engine.add_request("long", sample_prompts(path, 1, [150])[0], short)
    engine.step()
    assert {s.request_id for s in engine.scheduler.running} == {"fits", "long"}
    while engine.has_unfinished():
        engine.step()
    assert engine.warm.stats.spilled_blocks > 0
    engine.release()


@pytest.mark.slow
@pytest.mark.parametrize("hot", ["native", "int4"])
def test_preemption_swaps_to_warm_instead_of_recomputing(checkpoint, hot: str) -> None:  # type: ignore[no-untyped-def]
    """A preempted sequence keeps its computed full blocks in Warm, frees all its Hot blocks,
    and on readmission gets them back into Hot and recomputes only its partial last block;
    tokens are still HF's (an int4 Hot cache's: those of int4 Hot with no preemption)."""
    path = checkpoint("llama3")
    prompts = sample_prompts(path, 2, [60, 45])
    expected = reference_tokens(path, prompts, hot, NEW_TOKENS)
    codec = "lossless" if hot == "native" else hot
    engine = small_engine(path, warm_pool_mb=2, hot_codec=hot, warm_codec=codec)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, GREEDY)
    tokens: dict[str, list[int]] = {"r0": [], "r1": []}
    while len(tokens["r1"]) < 5:
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    victim = engine.seqs["r1"]
    computed = victim.num_computed_tokens
    engine.scheduler._preempt(victim, ScheduledBatch())  # what a short Hot pool triggers
    assert victim.block_ids == [] and len(victim.warm_slots) == computed // 8
    assert victim.num_computed_tokens == computed // 8 * 8
    assert engine.warm.stats.swapped_blocks == computed // 8  # type: ignore[union-attr]
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    assert [tokens["r0"], tokens["r1"]] == expected
    assert engine.scheduler.resumed_tokens == computed // 8 * 8
    # Readmitted with room in Hot: its Warm prefix was copied back, not read over PCIe.
    assert engine.warm.stats.loaded_blocks == computed // 8  # type: ignore[union-attr]


def test_warm_tier_settings_are_checked(checkpoint) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError, match=r"^attn_warm="):
        EngineConfig(attn_warm="tpu")
    with pytest.raises(ConfigError, match=r"^warm_codec='int8' .* allowed int4 with hot_codec"):
        EngineConfig(warm_pool_mb=8, hot_codec="int4", warm_codec="int8")
    with pytest.raises(ConfigError, match=r"warm_pool_mb=0\.01 is too small"):
        small_engine(checkpoint("llama3"), num_kv_blocks=8, warm_pool_mb=0.01)
    with pytest.raises(ValueError, match="sliding-window"):
        small_engine(checkpoint("mistral"), warm_pool_mb=2)


@pytest.mark.slow
def test_tier_stats_reach_model_info_and_metrics(checkpoint) -> None:  # type: ignore[no-untyped-def]
    """After Warm use, the engine's tier figures are set, survive GetModelInfo's protobuf,
    and land in the Prometheus gauges."""
    from hybridgen.engine.info import engine_info
    from hybridgen.serving.metrics import Metrics
    from hybridgen.serving.service import model_info_to_pb

    path = checkpoint("llama3")
    engine = small_engine(
        path, num_kv_blocks=8, warm_pool_mb=2, attn_warm="split", warm_draft_tokens=2
    )
    engine.generate(sample_prompts(path, 1, [120]), GREEDY)
    stats = engine.tier_stats()
    assert stats["warm_drafted_tokens"] > stats["warm_accepted_drafts"] >= 0
    assert stats["warm_blocks_total"] > 0 and 0 < stats["hot_hit_rate"] < 0.5
    assert stats["warm_decompress_p95_ms"] >= stats["warm_decompress_p50_ms"] > 0
    assert stats["cpu_attention_ms"] > 0 and stats["pcie_h2d_bytes"] > 0
    assert stats["pcie_d2h_bytes"] > 0
    pb = model_info_to_pb({**engine_info(engine), **stats, "max_queue": 1})
    assert pb.hot_hit_rate == pytest.approx(stats["hot_hit_rate"])
    assert pb.pcie_h2d_bytes == stats["pcie_h2d_bytes"]
    metrics = Metrics()
    metrics.set_kv_tiers(stats)
    value = metrics.registry.get_sample_value
    assert value("hybridgen_kv_hot_hit_ratio") == pytest.approx(stats["hot_hit_rate"])
    assert value("hybridgen_kv_transfer_bytes", {"direction": "d2h"}) == stats["pcie_d2h_bytes"]
    assert pb.warm_drafted_tokens == stats["warm_drafted_tokens"]
    drafted = value("hybridgen_warm_draft_tokens", {"outcome": "drafted"})
    assert drafted == stats["warm_drafted_tokens"]


@pytest.fixture(scope="module")
def tiny_reference() -> tuple[list[int], list[int]]:
    from hybridgen.benchmarks.engine_bench import random_prompts

    prompt = random_prompts(1, 200, 512, seed=11)[0]
    engine = Engine(EngineConfig(model="tiny-llama", device="cpu"))
    params = SamplingParams(temperature=0.0, max_tokens=256, ignore_eos=True)
    return prompt, engine.generate([prompt], params)[0].token_ids


# Measured (tiny-llama, seed 0 weights, prompt seed 11): lossless 1.0, int8 1.0, int4 0.92.
LOSSY_AGREEMENT = {"lossless": 1.0, "int8": 0.95, "int4": 0.8}


@pytest.mark.slow
@pytest.mark.parametrize("codec", ["lossless", "int8", "int4"])
def test_lossy_warm_codecs_keep_greedy_agreement(tiny_reference, codec: str) -> None:  # type: ignore[no-untyped-def]
    """Teacher-forced greedy agreement over 256 tokens (every 4th position) with the prompt's
    KV mostly in Warm under each codec: the next token given the unbudgeted engine's own
    prefix, against that engine's token. Lossless must agree everywhere."""
    prompt, reference = tiny_reference
    engine = Engine(
        EngineConfig(
            model="tiny-llama",
            device="cpu",
            kv_pool_mb=0.25,  # 128 tokens of Hot
            warm_pool_mb=4,
            warm_codec=codec,
            max_num_seqs=1,
            max_num_batched_tokens=64,
            max_model_len=512,
        )
    )
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    positions = range(0, 256, 4)
    hits = sum(
        engine.generate([prompt + reference[:i]], one)[0].token_ids[0] == reference[i]
        for i in positions
    )
    assert engine.warm is not None and engine.warm.stats.spilled_blocks > 0
    assert hits / len(positions) >= LOSSY_AGREEMENT[codec]


@pytest.mark.slow
def test_second_turn_reuses_a_prefix_held_in_warm(checkpoint) -> None:  # type: ignore[no-untyped-def]
    """Turn 1's KV was spilled to Warm (Hot holds 48 tokens); turn 2 starts from it: only
    the new tokens are computed, and the tokens are HF's."""
    path = checkpoint("llama3")
    first, extra = sample_prompts(path, 2, [150, 10])
    engine = small_engine(path, num_kv_blocks=6, max_num_seqs=2, warm_pool_mb=2)
    answer = engine.generate([first], GREEDY)[0].token_ids
    second = first + answer + extra
    expected = hf_greedy(path, [second], NEW_TOKENS)
    before = engine.scheduler.prefix_hit_tokens
    assert engine.generate([second], GREEDY)[0].token_ids == expected[0]
    reused = engine.scheduler.prefix_hit_tokens - before
    assert reused >= (len(first) + NEW_TOKENS) // 8 * 8 - 8 * 6  # at most Hot's part recomputed


def test_warm_pool_is_named_after_the_server_instance(checkpoint) -> None:  # type: ignore[no-untyped-def]
    """Under a daemon the Warm pool lives in the instance's namespace, so the daemon's
    unlink_all on exit (or the next start) removes it; release() removes it too."""
    from hybridgen.ipc import shm

    instance = f"wt{uuid.uuid4().hex[:8]}"
    engine = small_engine(
        checkpoint("llama3"), num_kv_blocks=8, warm_pool_mb=1, shm_instance=instance
    )
    assert shm.segment_name(instance, "warm").lstrip("/") in {p.name for p in shm.SHM_DIR.iterdir()}
    engine.release()
    assert not [p for p in shm.SHM_DIR.iterdir() if instance in p.name]


def test_unpinned_attn_warm_is_measured(checkpoint) -> None:  # type: ignore[no-untyped-def]
    """Without a pin (auto) the engine picks the placement: the CPU on a CPU-only engine;
    on CUDA from measured times, through choose_placement."""
    from hybridgen.placement.region_timing import choose_placement

    engine = small_engine(checkpoint("llama3"), num_kv_blocks=8, warm_pool_mb=1, attn_warm="auto")
    assert engine.warm is not None and engine.warm.mode == "cpu"
    assert choose_placement(1.0, 0.1) == ("gpu", 0.0)
    assert choose_placement(0.1, 1.0) == ("cpu", 1.0)
    mode, share = choose_placement(3.0, 1.0)  # the CPU 3x slower: it takes a quarter
    assert mode == "split" and share == pytest.approx(0.25)


@pytest.mark.slow
def test_unused_prefix_goes_cold_and_comes_back(checkpoint) -> None:  # type: ignore[no-untyped-def]
    """A finished turn's Warm blocks, unused past cold_threshold_ms, move to Cold (lz4 over
    the warm records) when Warm runs short, and free their slots; the next turn promotes them
    back, and its tokens are still HF's."""
    path = checkpoint("llama3")
    first, extra = sample_prompts(path, 2, [150, 10])
    engine = small_engine(
        path, num_kv_blocks=6, max_num_seqs=2, warm_pool_mb=2, cold_threshold_ms=1
    )
    warm = engine.warm
    assert warm is not None
    answer = engine.generate([first], GREEDY)[0].token_ids
    time.sleep(0.01)
    held = warm.pool.alloc(warm.pool.num_free)  # other sequences fill Warm
    moved = warm.age()
    assert moved > 0 and len(warm.cold) == moved and warm.cold.nbytes > 0
    warm.pool.free(held)
    assert warm.pool.num_free == warm.pool.capacity  # Cold holds them now, not Warm
    second = first + answer + extra
    expected = hf_greedy(path, [second], NEW_TOKENS)
    before = engine.scheduler.prefix_hit_tokens
    assert engine.generate([second], GREEDY)[0].token_ids == expected[0]
    assert warm.stats.promoted_blocks > 0
    assert engine.scheduler.prefix_hit_tokens - before >= warm.stats.promoted_blocks * 8


def test_private_warm_pool_leaves_nothing_in_dev_shm(checkpoint) -> None:  # type: ignore[no-untyped-def]
    """An in-process engine's Warm pool has no name in /dev/shm at all, so an engine that is
    never released (a crash, a script) cannot leave one behind."""
    from hybridgen.ipc import shm

    before = {p.name for p in shm.SHM_DIR.iterdir()}
    engine = small_engine(checkpoint("llama3"), num_kv_blocks=8, warm_pool_mb=1)
    assert engine.warm is not None
    assert {p.name for p in shm.SHM_DIR.iterdir()} - before == set()


def test_cold_store_counts_a_re_aged_prefix_once() -> None:
    """The same prefix can age into Cold twice (recomputed in between): its bytes count once,
    and the byte cap drops the least recently stored first."""
    from hybridgen.kvtiers.cold_store import ColdStore

    record = bytes(range(256)) * 8
    cold = ColdStore(capacity=10_000, threshold_s=0.1)
    cold.put(b"a", record)
    once = cold.nbytes
    cold.put(b"a", record)
    assert len(cold) == 1 and cold.nbytes == once
    assert cold.take(b"a") == record and cold.nbytes == 0 and cold.take(b"a") is None
    small = ColdStore(capacity=2 * once, threshold_s=0.1)
    for key in (b"x", b"y", b"z"):
        small.put(key, record)
    assert small.take(b"x") is None and small.take(b"z") == record


@pytest.mark.slow
@pytest.mark.parametrize("codec", ["lossless", "int4"])
def test_kv_codec_placements_give_the_same_tokens(checkpoint, codec: str) -> None:  # type: ignore[no-untyped-def]
    """placements.kv_codec: Warm records encoded (on spill) and decoded (for prefill and the
    device's share) by the device or by the CPU give the same tokens; lossless gives HF's.
    The CPU placement moves blocks raw, so more bytes cross each way."""
    path = checkpoint("llama3")
    prompts = sample_prompts(path, 2, [150, 97])
    tokens, crossed = {}, {}
    for where in ("gpu", "cpu"):
        engine = small_engine(
            path,
            num_kv_blocks=6,
            max_num_seqs=2,
            warm_pool_mb=2,
            warm_codec=codec,
            attn_warm="gpu",
            kv_codec_placement=where,
        )
        tokens[where] = [c.token_ids for c in engine.generate(prompts, GREEDY)]
        st = engine.warm.stats  # type: ignore[union-attr]
        assert st.spilled_blocks > 0 and st.warm_keys > st.hot_keys
        crossed[where] = (st.d2h_bytes, st.h2d_bytes)
        engine.release()
    assert tokens["cpu"] == tokens["gpu"]
    if codec == "lossless":
        assert tokens["gpu"] == hf_greedy(path, prompts, NEW_TOKENS)
    else:  # int4 records are a quarter of the raw bytes
        assert crossed["cpu"][0] > 3 * crossed["gpu"][0]
        # The decode reads the records in place either way (warm_device), so only the
        # prefill's Warm prefix crosses raw.
        assert crossed["cpu"][1] > crossed["gpu"][1]
