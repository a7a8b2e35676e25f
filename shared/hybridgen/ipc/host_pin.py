"""Page-locking a range of host shared memory for the device (cudaHostRegister): the Warm
pool (kvtiers/warm_device.py) and the expert arena (experts/arena.py)."""

from __future__ import annotations

import torch

PORTABLE, MAPPED = 0x1, 0x2
"""cudaHostRegister flags: pinned for every context; mapped into the device's address space."""


def register_host(ptr: int, nbytes: int, flags: int, what: str, remedy: str) -> None:
    """Pin `nbytes` at `ptr`; a RuntimeError naming `what` and the `remedy` if CUDA refuses."""
    err = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, flags)
    if int(err) != 0:
        raise RuntimeError(
            f"cudaHostRegister of {what} ({nbytes / 2**20:.0f} MiB) failed with CUDA error "
            f"{int(err)}; {remedy}"
        )
