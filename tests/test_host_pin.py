"""Faulting a fresh range of shared memory in on many threads before it is pinned
(ipc/host_pin.populate; the Warm pool's cudaHostRegister on CUDA): every page of it resident
afterwards, none before; a kernel without the advice says so instead of failing."""

from __future__ import annotations

import ctypes
import errno
import mmap
import uuid
from collections.abc import Iterator

import pytest

from hybridgen.ipc import host_pin, shm

SIZE = 48 << 20  # not a multiple of the chunk: the last one is short


@pytest.fixture
def segment() -> Iterator[tuple[mmap.mmap, int]]:
    name = f"/hg-pin-{uuid.uuid4().hex[:8]}"
    mm = shm.create_segment(name, SIZE)
    try:
        yield mm, ctypes.addressof(ctypes.c_char.from_buffer(mm))
    finally:
        mm.close()
        shm.unlink_segment(name)


def resident_pages(ptr: int, nbytes: int) -> int:
    """Pages of the range in memory (mincore)."""
    libc = ctypes.CDLL(None, use_errno=True)
    pages = -(-nbytes // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * pages)()
    assert libc.mincore(ctypes.c_void_p(ptr), ctypes.c_size_t(nbytes), vec) == 0
    return sum(b & 1 for b in vec)


def test_populate_faults_every_page_in(
    segment: tuple[mmap.mmap, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    mm, ptr = segment
    monkeypatch.setattr(host_pin, "POPULATE_CHUNK", 16 << 20)  # three threads' worth
    assert resident_pages(ptr, SIZE) == 0  # a fresh segment holds no page yet
    assert host_pin.populate(ptr, SIZE, threads=3)
    assert resident_pages(ptr, SIZE) == SIZE // mmap.PAGESIZE
    assert mm[:8] == bytes(8) and mm[-8:] == bytes(8)  # still zeroes: nothing was written


def test_a_kernel_without_the_advice_is_told_apart(
    segment: tuple[mmap.mmap, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, ptr = segment
    monkeypatch.setattr(host_pin, "MADV_POPULATE_WRITE", 9999)  # unknown advice: EINVAL
    assert host_pin.populate(ptr, SIZE, threads=2) is False
    assert resident_pages(ptr, SIZE) == 0


def test_a_range_that_cannot_be_faulted_in_raises() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int)
    libc.mmap.argtypes += (ctypes.c_int, ctypes.c_long)
    libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    # 2 MiB mapped, the second half unmapped again: that half is no memory (ENOMEM).
    rw, flags = mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    ptr = libc.mmap(None, 2 << 20, rw, flags, -1, 0)
    libc.munmap(ptr + (1 << 20), 1 << 20)
    try:
        with pytest.raises(OSError) as failed:
            host_pin.populate(ptr, 2 << 20, threads=1)
        assert failed.value.errno == errno.ENOMEM and "faulting in 2 MiB" in str(failed.value)
    finally:
        libc.munmap(ptr, 1 << 20)
