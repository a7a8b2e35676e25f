"""The Meta-Buffer: FIFO payload arena in shared memory (wrap-around, full, zero-copy)."""

from __future__ import annotations

import numpy as np
import pytest

from hybridgen.ipc.meta_buffer import ArenaFull, MetaBuffer

# ---- Meta-Buffer ----------------------------------------------------------------------------


def test_meta_buffer_round_trip_wrap_and_fifo(instance: str) -> None:
    with MetaBuffer.create(instance, "meta", 4096) as prod:
        cons = MetaBuffer.attach(instance, "meta")
        try:
            live: list[tuple[int, int, bytes]] = []
            for i in range(200):  # many laps of the arena, with varying sizes
                data = bytes([i % 251]) * (1 + (i * 37) % 900)
                placed = prod.try_write(data)
                while placed is None:
                    offset, length, expect = live.pop(0)
                    assert cons.read_bytes(offset, length) == expect
                    cons.release(offset, length)
                    placed = prod.try_write(data)
                offset, length = placed
                assert length == len(data) and offset % 8 == 0
                assert offset + length <= prod.capacity  # never split across the end
                live.append((offset, length, data))
            for offset, length, expect in live:
                assert bytes(cons.read(offset, length)) == expect
                cons.release(offset, length)
            assert prod.used() == 0
        finally:
            cons.close()


def test_meta_buffer_full_and_errors(instance: str) -> None:
    with MetaBuffer.create(instance, "meta", 4096) as arena:
        first = arena.write(b"a" * 2048)
        second = arena.write(b"b" * 2040)
        assert arena.try_write(b"c" * 16) is None
        with pytest.raises(ArenaFull, match="no room for 16 bytes"):
            arena.write(b"c" * 16)
        with pytest.raises(ValueError, match=r"payload length must be in \[0, 2048\]"):
            arena.write(b"x" * 2049)
        arena.release(*second)  # frees the older `first` too: its ticket may have been lost
        assert arena.used() == 0
        with pytest.raises(ValueError, match="is not a live payload"):
            arena.release(*first)
        assert arena.write(b"") == (0, 0)
        with pytest.raises(ValueError, match="outside the arena"):
            arena.read(4000, 100)
    with pytest.raises(ValueError, match="capacity must be a multiple of 8"):
        MetaBuffer.create(instance, "meta", 4100)


def test_meta_buffer_numpy_zero_copy(instance: str) -> None:
    with MetaBuffer.create(instance, "meta", 1 << 16) as prod:
        cons = MetaBuffer.attach(instance, "meta")
        try:
            ids = np.arange(100, dtype=np.int64) * 3
            offset, length = prod.write_array(ids)
            view = cons.read_array(offset, length, np.int64)
            np.testing.assert_array_equal(view, ids)
            off2, len2, out = prod.alloc_array(10, np.int32)
            out[:] = np.arange(10, dtype=np.int32)  # filled in place: the consumer sees it
            peer = cons.read_array(off2, len2, np.int32)
            np.testing.assert_array_equal(peer, np.arange(10))
            out[0] = -5
            assert peer[0] == -5  # the same shared memory, not a copy
            with pytest.raises(BufferError, match="still alive"):
                cons.close()
            del view, peer, out
            cons.release(offset, length)
            cons.release(off2, len2)
        finally:
            cons.close()
