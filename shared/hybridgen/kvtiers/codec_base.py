"""What every KV codec shares: the block geometry, the `Codec` protocol and the record layout.

A codec turns one KV block of one layer (K and V, each `[block_size, num_kv_heads, head_dim]`)
into one fixed-size uint8 record, so that a Warm-KV pool can hand out equal slots. A record
is a sequence of fields; each field starts on a 16-byte boundary and the record is padded to
16 bytes, so that every field can be viewed in place (no copy) and slots stay aligned for DMA::

    | field 0 | pad | field 1 | pad | ... | field n-1 | pad |   record_bytes % 16 == 0

Bytes are the device's native order (little-endian on x86, ARM and CUDA alike).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import ClassVar, Protocol

import torch
from torch import Tensor

ALIGN = 16
"""Byte alignment of every field and of the record size."""


@dataclass(frozen=True)
class BlockSpec:
    """Geometry and dtype of one KV block of one layer (the engine's cache layout)."""

    block_size: int
    """Tokens per block (S)."""
    num_kv_heads: int
    """KV heads (H)."""
    head_dim: int
    """Channels per head (D)."""
    dtype: torch.dtype
    """The model dtype the cache holds: bf16 on the GPU, fp32 in CPU tests."""

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def fp16_bytes(self) -> int:
        """K and V of one block in fp16: the reference that `ratio_vs_fp16` divides."""
        return 2 * 2 * math.prod(self.shape)


@dataclass(frozen=True)
class Field:
    """One named array inside a record; `shape` excludes the block axis."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _round_up(n: int, align: int = ALIGN) -> int:
    return -(-n // align) * align


@dataclass(frozen=True)
class RecordLayout:
    """Fields at fixed, aligned offsets; `pack`/`unpack` work on many records at once."""

    fields: tuple[Field, ...]

    @cached_property
    def offsets(self) -> tuple[int, ...]:
        out, at = [], 0
        for f in self.fields:
            out.append(at)
            at = _round_up(at + f.nbytes)
        return tuple(out)

    @property
    def record_bytes(self) -> int:
        return self.offsets[-1] + _round_up(self.fields[-1].nbytes)

    def pack(self, parts: Sequence[Tensor]) -> Tensor:
        """parts[i]: [N, *fields[i].shape] of fields[i].dtype -> records [N, record_bytes]."""
        n = parts[0].shape[0]
        chunks = []
        for f, t in zip(self.fields, parts, strict=True):
            assert t.dtype == f.dtype and tuple(t.shape[1:]) == f.shape, (f, t.dtype, t.shape)
            chunks.append(t.contiguous().view(torch.uint8).reshape(n, f.nbytes))
            pad = _round_up(f.nbytes) - f.nbytes
            if pad:
                chunks.append(t.new_zeros((n, pad), dtype=torch.uint8))
        return torch.cat(chunks, dim=1)

    def unpack(self, records: Tensor) -> list[Tensor]:
        """records: [N, record_bytes] uint8 -> views [N, *shape] per field (no copy)."""
        records = records.contiguous()
        n = records.shape[0]
        return [
            records[:, at : at + f.nbytes].view(f.dtype).reshape(n, *f.shape)
            for f, at in zip(self.fields, self.offsets, strict=True)
        ]


class Codec(Protocol):
    """A fixed-size KV block codec; the registry in `codecs.py` builds them by name."""

    @property
    def name(self) -> str: ...

    @property
    def spec(self) -> BlockSpec: ...

    @property
    def record_bytes(self) -> int: ...

    @property
    def ratio_vs_fp16(self) -> float: ...

    def encode(self, k: Tensor, v: Tensor) -> Tensor: ...

    def decode(self, record: Tensor, dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]: ...

    def encode_blocks(self, k: Tensor, v: Tensor) -> Tensor: ...

    def decode_blocks(
        self, records: Tensor, dtype: torch.dtype | None = None
    ) -> tuple[Tensor, Tensor]: ...


class BlockCodec(ABC):
    """Checks shapes once and derives the single-block calls from the batched ones.

    Invariant: `encode(k, v) == encode_blocks(k[None], v[None])[0]` byte for byte, and the
    math never mixes blocks, so a record depends only on its own block.
    """

    name: ClassVar[str]
    spec: BlockSpec

    @property
    @abstractmethod
    def record_bytes(self) -> int: ...

    @property
    def ratio_vs_fp16(self) -> float:
        return self.spec.fp16_bytes / self.record_bytes

    @abstractmethod
    def _encode(self, k: Tensor, v: Tensor) -> Tensor: ...

    @abstractmethod
    def _decode(self, records: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]: ...

    def encode(self, k: Tensor, v: Tensor) -> Tensor:
        """k, v: [S, H, D] -> record [record_bytes] uint8 on the same device."""
        return self.encode_blocks(k.unsqueeze(0), v.unsqueeze(0))[0]

    def decode(self, record: Tensor, dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
        """record: [record_bytes] uint8 -> k, v: [S, H, D] in `dtype` (default: the spec's)."""
        k, v = self.decode_blocks(record.unsqueeze(0), dtype)
        return k[0], v[0]

    def encode_blocks(self, k: Tensor, v: Tensor) -> Tensor:
        """k, v: [N, S, H, D] -> records [N, record_bytes] uint8 on the same device."""
        want = self.spec.shape
        for name, t in (("k", k), ("v", v)):
            if t.dim() != 4 or tuple(t.shape[1:]) != want or t.dtype != self.spec.dtype:
                raise ValueError(
                    f"{self.name} codec: {name} is {t.dtype} {list(t.shape)}, expected "
                    f"{self.spec.dtype} [N, {', '.join(map(str, want))}] (block_size, "
                    "num_kv_heads, head_dim of the codec)"
                )
        if k.shape != v.shape or k.device != v.device:
            raise ValueError(
                f"{self.name} codec: k {k.shape} on {k.device}, v {v.shape} on "
                f"{v.device}; they must match"
            )
        return self._encode(k, v)

    def decode_blocks(
        self, records: Tensor, dtype: torch.dtype | None = None
    ) -> tuple[Tensor, Tensor]:
        """records: [N, record_bytes] uint8 -> k, v: [N, S, H, D] in `dtype`."""
        shape_ok = records.dim() == 2 and records.shape[1] == self.record_bytes
        if not shape_ok or records.dtype != torch.uint8:
            raise ValueError(
                f"{self.name} codec: records are {records.dtype} {list(records.shape)}, "
                f"expected uint8 [N, {self.record_bytes}]"
            )
        return self._decode(records, dtype or self.spec.dtype)
