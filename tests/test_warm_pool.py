"""Warm-KV pool: shm round trips through the codecs, a cross-process reader, allocator
invariants under random sequences, and the prefix index (sharing, chaining, LRU eviction).

Every test uses the `instance` fixture, which unlinks the instance's segments afterwards.
"""

from __future__ import annotations

import multiprocessing
import queue
import uuid
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from hybridgen.ipc import shm
from hybridgen.kvtiers.codec import get_codec
from hybridgen.kvtiers.prefix_index import PrefixIndex
from hybridgen.kvtiers.warm_pool import (
    CONFIG_KEY,
    HEADER_SIZE,
    WarmPool,
    WarmPoolFull,
    capacity_for,
)

L, S, H, D = 3, 16, 2, 64  # layers, block_size, num_kv_heads, head_dim
SPAWN = multiprocessing.get_context("spawn")


def kv(seed: int, dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    """k, v: [L, S, H, D] of one block across all layers."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(L, S, H, D, generator=g).to(dtype), torch.randn(L, S, H, D, generator=g).to(
        dtype
    )


def make_pool(
    instance: str, name: str = "lossless", capacity: int = 8, dtype: torch.dtype = torch.float32
) -> WarmPool:
    return WarmPool.create(instance, get_codec(name, S, H, D, dtype), L, capacity)


@pytest.fixture
def pool(instance: str) -> Iterator[WarmPool]:
    p = make_pool(instance)
    yield p
    p.close()


def as_bytes(t: Tensor) -> Tensor:
    return t.contiguous().view(torch.uint8)


# --- round trips ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("name", ("lossless", "lz4"))
def test_exact_codecs_round_trip_every_bit(instance: str, name: str, dtype: torch.dtype) -> None:
    with make_pool(instance, name, dtype=dtype) as p:
        blocks = [kv(seed, dtype) for seed in range(3)]
        slots = p.alloc(3)
        for s, (k, v) in zip(slots, blocks, strict=True):
            p.store(s, k, v)
        for s, (k, v) in zip(slots, blocks, strict=True):
            k2, v2 = p.load(s)
            assert k2.dtype == dtype and k2.shape == (L, S, H, D)
            assert torch.equal(as_bytes(k2), as_bytes(k)) and torch.equal(as_bytes(v2), as_bytes(v))
    assert shm.list_instance(instance) == []  # the owner's context manager unlinks


def test_int8_round_trip_within_the_codec_bound(instance: str) -> None:
    with make_pool(instance, "int8") as p:
        k, v = kv(7)
        (s,) = p.alloc(1)
        p.store(s, k, v)
        k2, v2 = p.load(s, torch.float32)
        # The pool adds nothing: its result is the codec's own, byte for byte.
        k3, v3 = p.codec.decode_blocks(p.codec.encode_blocks(k, v), torch.float32)
        assert torch.equal(k2, k3) and torch.equal(v2, v3)
        for x, y in ((k, k2), (v, v2)):
            # Symmetric int8, group 32: |error| <= half a step, step = amax(|group|) / 127.
            step = x.unflatten(-1, (-1, 32)).abs().amax(-1, keepdim=True) / 127
            err = (y - x).abs().unflatten(-1, (-1, 32))
            assert (err <= 0.5 * step * 1.001 + 1e-6).all()
            assert ((y - x).norm() / x.norm()).item() < 0.01


@pytest.mark.parametrize("name", ("lossless", "int8", "int4"))
def test_store_many_writes_what_store_writes(instance: str, name: str) -> None:
    """The batched store (one encode for several slots) gives each slot the very bytes that
    one store per slot gives."""
    with make_pool(instance, name) as p:
        blocks = [kv(seed) for seed in range(4)]
        one, many = p.alloc(4), p.alloc(4)
        for s, (k, v) in zip(one, blocks, strict=True):
            p.store(s, k, v)
        p.store_many(many, torch.stack([k for k, _ in blocks]), torch.stack([v for _, v in blocks]))
        for a, b in zip(one, many, strict=True):
            assert np.array_equal(p.record_view(a), p.record_view(b))
        with pytest.raises(ValueError, match=r"expected \[2, 3, S, H, D\]"):
            p.store_many(many[:2], blocks[0][0], blocks[0][1])


def test_record_view_is_zero_copy_and_header_is_read_back(instance: str) -> None:
    with make_pool(instance, "int8", capacity=4) as p:
        (s,) = p.alloc(1)
        k, v = kv(3)
        p.store(s, k, v)
        view = p.record_view(s)
        assert view.shape == (L, p.codec.record_bytes) and view.dtype == np.uint8
        assert p.slot_bytes == L * p.codec.record_bytes and p.slot_bytes % 16 == 0
        assert np.array_equal(view, p.codec.encode_blocks(k, v).numpy())
        reader = WarmPool.attach(instance)
        assert reader.codec == p.codec and reader.capacity == 4 and reader.num_layers == L
        reader.record_view(s)[0, 0] ^= 0xFF  # same memory: the owner sees the change
        assert view[0, 0] != p.codec.encode_blocks(k, v).numpy()[0, 0]
        del view
        reader.close()


def test_per_token_int4_records_are_described_by_the_header(instance: str) -> None:
    """An int4 Hot cache's Warm codec (keys per token): a reader rebuilds it from the header
    (flags bit 0), and store_records writes records as they are, in runs of consecutive
    slots and across gaps."""
    codec = get_codec("int4", S, H, D, torch.float32, per_token_keys=True)
    with WarmPool.create(instance, codec, L, 6) as p:
        reader = WarmPool.attach(instance)
        assert reader.codec == codec != get_codec("int4", S, H, D, torch.float32)
        free = p.alloc(6)
        slots = [free[1], free[2], free[5], free[0]]  # a run of two, a gap, a step back
        blocks = [kv(seed) for seed in range(4)]
        k = torch.stack([b[0] for b in blocks]).flatten(0, 1)
        v = torch.stack([b[1] for b in blocks]).flatten(0, 1)
        records = codec.encode_blocks(k, v).view(4, L, -1)
        p.store_records(slots, records)
        assert np.array_equal(reader.slot_area()[slots], records.numpy())
        p.store(free[3], *blocks[2])  # the same bytes by the encoding path
        assert np.array_equal(reader.slot_area()[free[3]], records[2].numpy())
        with pytest.raises(ValueError, match=r"expected \[4, 3, \d+\] uint8"):
            p.store_records(slots, records[:, 0])
        reader.close()


def _reader(instance: str, slots: list[int], out: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    """Spawned child: attach, load the slots, send back raw bytes (torch-free pickles)."""
    pool = WarmPool.attach(instance, wait=10.0)
    try:
        loaded = [pool.load(s) for s in slots]
        out.put([(as_bytes(k).numpy(), as_bytes(v).numpy()) for k, v in loaded])
    finally:
        pool.close()


def test_reader_process_loads_identical_tensors(instance: str) -> None:
    with make_pool(instance, "lossless", dtype=torch.bfloat16) as p:
        blocks = [kv(seed, torch.bfloat16) for seed in range(4)]
        slots = p.alloc(4)
        for s, (k, v) in zip(slots, blocks, strict=True):
            p.store(s, k, v)
        out = SPAWN.Queue()
        proc = SPAWN.Process(target=_reader, args=(instance, slots, out), daemon=True)
        proc.start()
        try:
            got = out.get(timeout=60)
        except queue.Empty:
            pytest.fail("reader process sent nothing")
        finally:
            proc.join(30)
        assert proc.exitcode == 0
        for (kb, vb), (k, v) in zip(got, blocks, strict=True):
            assert np.array_equal(kb, as_bytes(k).numpy())
            assert np.array_equal(vb, as_bytes(v).numpy())


def test_attach_without_owner_and_reader_cannot_allocate(instance: str) -> None:
    with pytest.raises(FileNotFoundError):
        WarmPool.attach(instance)
    with make_pool(instance) as p:
        reader = WarmPool.attach(instance)
        with pytest.raises(RuntimeError, match="owner-only"):
            reader.alloc(1)
        reader.close()
        p.alloc(1)


def test_create_replaces_a_stale_segment(instance: str) -> None:
    old = make_pool(instance, capacity=2)
    old.close()  # crashed owner: segment left behind
    with make_pool(instance, "int4", capacity=5) as p:
        reader = WarmPool.attach(instance)
        assert reader.capacity == 5 and reader.codec.name == "int4" and p.num_free == 5
        reader.close()


# --- allocation -------------------------------------------------------------------------------


def test_full_pool_names_the_config_key_and_changes_nothing(pool: WarmPool) -> None:
    pool.alloc(6)
    with pytest.raises(WarmPoolFull, match=CONFIG_KEY):
        pool.alloc(3)
    assert pool.num_free == 2
    assert len(pool.alloc(2)) == 2


def test_double_free_and_share_of_free_slot_raise(pool: WarmPool) -> None:
    a, b = pool.alloc(2)
    pool.free([a])
    with pytest.raises(ValueError, match="double free"):
        pool.free([a, b])  # all or nothing: b keeps its reference
    assert pool.refcount(b) == 1
    with pytest.raises(ValueError, match="free slots"):
        pool.share([a])
    with pytest.raises(ValueError, match="is free"):
        pool.store(a, *kv(0))
    with pytest.raises(IndexError, match="outside"):
        pool.free([8])


def test_capacity_for_derives_slots_from_the_budget() -> None:
    codec = get_codec("int8", S, H, D, torch.bfloat16)
    slot = codec.record_bytes * L
    assert capacity_for(0, codec, L) == 0
    assert capacity_for(1, codec, L) == (2**20 - HEADER_SIZE) // slot
    # int8 fits ~1.9x the slots of lossless in the same budget.
    lossless = get_codec("lossless", S, H, D, torch.bfloat16)
    assert capacity_for(64, codec, L) > 1.8 * capacity_for(64, lossless, L)


_OPS = st.lists(
    st.tuples(st.sampled_from(("alloc", "free", "share")), st.integers(0, 5), st.integers(0, 99)),
    max_size=60,
)


@settings(max_examples=60, deadline=None)
@given(ops=_OPS)
def test_random_alloc_free_share_never_double_hands_out_or_leaks(
    ops: list[tuple[str, int, int]],
) -> None:
    name = "h" + uuid.uuid4().hex[:16]
    pool = make_pool(name, capacity=6)
    try:
        refs: dict[int, int] = {}  # model: live slot -> references
        for op, n, pick in ops:
            live = sorted(refs)
            if op == "alloc":
                if n > pool.num_free:
                    with pytest.raises(WarmPoolFull):
                        pool.alloc(n)
                    continue
                got = pool.alloc(n)
                assert len(set(got)) == n and not set(got) & set(refs)  # never handed out twice
                refs.update(dict.fromkeys(got, 1))
            elif live:
                chosen = [live[(pick + i) % len(live)] for i in range(min(n, len(live)))]
                if op == "share":
                    pool.share(chosen)
                    for s in chosen:
                        refs[s] += 1
                else:
                    pool.free(chosen)
                    for s in chosen:
                        refs[s] -= 1
                        if refs[s] == 0:
                            del refs[s]
            assert pool.num_free + len(refs) == pool.capacity
            assert all(pool.refcount(s) == c for s, c in refs.items())
        for s, c in list(refs.items()):
            pool.free([s] * c)
        assert pool.num_free == pool.capacity  # no leak
    finally:
        pool.close()
        shm.unlink_all(name)


# --- prefix index -----------------------------------------------------------------------------


def tokens(*blocks: int, tail: int = 0) -> list[int]:
    """Whole blocks whose ids are derived from the given block labels, plus a partial tail."""
    out = [b * 1000 + i for b in blocks for i in range(S)]
    return out + list(range(tail))


def test_prompts_sharing_a_prefix_share_its_slots(pool: WarmPool) -> None:
    index = PrefixIndex(pool)
    a = tokens(1, 2, 3, 4, tail=5)
    slots_a = pool.alloc(5)  # 4 full blocks and the partial tail
    assert index.insert(a, slots_a) == 4  # the partial block is not cached
    pool.free(slots_a)  # sequence A finishes; the index keeps the full blocks
    assert pool.num_free == pool.capacity - 4
    b = tokens(1, 2, 3, 9, tail=3)
    hit = index.lookup(b)
    assert hit == slots_a[:3]
    assert all(pool.refcount(s) == 2 for s in hit)  # the index and sequence B
    pool.free(hit)
    # A differing first block breaks the whole chain, even if later blocks match.
    assert index.lookup(tokens(7, 2, 3, 4)) == []
    # The same blocks after a different prefix are different keys.
    assert index.lookup(tokens(2, 3)) == []
    assert index.lookup(tokens(1, tail=S - 1)) == slots_a[:1]  # only whole blocks
    pool.free(slots_a[:1])


def test_lru_eviction_frees_unreferenced_slots_tail_first(pool: WarmPool) -> None:
    index = PrefixIndex(pool)
    old = pool.alloc(4)
    index.insert(tokens(1, 2, 3, 4), old)
    pool.free(old)
    new = pool.alloc(3)
    index.insert(tokens(5, 6, 7), new)  # new is still held by its sequence
    assert pool.num_free == 1
    got = index.alloc(3)  # evicts the 2 least recent entries: the tail of the old chain
    assert sorted(got) == sorted([*old[2:], next(s for s in range(8) if s not in old + new)])
    assert index.lookup(tokens(1, 2, 3, 4)) == old[:2]  # the head survives
    pool.free(old[:2])
    # Entries whose slots a sequence still holds stay: dropping them would free nothing.
    with pytest.raises(WarmPoolFull, match=CONFIG_KEY):
        index.alloc(4)
    assert len(index) == 3
    assert all(pool.refcount(s) == 2 for s in new)
    pool.free(new)
    assert index.evict(pool.capacity) == 3 and len(index) == 0
    pool.free(got)
    assert pool.num_free == pool.capacity


def test_eviction_weighs_reuse_beside_recency(pool: WarmPool) -> None:
    """A prefix hit again and again (a shared system prompt) outlives a more recent one never
    hit (pure LRU would evict it first); the tail goes before its head, and each victim
    passes through `demote` while its slot is readable."""
    from hybridgen.kvtiers import prefix_index

    index = PrefixIndex(pool)
    clock = iter(range(0, 10_000, 10))
    monkey = pytest.MonkeyPatch()
    monkey.setattr(prefix_index.time, "monotonic", lambda: float(next(clock)))
    try:
        shared = pool.alloc(2)
        index.insert(tokens(1, 2), shared)
        pool.free(shared)
        for _ in range(3):  # three conversations start from it
            pool.free(index.lookup(tokens(1, 2)))
        once = pool.alloc(2)
        index.insert(tokens(5, 6), once)  # newer, never hit
        pool.free(once)
        demoted: list[int] = []
        index.demote = lambda key, slot: demoted.append(slot)
        index.evict(pool.num_free + 2)
        assert demoted == [once[1], once[0]]  # the newer, unshared one goes, tail first
        assert index.lookup(tokens(1, 2)) == shared
        pool.free(shared)
        assert index.lookup(tokens(5, 6)) == []
    finally:
        monkey.undo()


def test_insert_of_a_free_slot_changes_nothing(pool: WarmPool) -> None:
    index = PrefixIndex(pool)
    a, b = pool.alloc(2)
    pool.free([b])
    with pytest.raises(ValueError, match="free slots"):
        index.insert(tokens(1, 2), [a, b])
    assert len(index) == 0 and pool.refcount(a) == 1


def test_zero_budget_pool_refuses_every_block(instance: str) -> None:
    codec = get_codec("int8", S, H, D, torch.bfloat16)
    with WarmPool.create(instance, codec, L, capacity_for(0, codec, L)) as p:
        reader = WarmPool.attach(instance)
        assert p.capacity == 0 and reader.capacity == 0
        reader.close()
        with pytest.raises(WarmPoolFull, match=CONFIG_KEY):
            PrefixIndex(p).alloc(1)


_PROMPTS = st.lists(st.lists(st.integers(1, 3), max_size=4), min_size=1, max_size=25)


@settings(max_examples=40, deadline=None)
@given(prompts=_PROMPTS)
def test_prefix_index_keeps_one_reference_per_entry_and_strands_nothing(
    prompts: list[list[int]],
) -> None:
    """Serve prompts one after another (lookup, alloc the misses, insert, finish); after each,
    the index holds exactly the references of the pool and every entry is reachable."""
    name = "h" + uuid.uuid4().hex[:16]
    pool = make_pool(name, capacity=5)
    index = PrefixIndex(pool)
    try:
        for blocks in prompts:
            ids = tokens(*blocks, tail=1)
            hit = index.lookup(ids)
            try:
                fresh = index.alloc(len(blocks) - len(hit))
            except WarmPoolFull:
                pool.free(hit)
                continue
            index.insert(ids, hit + fresh)
            pool.free(hit + fresh)  # the sequence finishes
            cached = [s for s in range(pool.capacity) if pool.refcount(s)]
            assert all(pool.refcount(s) == 1 for s in cached)
            assert len(cached) == len(index) == pool.capacity - pool.num_free
            # Reachable: every cached slot is found by looking up some served prompt.
            reached: set[int] = set()
            for seen in prompts:
                got = index.lookup(tokens(*seen))
                reached.update(got)
                pool.free(got)
            assert reached == set(cached)
    finally:
        pool.close()
        shm.unlink_all(name)
