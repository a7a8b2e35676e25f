"""Page-locking a range of host shared memory for the device (cudaHostRegister): the Warm
pool (kvtiers/warm_device.py) and the expert arena (experts/arena.py); and faulting a fresh
range in first on many threads (`populate`), which the pin would do on one.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
from concurrent.futures import ThreadPoolExecutor

import torch

PORTABLE, MAPPED = 0x1, 0x2
"""cudaHostRegister flags: pinned for every context; mapped into the device's address space."""
MADV_POPULATE_WRITE = 23
"""madvise advice (Linux 5.14+): fault a range in, writable, without writing it."""
POPULATE_CHUNK = 256 << 20
"""Bytes one thread faults in per call."""


def populate(ptr: int, nbytes: int, threads: int) -> bool:
    """Fault `nbytes` at `ptr` in (shared memory no one has touched yet) with `threads`
    threads, a chunk each at a time: cudaHostRegister faults a fresh range in on the calling
    thread, most of the 11.6-15.5 s that a 32 GB Warm pool took to pin on an H100 host
    (bench/NOTES.md, B6). False where the kernel has no MADV_POPULATE_WRITE (the pin then
    faults the pages in itself); an OSError naming the range where memory runs out."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    start = ptr - ptr % mmap.PAGESIZE
    end = ptr + nbytes

    def one(at: int) -> int:  # ctypes lets go of the GIL: the threads fault in parallel
        if libc.madvise(at, min(POPULATE_CHUNK, end - at), MADV_POPULATE_WRITE) == 0:
            return 0
        return ctypes.get_errno()

    with ThreadPoolExecutor(max(1, threads)) as pool:
        failures = [e for e in pool.map(one, range(start, end, POPULATE_CHUNK)) if e]
    if errno.EINVAL in failures:
        return False
    if failures:
        raise OSError(
            failures[0], f"faulting in {nbytes / 2**20:.0f} MiB: {os.strerror(failures[0])}"
        )
    return True


def register_host(ptr: int, nbytes: int, flags: int, what: str, remedy: str) -> None:
    """Pin `nbytes` at `ptr`; a RuntimeError naming `what` and the `remedy` if CUDA refuses."""
    err = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, flags)
    if int(err) != 0:
        raise RuntimeError(
            f"cudaHostRegister of {what} ({nbytes / 2**20:.0f} MiB) failed with CUDA error "
            f"{int(err)}; {remedy}"
        )
