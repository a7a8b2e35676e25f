"""The exact codecs (lossless, lz4) and the registry that builds any codec by name.

`get_codec(name, block_size, num_kv_heads, head_dim, dtype)` serves `kv_cache.warm_codec`
(and `kv_cache.hot_codec` for int8/int4); `Lz4Codec(inner)` also wraps a lossy codec, which is
how the Cold tier puts lz4 on top of the warm codec.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import ClassVar

import lz4.block
import numpy as np
import torch
from torch import Tensor

from hybridgen.kvtiers.codec_base import BlockCodec, BlockSpec, Codec, Field, RecordLayout
from hybridgen.kvtiers.quant import Int4Codec, Int8Codec

HEADER_BYTES = 16
"""The lz4 record header: u32 stored length, then zeros up to the field alignment."""


class CorruptRecord(ValueError):
    """A record whose header cannot be right (a torn or foreign slot)."""


@dataclass(frozen=True)
class LosslessCodec(BlockCodec):
    """The raw bytes of K then V, exact for every bit pattern (NaN payloads and -0.0 too).

    Record, per block (each field 16-aligned)::

        k  dtype [S, H, D]
        v  dtype [S, H, D]
    """

    name: ClassVar[str] = "lossless"
    spec: BlockSpec

    @cached_property
    def layout(self) -> RecordLayout:
        return RecordLayout(
            (
                Field("k", self.spec.dtype, self.spec.shape),
                Field("v", self.spec.dtype, self.spec.shape),
            )
        )

    @property
    def record_bytes(self) -> int:
        return self.layout.record_bytes

    def _encode(self, k: Tensor, v: Tensor) -> Tensor:
        return self.layout.pack((k, v))

    def _decode(self, records: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        k, v = self.layout.unpack(records)
        # Copies: the views alias the record, whose Warm slot is reused once it is decoded.
        return k.to(dtype, copy=True), v.to(dtype, copy=True)


@dataclass(frozen=True)
class Lz4Codec(BlockCodec):
    """lz4.block over the records of an inner codec, in a slot of the inner record's size.

    A payload that lz4 cannot shrink is stored raw, so the worst case is the inner record plus
    the header (below LZ4_COMPRESSBOUND) and decoding it is a copy. Record::

        offset  size         field
        0       4            stored length m, u32 little-endian; m == inner bytes: raw
        4       12           zeros
        16      inner bytes  payload (lz4 block without size prefix, or raw), zero padded

    lz4 runs on the host: records of device tensors go through host memory and come back to
    the input's device.
    """

    name: ClassVar[str] = "lz4"
    inner: Codec
    """The codec whose records are compressed: lossless for `lz4`, the warm codec for Cold."""

    @property
    def spec(self) -> BlockSpec:  # type: ignore[override]
        return self.inner.spec

    @property
    def record_bytes(self) -> int:
        """The fixed slot: the worst case of any block."""
        return HEADER_BYTES + self.inner.record_bytes

    def _encode(self, k: Tensor, v: Tensor) -> Tensor:
        inner = self.inner.encode_blocks(k, v).cpu().numpy()  # [N, inner bytes]
        n = inner.shape[1]
        out = np.zeros((inner.shape[0], self.record_bytes), dtype=np.uint8)
        for row, raw in zip(out, inner, strict=True):
            packed = lz4.block.compress(raw, store_size=False)
            payload = packed if len(packed) < n else raw.tobytes()
            row[:4] = np.frombuffer(len(payload).to_bytes(4, "little"), dtype=np.uint8)
            row[HEADER_BYTES : HEADER_BYTES + len(payload)] = np.frombuffer(payload, np.uint8)
        return torch.from_numpy(out).to(k.device)

    def _decode(self, records: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        n = self.inner.record_bytes
        sizes = self.stored_bytes(records)
        inner = np.empty((records.shape[0], n), dtype=np.uint8)
        for out, row, size in zip(inner, records.cpu().numpy(), sizes, strict=True):
            payload = row[HEADER_BYTES : HEADER_BYTES + size]
            if size < n:
                payload = np.frombuffer(
                    lz4.block.decompress(payload, uncompressed_size=n), np.uint8
                )
            out[:] = payload
        return self.inner.decode_blocks(torch.from_numpy(inner).to(records.device), dtype)

    def stored_bytes(self, records: Tensor) -> list[int]:
        """records: [N, record_bytes] -> the payload bytes each one uses (for Cold accounting)."""
        heads = records[:, :4].cpu().numpy()
        sizes = [int.from_bytes(h.tobytes(), "little") for h in heads]
        bad = [s for s in sizes if not 0 < s <= self.inner.record_bytes]
        if bad:
            raise CorruptRecord(
                f"lz4 record stores {bad[0]} bytes; a valid one stores 1..{self.inner.record_bytes}"
            )
        return sizes


def _lz4(spec: BlockSpec, **options: object) -> BlockCodec:
    if options:
        raise ValueError(f"lz4 codec: takes no options, got {sorted(options)}")
    return Lz4Codec(LosslessCodec(spec))


CODECS: dict[str, Callable[..., BlockCodec]] = {
    "lossless": LosslessCodec,
    "lz4": _lz4,
    "int8": Int8Codec,
    "int4": Int4Codec,
}
"""Codec names, as `kv_cache.warm_codec` spells them, and their constructors."""


def get_codec(
    name: str,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    *,
    key: str = "kv_cache.warm_codec",
    **options: object,
) -> Codec:
    """The codec `name` for one layer's KV blocks; `options` go to int8/int4 (group_size,
    scale_dtype). `key` names the config key in the error for an unknown name."""
    make = CODECS.get(name)
    if make is None:
        raise ValueError(f"{key}={name!r} is not a KV codec; allowed: {', '.join(CODECS)}")
    return make(BlockSpec(block_size, num_kv_heads, head_dim, dtype), **options)
