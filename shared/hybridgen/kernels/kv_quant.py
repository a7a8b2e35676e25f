"""Compressed Hot-KV: the int8 / int4 layout of one layer's paged GPU cache, and its torch math.

`kv_cache.hot_codec` picks how the GPU's paged KV cache is stored: `native` (the model dtype,
k_cache / v_cache [N, S, Hkv, D]), `int8` or `int4`. A quantized cache keeps the native paging:
every tensor is indexed [block, offset, kv head, ...], so block tables and slot mappings
address it exactly as they address a native cache. Groups are `g` consecutive channels of one
token and head (g divides D, default 32); both K and V are quantized per token, because a
streaming cache writes one token at a time and a per-channel (KIVI) key scale would change
under the tokens already written.

    int8, symmetric: x ~= code * scale, scale = amax(|group|) / 127, code in [-127, 127]
        k, v              int8        [N, S, Hkv, D]
        k_scale, v_scale  scale_dtype [N, S, Hkv, D/g]

    int4, asymmetric: x ~= code * scale + zero, zero = min(group), scale = (max - zero) / 15
        k, v              uint8       [N, S, Hkv, D/2]   channel 2i low nibble, 2i+1 high
        k_scale, v_scale  scale_dtype [N, S, Hkv, D/g]
        k_zero, v_zero    scale_dtype [N, S, Hkv, D/g]

Bytes per token and layer (K and V) = 2 * Hkv * (D * bits / 8 + (D / g) * n_meta * scale
bytes), n_meta = 1 (int8) or 2 (int4). Against bf16 (2 * Hkv * 2D bytes), D = 128, fp16
scales:

    codec  g     bytes per token and head (K or V)   ratio vs bf16
    int8   32    128 + 4 * 2     = 136                1.88 : 1
    int8   128   128 + 1 * 2     = 130                1.97 : 1
    int4   32     64 + 4 * 2 * 2 =  80                3.20 : 1
    int4   128    64 + 1 * 2 * 2 =  68                3.76 : 1

The quantization math is kvcodec.quant's (exactly specified rounding, identical on CPU and
GPU). With the default g = 32 and fp16 scales, an int8 hot block holds exactly the fields of a
Warm-KV `Int8Codec` record (k_codes, v_codes, k_scale, v_scale, each [S, Hkv, ...]), so hot to
warm migration is a byte copy with no requantization. Warm int4 quantizes keys per channel
(KIVI), so int4 hot blocks are dequantized and re-encoded on migration.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from hybridgen.kvtiers.quant import (
    check_group,
    check_scale_dtype,
    dequantize_asym_u4,
    dequantize_sym_int8,
    pack_u4,
    quantize_asym_u4,
    quantize_sym_int8,
    unpack_u4,
)

HotCodec = Literal["native", "int8", "int4"]
DEFAULT_GROUP = 32
"""Channels per scale; Warm-KV's default too, so int8 hot blocks migrate as a byte copy."""


@dataclass(frozen=True)
class QuantKvCache:
    """One layer's quantized Hot-KV (layout in the module docstring), or a view of the Warm
    pool's records (kvtiers/warm_device.py), whose int4 keys have one scale and zero per
    block and channel: k_scale [N, S, Hkv, D] with stride 0 along S, a key group of 1.

    Invariants (checked): K's scale and zero share one shape and strides, so do V's; all
    scales and zeros share one dtype; codes and metadata have unit stride along their last
    dim; all tensors share [N, S, Hkv].
    """

    k: Tensor
    """Key codes: int8 [N, S, Hkv, D], or uint8 [N, S, Hkv, D/2] (two u4 codes per byte)."""
    v: Tensor
    """Value codes, shaped and typed like k."""
    k_scale: Tensor
    """[N, S, Hkv, D/g] fp16 or fp32."""
    v_scale: Tensor
    """[N, S, Hkv, D/g], like k_scale."""
    k_zero: Tensor | None = None
    """int4 only: [N, S, Hkv, D/g], like k_scale (the group minimum, rounded down)."""
    v_zero: Tensor | None = None
    """int4 only: [N, S, Hkv, D/g], like k_scale."""

    def __post_init__(self) -> None:
        if self.k.dtype not in (torch.int8, torch.uint8):
            raise ValueError(f"QuantKvCache: codes dtype {self.k.dtype} is not int8 or uint8")
        check_scale_dtype(self.codec, self.scale_dtype)
        for group in (self.k_group, self.v_group):
            if group != 1:  # 1: per-channel keys
                check_group(self.codec, group, self.head_dim)
            if group & (group - 1):
                raise ValueError(
                    f"QuantKvCache: group_size={group} (head_dim={self.head_dim}) is not a "
                    "power of two, which the decode kernel needs; use hot_codec: native"
                )
        if self.bits == 4:
            if self.k_zero is None or self.v_zero is None:
                raise ValueError("QuantKvCache: int4 (uint8 codes) needs k_zero and v_zero")
        elif self.k_zero is not None or self.v_zero is not None:
            raise ValueError("QuantKvCache: int8 is symmetric; pass no zero points")
        lead = self.k.shape[:3]
        for scale, zero in ((self.k_scale, self.k_zero), (self.v_scale, self.v_zero)):
            for t in (scale,) if zero is None else (scale, zero):
                if t.shape != scale.shape or t.dtype != self.scale_dtype:
                    raise ValueError(f"QuantKvCache: scale/zero {tuple(t.shape)} {t.dtype} differ")
                if t.stride() != scale.stride() or t.stride(-1) != 1:
                    raise ValueError(
                        "QuantKvCache: a scale and its zero need equal, unit-last strides"
                    )
            if scale.shape[:3] != lead:
                raise ValueError(f"QuantKvCache: scales {tuple(scale.shape)} vs codes {lead}")
        v = self.v
        if v.shape != self.k.shape or v.dtype != self.k.dtype or v.stride() != self.k.stride():
            raise ValueError("QuantKvCache: k and v codes need one shape, dtype and strides")
        if self.k.stride(-1) != 1:
            raise ValueError("QuantKvCache: codes need unit stride along their last dim")

    @classmethod
    def empty(
        cls,
        codec: HotCodec,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        device: torch.device | str,
        group_size: int = DEFAULT_GROUP,
        scale_dtype: torch.dtype = torch.float16,
    ) -> QuantKvCache:
        """An uninitialized int8 or int4 cache of num_blocks blocks."""
        if codec not in ("int8", "int4"):
            raise ValueError(f"QuantKvCache: codec={codec!r}; use 'int8' or 'int4'")
        g = check_group(codec, group_size, head_dim)
        lead = (num_blocks, block_size, num_kv_heads)
        int4 = codec == "int4"
        codes = (*lead, head_dim // 2 if int4 else head_dim)
        code_dtype = torch.uint8 if int4 else torch.int8
        meta = (*lead, head_dim // g)

        def new(shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
            return torch.empty(shape, dtype=dtype, device=device)

        zeros = (new(meta, scale_dtype), new(meta, scale_dtype)) if int4 else (None, None)
        return cls(
            new(codes, code_dtype),
            new(codes, code_dtype),
            new(meta, scale_dtype),
            new(meta, scale_dtype),
            *zeros,
        )

    @property
    def bits(self) -> int:
        return 8 if self.k.dtype == torch.int8 else 4

    @property
    def codec(self) -> str:
        return f"int{self.bits}"

    @property
    def head_dim(self) -> int:
        return self.k.shape[-1] * (8 // self.bits)

    @property
    def k_group(self) -> int:
        """Channels per key scale (1: per channel)."""
        return self.head_dim // self.k_scale.shape[-1]

    @property
    def v_group(self) -> int:
        return self.head_dim // self.v_scale.shape[-1]

    @property
    def group_size(self) -> int:
        """Channels per scale of a Hot cache, whose keys and values are grouped alike (the
        writers quantize both per token)."""
        if self.k_group != self.v_group:
            raise ValueError("QuantKvCache: per-channel keys (a Warm view) have no one group")
        return self.k_group

    @property
    def block_size(self) -> int:
        return self.k.shape[1]

    @property
    def num_kv_heads(self) -> int:
        return self.k.shape[2]

    @property
    def scale_dtype(self) -> torch.dtype:
        return self.k_scale.dtype


def hot_kv_bytes_per_token(
    codec: HotCodec,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    group_size: int = DEFAULT_GROUP,
    scale_dtype: torch.dtype = torch.float16,
) -> int:
    """Bytes of K and V of one token in one layer (dtype: the native cache's)."""
    if codec == "native":
        return 2 * num_kv_heads * head_dim * dtype.itemsize
    g = check_group(codec, group_size, head_dim)
    bits, n_meta = (8, 1) if codec == "int8" else (4, 2)
    per_head = head_dim * bits // 8 + (head_dim // g) * n_meta * scale_dtype.itemsize
    return 2 * num_kv_heads * per_head


def quantize_tokens(
    x: Tensor, bits: int, group_size: int, scale_dtype: torch.dtype
) -> tuple[Tensor, Tensor, Tensor | None]:
    """x [..., D] -> (codes, scale [..., D/g], zero [..., D/g] or None) in the cache layout."""
    if bits == 8:
        codes, scale = quantize_sym_int8(x, group_size, scale_dtype)
        return codes, scale, None
    q, scale, zero = quantize_asym_u4(x.unflatten(-1, (-1, group_size)), -1, scale_dtype)
    return pack_u4(q.flatten(-2)), scale.squeeze(-1), zero.squeeze(-1)


def dequantize_tokens(codes: Tensor, scale: Tensor, zero: Tensor | None, bits: int) -> Tensor:
    """The inverse of quantize_tokens, in fp32 [..., D]."""
    if bits == 8:
        return dequantize_sym_int8(codes, scale, codes.shape[-1] // scale.shape[-1])
    assert zero is not None, "int4 codes need zero points"
    q = unpack_u4(codes)
    q = q.unflatten(-1, (scale.shape[-1], -1))  # [..., D/g, g]
    return dequantize_asym_u4(q, scale.unsqueeze(-1), zero.unsqueeze(-1)).flatten(-2)


def dequantize_blocks(
    cache: QuantKvCache, blocks: Tensor, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """K and V of the given physical blocks as [n, S, Hkv, D] in dtype (a native cache)."""
    idx = blocks.to(device=cache.k.device, dtype=torch.long)
    out = []
    for codes, scale, zero in (
        (cache.k, cache.k_scale, cache.k_zero),
        (cache.v, cache.v_scale, cache.v_zero),
    ):
        z = None if zero is None else zero[idx]
        out.append(dequantize_tokens(codes[idx], scale[idx], z, cache.bits).to(dtype))
    return out[0], out[1]
