"""The GGUF container, read straight from one memory map: the header, the metadata as Python
values, and the tensor table, each tensor's data a view into the map (nothing is copied).

gguf-py's GGUFReader builds a numpy view for every metadata item, which takes 5.8 s for a
49K-token vocabulary and its merges on a 2-core machine; four of `hybridgen serve`'s
processes read the file, so a 135M model spent ~23 s of its start-up on metadata. This
reads the same in 0.25 s. Only the container is read here; gguf_file.py
maps it to a model (its names, shapes and checks). Every length and count is checked against
the bytes left before it is used, so a truncated or corrupt file is a GgufFormatError, never
a huge allocation or a read past the end.
"""

from __future__ import annotations

import functools
import math
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quant_shape_to_byte_shape

from hybridgen.models.errors import ModelLoadError

GGUF_SUFFIX = ".gguf"
MAGIC = b"GGUF"
VERSIONS = (2, 3)
"""The versions this reads (gguf-py's reader reads the same ones)."""
DEFAULT_ALIGNMENT = 32
"""Tensor data starts at a multiple of `general.alignment`, this when the key is absent."""
MAX_DIMS = 4
"""ggml's GGML_MAX_DIMS."""
STRING, ARRAY = 8, 9
"""GGUF value types without a fixed size."""
SCALARS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
"""GGUF value type -> struct format (little-endian) of the fixed-size ones."""
VALUE_DTYPES = {
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}
"""Tensor types read as values; the others (block formats, BF16) as bytes, [..., row bytes],
as gguf-py gives them."""


def is_gguf(model: str) -> bool:
    """Whether `model` names a GGUF file (by its suffix; the file is checked when read)."""
    return model.lower().endswith(GGUF_SUFFIX)


class GgufFormatError(ValueError):
    """The file is not a readable GGUF container (bad magic, version, or a truncated or
    corrupt table)."""


@dataclass(frozen=True)
class RawTensor:
    """One entry of the tensor table."""

    name: str
    qtype: GGMLQuantizationType
    dims: tuple[int, ...]
    """ggml order: the innermost (row) dimension first."""
    data: np.ndarray
    """Values (VALUE_DTYPES) in numpy order, or the block bytes [..., bytes per row]."""


class GgufReader:
    """A GGUF file's metadata (`fields`: key -> value, arrays as lists) and tensors, in the
    order the file lists them."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size == 0:
                raise GgufFormatError("the file is empty")
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._pos = 0
        if self._take(4) != MAGIC:
            raise GgufFormatError("bad magic: not a GGUF file")
        version = self._scalar(4)
        if version not in VERSIONS:
            raise GgufFormatError(f"version {version} is not one of {VERSIONS}")
        tensor_count, kv_count = self._scalar(10), self._scalar(10)
        self._room(kv_count * 12 + tensor_count * 24, "the table counts")
        self.fields: dict[str, Any] = {}
        for _ in range(kv_count):
            key = self._string()
            self.fields[key] = self._value(self._scalar(4))
        table = [self._tensor_info() for _ in range(tensor_count)]
        alignment = self.fields.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0:
            raise GgufFormatError(f"general.alignment {alignment!r} is not a positive integer")
        start = -(-self._pos // alignment) * alignment
        self.tensors: list[RawTensor] = []
        names: set[str] = set()
        for name, dims, qtype, offset in table:
            if name in names:
                raise GgufFormatError(f"tensor '{name}' is listed twice")
            names.add(name)
            self.tensors.append(self._tensor(name, dims, qtype, start + offset))

    def get(self, key: str, default: Any = None, required: bool = False) -> Any:
        """A metadata value (a string, number, or a list for arrays)."""
        if key in self.fields:
            return self.fields[key]
        if required:
            raise ModelLoadError(f"{self.path}: metadata key '{key}' is missing")
        return default

    def _room(self, n: int, what: str) -> None:
        if n < 0 or self._pos + n > len(self._map):
            raise GgufFormatError(
                f"{what} needs {n} bytes at offset {self._pos}, past the end of the file "
                f"({len(self._map)} bytes): truncated or corrupt"
            )

    def _take(self, n: int) -> bytes:
        self._room(n, "a value")
        out = self._map[self._pos : self._pos + n]
        self._pos += n
        return out

    def _scalar(self, kind: int) -> Any:
        fmt = "<" + SCALARS[kind]
        size = struct.calcsize(fmt)
        self._room(size, "a number")
        (value,) = struct.unpack_from(fmt, self._map, self._pos)
        self._pos += size
        return value

    def _string(self) -> str:
        n = self._scalar(10)
        try:
            return self._take(n).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise GgufFormatError(f"a string at offset {self._pos - n} is not UTF-8") from exc

    def _value(self, kind: int) -> Any:
        if kind == STRING:
            return self._string()
        if kind in SCALARS:
            return self._scalar(kind)
        if kind != ARRAY:
            raise GgufFormatError(f"value type {kind} at offset {self._pos - 4} is unknown")
        item, count = self._scalar(4), self._scalar(10)
        if item in SCALARS:
            dtype = np.dtype("<" + SCALARS[item])
            self._room(count * dtype.itemsize, f"an array of {count}")
            values = np.frombuffer(self._map, dtype, count, self._pos)
            self._pos += count * dtype.itemsize
            return values.tolist()
        self._room(count * 8, f"an array of {count}")  # a string or array takes 8 bytes at least
        return [self._value(item) for _ in range(count)]

    def _tensor_info(self) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int]:
        name = self._string()
        n_dims = self._scalar(4)
        if not 1 <= n_dims <= MAX_DIMS:
            raise GgufFormatError(f"tensor '{name}' has {n_dims} dimensions (1-{MAX_DIMS})")
        dims = tuple(self._scalar(10) for _ in range(n_dims))
        code = self._scalar(4)
        try:
            qtype = GGMLQuantizationType(code)
        except ValueError:
            raise GgufFormatError(f"tensor '{name}' has unknown ggml type {code}") from None
        return name, dims, qtype, self._scalar(10)

    def _tensor(
        self, name: str, dims: tuple[int, ...], qtype: GGMLQuantizationType, at: int
    ) -> RawTensor:
        block, block_bytes = GGML_QUANT_SIZES[qtype]
        elements = math.prod(dims)  # exact: garbage dims must not wrap around
        if dims[0] % block:
            raise GgufFormatError(f"tensor '{name}': rows of {dims[0]} are not whole blocks")
        n_bytes = elements // block * block_bytes
        if at + n_bytes > len(self._map):
            raise GgufFormatError(
                f"tensor '{name}' ends at byte {at + n_bytes}, past the end of the file "
                f"({len(self._map)} bytes): truncated"
            )
        shape = tuple(reversed(dims))
        dtype = VALUE_DTYPES.get(qtype)
        if dtype is None:
            flat = np.frombuffer(self._map, np.uint8, n_bytes, at)
            data = flat.reshape(quant_shape_to_byte_shape(shape, qtype))
        else:
            data = np.frombuffer(self._map, dtype, elements, at).reshape(shape)
        return RawTensor(name, qtype, dims, data)


def read_gguf(path: str | Path) -> GgufReader:
    """The GGUF file at `path`, read once per process (the tokenizer, the spec and the weights
    all read it), again only when the file changed. A missing, unreadable, truncated or
    corrupt file is a ModelLoadError that says so."""
    resolved = Path(path).resolve()
    if not resolved.is_file():
        raise ModelLoadError(f"{path}: no such GGUF file")
    stat = resolved.stat()
    try:
        return _read(str(resolved), stat.st_mtime_ns, stat.st_size)
    except (OSError, ValueError, KeyError) as exc:  # GgufFormatError is a ValueError
        raise ModelLoadError(
            f"{path}: not a readable GGUF file ({type(exc).__name__}: {exc}); "
            "the file is truncated or corrupt, download it again"
        ) from None


@functools.lru_cache(maxsize=2)
def _read(path: str, mtime_ns: int, size: int) -> GgufReader:
    del mtime_ns, size  # part of the cache key only: a rewritten file is read again
    return GgufReader(path)
