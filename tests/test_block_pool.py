"""Block pool invariants under arbitrary allocate / share / free / preempt sequences."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridgen.gpu_daemon.block_pool import BlockPool, OutOfBlocks


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
