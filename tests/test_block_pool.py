"""Block pool invariants under arbitrary allocate / share / free / preempt sequences."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridgen.engine.block_pool import BlockPool, OutOfBlocks


def test_allocate_is_all_or_nothing() -> None:
    pool = BlockPool(4, 16)
    pool.allocate(3)
    with pytest.raises(OutOfBlocks):
        pool.allocate(2)
    assert pool.num_free == 1


def test_double_free_is_refused() -> None:
    pool = BlockPool(4, 16)
    ids = pool.allocate(2)
    pool.free(ids)
    with pytest.raises(ValueError, match="freed more often"):
        pool.free(ids)
    with pytest.raises(ValueError, match="freed more often"):
        pool.free([pool.allocate(1)[0]] * 2)


def test_shared_block_is_freed_by_last_holder() -> None:
    pool = BlockPool(2, 16)
    ids = pool.allocate(1)
    pool.share(ids)
    pool.free(ids)
    assert pool.num_free == 1 and pool.refcount(ids[0]) == 1
    pool.free(ids)
    assert pool.num_free == 2
    with pytest.raises(ValueError, match="is free"):
        pool.share(ids)


def test_blocks_for_rounds_up() -> None:
    pool = BlockPool(1, 16)
    assert [pool.blocks_for(n) for n in (0, 1, 16, 17, 32)] == [0, 1, 1, 2, 2]


ops = st.lists(
    st.tuples(
        st.sampled_from(["alloc", "grow", "share", "free", "preempt"]),
        st.integers(0, 7),
        st.integers(1, 5),
    ),
    max_size=80,
)


@settings(max_examples=200, deadline=None)
@given(ops)
def test_no_overlap_and_no_leak(program: list[tuple[str, int, int]]) -> None:
    pool = BlockPool(24, 4)
    held: dict[int, list[int]] = {}  # owner -> blocks it holds (owned or shared)
    owned: dict[int, set[int]] = {}  # owner -> blocks it allocated fresh
    for op, owner, n in program:
        if op in ("alloc", "grow"):
            if n > pool.num_free:
                with pytest.raises(OutOfBlocks):
                    pool.allocate(n)
                continue
            fresh = pool.allocate(n)
            for blocks in owned.values():
                assert not blocks & set(fresh), "a fresh block was already owned"
            held.setdefault(owner, []).extend(fresh)
            owned.setdefault(owner, set()).update(fresh)
        elif op == "share" and held.get(owner):
            other = (owner + 1) % 8
            pool.share(held[owner])
            held.setdefault(other, []).extend(held[owner])
        elif op in ("free", "preempt") and owner in held:
            pool.free(held.pop(owner))
            owned.pop(owner, None)
        refs: dict[int, int] = {}
        for blocks in held.values():
            for b in blocks:
                refs[b] = refs.get(b, 0) + 1
        assert all(pool.refcount(b) == r for b, r in refs.items())
        assert pool.num_free == pool.num_blocks - len(refs)
    for blocks in list(held.values()):
        pool.free(blocks)
    assert pool.num_free == pool.num_blocks


# ----------------------------------------------------------------------------------------------
# prefix cache: register / lookup / idle blocks


def _key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def test_released_cached_block_is_found_again() -> None:
    pool = BlockPool(4, 16)
    a, b = pool.allocate(2)
    pool.register(a, _key(1))
    pool.register(b, _key(2))
    pool.free([a, b])
    assert pool.num_free == 4 and pool.num_cached == 2  # idle blocks count as free
    assert pool.lookup([_key(1), _key(2), _key(3)]) == [a, b]
    assert pool.refcount(a) == pool.refcount(b) == 1 and pool.num_free == 2


def test_lookup_stops_at_the_first_miss() -> None:
    pool = BlockPool(4, 16)
    a, b = pool.allocate(2)
    pool.register(a, _key(1))
    pool.register(b, _key(3))
    assert pool.lookup([_key(1), _key(2), _key(3)]) == [a]
    assert pool.refcount(a) == 2


def test_allocation_takes_free_blocks_before_evicting_idle_ones_lru() -> None:
    pool = BlockPool(4, 16)
    blocks = pool.allocate(3)
    for i, b in enumerate(blocks):
        pool.register(b, _key(i))
    pool.free([blocks[2], blocks[1]])  # a sequence's blocks go idle tail first: 1, 2
    pool.free([blocks[0]])  # idle order now 1, 2, 0
    fresh = pool.allocate(2)  # the free block, then the least recently released idle one
    assert blocks[1] in fresh and not set(fresh) & {blocks[0], blocks[2]}
    assert pool.lookup([_key(1)]) == []  # evicted: no longer cached
    assert pool.lookup([_key(0)]) == [blocks[0]]
    assert pool.lookup([_key(2)]) == [blocks[2]]
    assert pool.num_cached == 2


def test_register_keeps_the_first_block_of_a_key() -> None:
    pool = BlockPool(4, 16)
    a, b = pool.allocate(2)
    pool.register(a, _key(7))
    pool.register(b, _key(7))  # same content computed twice: the first copy stays cached
    pool.register(a, _key(8))  # a block has one key
    assert pool.lookup([_key(7)]) == [a] and pool.lookup([_key(8)]) == []
    pool.free([b])
    assert pool.num_free == 3  # b was never cached: straight to the free list
    with pytest.raises(ValueError, match="not held"):
        pool.register(b, _key(9))


cache_ops = st.lists(
    st.tuples(
        st.sampled_from(["alloc", "register", "free", "lookup"]),
        st.integers(0, 5),
        st.integers(1, 4),
    ),
    max_size=80,
)


@settings(max_examples=200, deadline=None)
@given(cache_ops)
def test_prefix_cache_never_hands_out_a_held_block(program: list[tuple[str, int, int]]) -> None:
    """Under any mix of allocate / register / free / lookup: a fresh block is never one that
    somebody holds, refcounts match the holders, a lookup returns only blocks registered
    under those keys, and everything is free (or idle) once all holders let go."""
    pool = BlockPool(12, 4)
    held: dict[int, list[int]] = {}
    keys: dict[bytes, int] = {}  # what a lookup may return for a key
    for op, owner, n in program:
        live = {b for blocks in held.values() for b in blocks}
        if op == "alloc":
            if n > pool.num_free:
                with pytest.raises(OutOfBlocks):
                    pool.allocate(n)
                continue
            fresh = pool.allocate(n)
            assert not live & set(fresh), "allocate returned a held block"
            keys = {k: b for k, b in keys.items() if b not in fresh}  # evicted on reuse
            held.setdefault(owner, []).extend(fresh)
        elif op == "register" and held.get(owner):
            b = held[owner][n % len(held[owner])]
            k = _key(owner * 100 + n)
            if k not in keys and b not in keys.values():
                keys[k] = b
            pool.register(b, k)
        elif op == "free" and owner in held:
            pool.free(held.pop(owner))
        elif op == "lookup":
            k = _key(owner * 100 + n)
            found = pool.lookup([k])
            assert found == ([keys[k]] if k in keys else [])
            held.setdefault(owner + 10, []).extend(found)
        refs: dict[int, int] = {}
        for blocks in held.values():
            for b in blocks:
                refs[b] = refs.get(b, 0) + 1
        assert all(pool.refcount(b) == r for b, r in refs.items())
        assert pool.num_free == pool.num_blocks - len(refs)
    for blocks in list(held.values()):
        pool.free(blocks)
    assert pool.num_free == pool.num_blocks
