"""Warm-KV pool: fixed-size compressed KV blocks in host shared memory (its prefix index is
in prefix_index.py).

One slot holds one token block of KV across all layers, each layer encoded by the warm codec
into one `record_bytes` record. The GPU daemon owns the pool (creates it, allocates, writes),
as it creates all shared memory (DESIGN.md); the CPU daemon attaches and reads, for its Warm
attention (kvtiers/warm_link.py). Segment ``/hybridgen-<instance>-warm``::

    offset  size                   field
    ------  ---------------------  ------------------------------------------------------
         0  8                      magic b"HGWARM01" (written last by create)
         8  4                      layout version (WARM_VERSION)
        12  4                      num_layers (L)
        16  8                      slot_bytes = L * record_bytes
        24  8                      capacity (slots)
        32  8                      record_bytes (one layer's record)
        40  4 x 4                  block_size, num_kv_heads, head_dim, group_size (0: none)
        56  16                     model dtype name, ascii, NUL padded ("bfloat16")
        72  16                     scale dtype name ("" when the codec has none)
        88  16                     codec name ("lossless", "lz4", "int8", "int4")
       104  4                      owner pid
       108  4                      flags: bit 0 int4 keys grouped per token (Int4Codec
                                   per_token_keys: an int4 Hot cache's Warm tier)
       112  8                      epoch (time.time_ns() at create)
      4096  capacity * slot_bytes  slots; slot i at 4096 + i * slot_bytes, and layer l of
                                   it at + l * record_bytes

Slots start page aligned and records are 16-byte multiples, so every record is 16-aligned
for a zero-copy view or a DMA of the compressed bytes.

Invariants:

* The header is written once, before the magic; an attacher that sees the magic sees a
  complete header. Nothing in the segment changes afterwards except slot bytes, and only
  the owner writes them. So there are no shared counters to tear.
* Allocation state (free list and refcounts) lives in the owner process only. A slot is
  either free or has refcount >= 1, never both; it is rewritten only after `alloc` hands it
  out again. A reader learns which slots to read from a ticket, and the owner keeps its own
  reference until the reader's reply, so a slot never changes under a reader.
* The owner (one thread) serializes every call; nothing here is thread-safe.
"""

from __future__ import annotations

import mmap
import os
import struct
import time
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from torch import Tensor

from hybridgen.ipc import shm
from hybridgen.kvtiers.codec_base import Codec
from hybridgen.kvtiers.codecs import get_codec

MAGIC = b"HGWARM01"
WARM_VERSION = 2
HEADER_SIZE = 4096
SEGMENT = "warm"
CONFIG_KEY = "kv_cache.warm_region_mb"

_FIXED = struct.Struct("<8sIIQQQIIII16s16s16sIIQ")


class WarmPoolFull(Exception):
    """Not enough free slots; the fix is a larger `kv_cache.warm_region_mb` (or eviction)."""


def _name16(text: str) -> bytes:
    raw = text.encode("ascii")
    if len(raw) > 16:
        raise ValueError(f"{text!r} does not fit a 16-byte header field")
    return raw


def _text(raw: bytes) -> str:
    return raw.rstrip(b"\0").decode("ascii")


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"header dtype {name!r} is not a torch dtype")
    return dtype


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def slot_bytes_for(codec: Codec, num_layers: int) -> int:
    """Bytes of one slot: one record per layer."""
    return codec.record_bytes * num_layers


def capacity_for(warm_region_mb: float, codec: Codec, num_layers: int) -> int:
    """Slots that fit `warm_region_mb` MiB of shm, header included (0 MiB: no Warm tier)."""
    if warm_region_mb < 0 or num_layers <= 0:
        raise ValueError(
            f"{CONFIG_KEY}={warm_region_mb} and num_layers={num_layers} must be >= 0 and > 0"
        )
    budget = int(warm_region_mb * 2**20) - HEADER_SIZE
    return max(0, budget // slot_bytes_for(codec, num_layers))


class WarmPool:
    """The Warm-KV shm pool. `create` on the owner (the GPU daemon), `attach` on readers.

    Data calls (`load`, `record_view`) work on both sides; `alloc`, `free`, `share` and
    `store` only on the owner.
    """

    def __init__(self, mm: mmap.mmap, instance: str, owner: bool) -> None:
        """Wrap an initialised mapping; use `create` / `attach` instead of calling this."""
        seg = shm.segment_name(instance, SEGMENT)
        fields = _FIXED.unpack_from(mm)
        magic, version, layers, slot_bytes, capacity, record_bytes = fields[:6]
        if magic != MAGIC:
            raise ValueError(f"{seg}: magic {magic!r} is not {MAGIC!r} (not a Warm-KV pool)")
        if version != WARM_VERSION:
            raise ValueError(f"{seg}: layout version {version}, this code speaks {WARM_VERSION}")
        if len(mm) < HEADER_SIZE + capacity * slot_bytes:
            raise ValueError(f"{seg}: {capacity} slots of {slot_bytes} B exceed {len(mm)} B")
        block_size, heads, head_dim, group = fields[6:10]
        dtype, scale, name = (_text(f) for f in fields[10:13])
        options: dict[str, Any] = {}
        if group:
            options = {"group_size": group, "scale_dtype": _dtype(scale)}
        if fields[14] & 1:
            options["per_token_keys"] = True
        self.codec: Codec = get_codec(name, block_size, heads, head_dim, _dtype(dtype), **options)
        if self.codec.record_bytes != record_bytes or slot_bytes != layers * record_bytes:
            raise ValueError(f"{seg}: header geometry does not match codec {name}")
        self.instance, self.owner = instance, owner
        self.num_layers: int = layers
        self.record_bytes: int = record_bytes
        self.slot_bytes: int = slot_bytes
        self.capacity: int = capacity
        self.epoch: int = fields[15]
        self._mm = mm
        # [capacity, L, record_bytes] view of the slot area.
        self._slots: npt.NDArray[np.uint8] | None = np.frombuffer(
            mm, dtype=np.uint8, count=capacity * slot_bytes, offset=HEADER_SIZE
        ).reshape(capacity, layers, record_bytes)
        # Owner-only allocation state; popping from the end hands out low slots first.
        self._free: list[int] = list(range(capacity - 1, -1, -1)) if owner else []
        self._refs: list[int] = [0] * capacity if owner else []

    @classmethod
    def create(cls, instance: str, codec: Codec, num_layers: int, capacity: int) -> WarmPool:
        """Owner side: replace any stale pool of this instance with an empty one."""
        if num_layers <= 0 or capacity < 0:
            raise ValueError(f"num_layers={num_layers} must be > 0, capacity={capacity} >= 0")
        spec = codec.spec
        group = int(getattr(codec, "group_size", 0))
        scale = getattr(codec, "scale_dtype", None)
        options: dict[str, Any] = {}
        if group:
            options = {"group_size": group, "scale_dtype": scale}
        per_token_keys = bool(getattr(codec, "per_token_keys", False))
        if per_token_keys:
            options["per_token_keys"] = True
        rebuilt = get_codec(codec.name, *spec.shape, spec.dtype, **options)
        if rebuilt != codec:  # attach rebuilds the codec from the header alone
            raise ValueError(f"codec {codec!r} cannot be described by the Warm pool header")
        slot_bytes = slot_bytes_for(codec, num_layers)
        seg = shm.segment_name(instance, SEGMENT)
        mm = shm.create_segment(seg, HEADER_SIZE + capacity * slot_bytes)
        fixed = (
            *(num_layers, slot_bytes, capacity, codec.record_bytes),
            *(*spec.shape, group),
            _name16(_dtype_name(spec.dtype)),
            _name16(_dtype_name(scale) if scale is not None else ""),
            _name16(codec.name),
            *(os.getpid(), int(per_token_keys), time.time_ns()),
        )
        _FIXED.pack_into(mm, 0, b"\0" * 8, WARM_VERSION, *fixed)
        mm[0:8] = MAGIC  # last: an attacher that sees the magic sees a complete header
        return cls(mm, instance, owner=True)

    @classmethod
    def attach(cls, instance: str, wait: float = 0.0) -> WarmPool:
        """Reader side: map the pool, retrying up to `wait` seconds until the owner made it."""
        seg = shm.segment_name(instance, SEGMENT)
        deadline = time.monotonic() + wait
        while True:
            try:
                mm = shm.attach_segment(seg)
                try:
                    return cls(mm, instance, owner=False)
                except ValueError:
                    mm.close()
                    raise
            except (FileNotFoundError, ValueError):
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.01)

    def close(self) -> None:
        """Unmap. Views from `record_view` must be dropped first (else BufferError)."""
        self._slots = None
        self._mm.close()

    def unlink(self) -> None:
        """Owner: remove the segment name; mappings stay valid until closed."""
        shm.unlink_segment(shm.segment_name(self.instance, SEGMENT))

    def __enter__(self) -> WarmPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
        if self.owner:
            self.unlink()

    # ---- owner: allocation -----------------------------------------------------------------

    def _owner_only(self, what: str) -> None:
        if not self.owner:
            raise RuntimeError(f"WarmPool.{what} is owner-only; this process attached")

    @property
    def num_free(self) -> int:
        return len(self._free)

    def refcount(self, slot: int) -> int:
        self._owner_only("refcount")
        return self._refs[self._index(slot)]

    def alloc(self, n: int) -> list[int]:
        """n fresh slots with refcount 1, all or nothing (WarmPoolFull when short)."""
        self._owner_only("alloc")
        if n < 0:
            raise ValueError(f"cannot allocate {n} slots")
        if n > len(self._free):
            raise WarmPoolFull(
                f"Warm-KV pool full: need {n} slots, {len(self._free)} free of {self.capacity} "
                f"({self.slot_bytes} B each); raise {CONFIG_KEY}"
            )
        slots = [self._free.pop() for _ in range(n)]
        for s in slots:
            self._refs[s] = 1
        return slots

    def share(self, slots: Iterable[int]) -> None:
        """One more reference to each live slot (prefix sharing); checks all before changing."""
        self._owner_only("share")
        slots = [self._index(s) for s in slots]
        dead = [s for s in slots if self._refs[s] == 0]
        if dead:
            raise ValueError(f"cannot share free slots {dead}")
        for s in slots:
            self._refs[s] += 1

    def free(self, slots: Iterable[int]) -> None:
        """Drop one reference to each slot; a slot returns to the free list at zero.

        All or nothing: a slot named more often than it has references raises and changes
        nothing, so a double free is caught instead of handing the slot out twice.
        """
        self._owner_only("free")
        slots = [self._index(s) for s in slots]
        counts: dict[int, int] = {}
        for s in slots:
            counts[s] = counts.get(s, 0) + 1
        over = sorted(s for s, c in counts.items() if c > self._refs[s])
        if over:
            raise ValueError(f"double free of slots {over}")
        for s in slots:
            self._refs[s] -= 1
            if self._refs[s] == 0:
                self._free.append(s)

    def _index(self, slot: int) -> int:
        if not 0 <= slot < self.capacity:
            raise IndexError(f"slot {slot} outside [0, {self.capacity})")
        return int(slot)

    # ---- data ------------------------------------------------------------------------------

    def _view(self) -> npt.NDArray[np.uint8]:
        if self._slots is None:
            raise ValueError("WarmPool is closed")
        return self._slots

    def store(self, slot: int, k_layers: Tensor, v_layers: Tensor) -> None:
        """Owner: encode one block of every layer into `slot`.

        k_layers, v_layers: [L, S, H, D] in the codec's dtype, on any device. The codec
        treats the L layers as L blocks, which is exact: a record depends only on its block.
        """
        self._owner_only("store")
        if self._refs[self._index(slot)] == 0:
            raise ValueError(f"slot {slot} is free; alloc it before storing")
        if k_layers.dim() != 4 or k_layers.shape[0] != self.num_layers:
            raise ValueError(
                f"k_layers is {list(k_layers.shape)}, expected [{self.num_layers}, S, H, D]"
            )
        records = self.codec.encode_blocks(k_layers, v_layers)  # [L, record_bytes]
        self._view()[slot] = records.cpu().numpy()

    def _held(self, what: str, slots: Sequence[int]) -> list[int]:
        """Owner: `slots` as checked indices, every one allocated (a store's precondition)."""
        self._owner_only(what)
        index = [self._index(s) for s in slots]
        if any(self._refs[i] == 0 for i in index):
            raise ValueError("a slot is free; alloc it before storing")
        return index

    def store_many(self, slots: Sequence[int], k_blocks: Tensor, v_blocks: Tensor) -> None:
        """Owner: `store` for several slots at once, one encode and one copy out of the
        device: k_blocks, v_blocks [len(slots), L, S, H, D]."""
        index = self._held("store_many", slots)
        n, layers = len(index), self.num_layers
        if k_blocks.dim() != 5 or tuple(k_blocks.shape[:2]) != (n, layers):
            raise ValueError(
                f"k_blocks is {list(k_blocks.shape)}, expected [{n}, {layers}, S, H, D]"
            )
        records = self.codec.encode_blocks(k_blocks.flatten(0, 1), v_blocks.flatten(0, 1))
        # Straight into shm, which on CUDA is one DMA at pinned speed where the pool is
        # registered (a .cpu() first went through pageable memory at a seventh of it).
        self.store_records(slots, records.view(n, layers, -1))

    def store_records(self, slots: Sequence[int], records: Tensor) -> None:
        """Owner: write records already in the codec's layout (an int8 / int4 Hot cache's
        blocks, whose fields are the records') into `slots`: records [len(slots), L,
        record_bytes] uint8, on any device."""
        index = self._held("store_records", slots)
        shape = (len(index), self.num_layers, self.record_bytes)
        if tuple(records.shape) != shape or records.dtype != torch.uint8:
            raise ValueError(
                f"records are {list(records.shape)} {records.dtype}, expected {list(shape)} uint8"
            )
        # Each run of consecutive slots is one copy straight into shm: from a device, one
        # DMA where the pool is registered as pinned memory (gpu_daemon.warm_device).
        area = torch.from_numpy(self._view())
        start = 0
        for end in range(1, len(index) + 1):
            if end == len(index) or index[end] != index[end - 1] + 1:
                area[index[start] : index[start] + end - start].copy_(records[start:end])
                start = end

    def load(self, slot: int, dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
        """Decode `slot` -> k, v: [L, S, H, D] in `dtype` (default: the codec's), on the CPU."""
        # Copy the compressed bytes first: the result never aliases the shared slot, and the
        # copy is small next to the decoded tensors.
        records = torch.from_numpy(self._view()[self._index(slot)].copy())  # [L, record_bytes]
        return self.codec.decode_blocks(records, dtype)

    def store_raw(self, slot: int, data: bytes) -> None:
        """Owner: put back the exact bytes of a slot (all layers) read from it earlier."""
        self._owner_only("store_raw")
        if self._refs[self._index(slot)] == 0:
            raise ValueError(f"slot {slot} is free; alloc it before storing")
        if len(data) != self.slot_bytes:
            raise ValueError(f"{len(data)} bytes for a {self.slot_bytes}-byte slot")
        self._view()[slot] = np.frombuffer(data, dtype=np.uint8).reshape(self._view()[slot].shape)

    def slot_area(self) -> npt.NDArray[np.uint8]:
        """Zero-copy [capacity, L, record_bytes] view of every slot (for in-place device reads,
        gpu_daemon.warm_device). It aliases shared memory and must be dropped before `close`."""
        return self._view()

    def record_view(self, slot: int) -> npt.NDArray[np.uint8]:
        """Zero-copy [L, record_bytes] uint8 view of `slot` (e.g. for a pinned PCIe copy).

        It aliases shared memory: valid only while the slot is referenced, and it must be
        dropped before `close`.
        """
        return self._view()[self._index(slot)]
