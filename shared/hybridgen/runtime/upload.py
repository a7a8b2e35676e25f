"""Host tensors to the device without waiting for it.

A copy from pageable host memory waits for every kernel queued before it on the stream, so
an index table or a step's inputs made while a forward pass is queued would hold the host
until the device caught up. Through pinned memory the copy is a true asynchronous DMA (the
caching host allocator keeps the buffer until its copy has run).
"""

from __future__ import annotations

import torch
from torch import Tensor


def upload(host: Tensor, device: torch.device) -> Tensor:
    """`host` on `device`: pinned and asynchronous to a CUDA device, a plain copy elsewhere."""
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def upload_into(dst: Tensor, host: Tensor) -> None:
    """`host` copied into `dst` (same shape) as upload() copies: pinned and asynchronous to a
    CUDA device, a plain copy elsewhere."""
    if dst.device.type == "cuda":
        dst.copy_(host.pin_memory(), non_blocking=True)
    else:
        dst.copy_(host)
