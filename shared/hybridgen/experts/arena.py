"""Cold-Weights experts in POSIX shared memory, so that the CPU daemon computes with the very
bytes the GPU daemon fetches into its device cache (DESIGN.md "Shared memory": Cold-Weights).

    /hybridgen-<instance>-experts:
        [0, HEADER_BYTES)   JSON, NUL-padded: {"fmt", "dtype", "layers": [
                              {"gate_up": {part: [offset, shape, dtype]}, "down": {...}}]}
        [HEADER_BYTES, ...) every layer's packed tensors, 64-byte aligned, in layout order

The GPU daemon creates the segment at load, sized from the model's shapes and the format,
fills it (presets draw into it, checkpoints are converted into it), registers it as pinned
memory on CUDA and writes the header last: until then it reads empty. The CPU daemon
attaches read-only and views the same tensors. Without an instance (one process: tests,
benchmarks) the stores are ordinary (pinned) host tensors instead.
"""

from __future__ import annotations

import json
import mmap
from typing import Any

import numpy as np
import torch
from torch import Tensor

from hybridgen.experts.format import Format, PackedMatrices
from hybridgen.experts.store import ExpertStore
from hybridgen.ipc import shm
from hybridgen.ipc.host_pin import PORTABLE, register_host
from hybridgen.models.spec import ModelSpec

SEGMENT = "experts"
HEADER_BYTES = 1 << 16
ALIGN = 64
_DTYPES = {
    str(t).removeprefix("torch."): t
    for t in (torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.uint8)
}


def arena_bytes(spec: ModelSpec, fmt: Format, layers: int) -> int:
    """Bytes of `layers` layers of experts in `fmt`, with alignment, plus the header."""
    h, i, e = spec.hidden_size, spec.expert_size, spec.num_local_experts
    per_layer = 0
    for out, in_ in ((2 * i, h), (h, i)):
        for shape, dtype in PackedMatrices.layout(fmt, e, out, in_, spec.dtype).values():
            per_layer += _aligned(int(np.prod(shape)) * dtype.itemsize)
    return HEADER_BYTES + layers * per_layer


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class ExpertArena:
    """The segment, and a bump allocator over it (owner side)."""

    def __init__(self, mm: mmap.mmap, name: str) -> None:
        self.mm, self.name = mm, name
        self._buffer = torch.frombuffer(mm, dtype=torch.uint8)
        self._at = HEADER_BYTES
        self._layers: list[dict[str, dict[str, list[object]]]] = []
        self._registered = False

    @classmethod
    def create(cls, instance: str, nbytes: int) -> ExpertArena:
        name = shm.segment_name(instance, SEGMENT)  # create_segment replaces a stale one
        return cls(shm.create_segment(name, nbytes), name)

    def alloc(self, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        n = int(np.prod(shape)) * dtype.itemsize
        if self._at + n > len(self.mm):
            raise MemoryError(f"expert arena {self.name}: {n} more bytes do not fit")
        t = self._buffer[self._at : self._at + n].view(dtype).view(shape)
        self._at += _aligned(n)
        return t

    def record(self, store: ExpertStore) -> None:
        """Add a store built from this arena's tensors to the header's layout."""
        base = self._buffer.data_ptr()

        def parts(stack: PackedMatrices) -> dict[str, list[object]]:
            return {
                k: [t.data_ptr() - base, list(t.shape), str(t.dtype).removeprefix("torch.")]
                for k, t in stack.parts.items()
            }

        self._layers.append({"gate_up": parts(store.gate_up), "down": parts(store.down)})
        self._fmt, self._dtype = store.fmt, str(store.gate_up.dtype).removeprefix("torch.")

    def publish(self, device: torch.device) -> None:
        """Pin the segment for async copies (CUDA), then write the header: readers may go."""
        if device.type == "cuda":
            register_host(
                self._buffer.data_ptr(),
                len(self.mm),
                PORTABLE,
                f"the expert arena {self.name}",
                "choose a smaller cold_weights.expert_format or raise the memlock limit",
            )
            self._registered = True
        header = {"fmt": self._fmt, "dtype": self._dtype, "layers": self._layers}
        raw = json.dumps(header).encode()
        if len(raw) > HEADER_BYTES:
            raise ValueError(f"expert arena header of {len(raw)} bytes > {HEADER_BYTES}")
        self.mm[: len(raw)] = raw

    @staticmethod
    def attach(instance: str) -> list[ExpertStore]:
        """Reader side: the stores, viewing the segment; FileNotFoundError or ValueError until
        the GPU daemon has published it. The views keep the mapping alive."""
        segment = shm.segment_name(instance, SEGMENT)
        mm = shm.attach_segment(segment)
        raw = bytes(mm[:HEADER_BYTES]).rstrip(b"\0")
        mm.close()
        if not raw:
            raise ValueError("the expert arena is not published yet")
        # Mapped again, every page at once: the first CPU expert of B4a's served 4 streams
        # would otherwise fault in its 94.5 MB (the first read of a page here took twice a
        # read's time on the CI machine), and the latency model learns such slow experts.
        mm = shm.attach_segment(segment, populate=True)
        header = json.loads(raw)
        buffer = torch.frombuffer(mm, dtype=torch.uint8)
        dtype, fmt = _DTYPES[header["dtype"]], header["fmt"]

        def stack(parts: dict[str, list[Any]]) -> PackedMatrices:
            views = {}
            for k, (offset, shape, name) in parts.items():
                t = _DTYPES[name]
                n = int(np.prod(shape)) * t.itemsize
                views[k] = buffer[offset : offset + n].view(t).view(shape)
            return PackedMatrices(fmt, views, dtype)

        return [ExpertStore(stack(la["gate_up"]), stack(la["down"])) for la in header["layers"]]

    def close(self) -> None:
        if self._registered:
            torch.cuda.cudart().cudaHostUnregister(self._buffer.data_ptr())
            self._registered = False
        shm.unlink_segment(self.name)
