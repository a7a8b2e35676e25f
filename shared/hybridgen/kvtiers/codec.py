"""KV-cache codecs: one KV block of one layer <-> one fixed-size uint8 record.

Names follow `kv_cache.warm_codec`: lossless, lz4 (exact), int8 (1.88:1 against fp16 with
group 32 and fp16 scales), int4 (KIVI-style: 2.91:1 at block_size 16, 3.37:1 at 64, counting
scales and zeros).
"""

from __future__ import annotations

from hybridgen.kvtiers.codec_base import BlockCodec, BlockSpec, Codec, Field, RecordLayout
from hybridgen.kvtiers.codecs import (
    CODECS,
    CorruptRecord,
    LosslessCodec,
    Lz4Codec,
    get_codec,
)
from hybridgen.kvtiers.quant import Int4Codec, Int8Codec

__all__ = [
    "CODECS",
    "BlockCodec",
    "BlockSpec",
    "Codec",
    "CorruptRecord",
    "Field",
    "Int4Codec",
    "Int8Codec",
    "LosslessCodec",
    "Lz4Codec",
    "RecordLayout",
    "get_codec",
]
