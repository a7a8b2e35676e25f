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
