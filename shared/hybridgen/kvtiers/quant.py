"""Lossy KV codecs: int8 symmetric group quantization and KIVI-style int4.

The math is pure torch so the GPU daemon and the CPU daemon produce the same bytes for the
same block (DESIGN.md: kv_codec must give identical results on either device). To keep it
device-independent it uses only ops whose result is exactly specified by IEEE 754:

- reductions are amax/amin (exact); no sum- or mean-based statistic;
- scales and zeros are computed in fp32 and rounded to their storage dtype (scales up,
  zeros down) *before* use, so the encoder quantizes with the very values the decoder reads;
- divisions divide by device tensors, never by a Python number: CUDA turns `x / 127` into
  `x * (1/127)`, which rounds differently from the CPU's true division;
- torch.round (half to even), clamp and casts; dequantization is a separate mul then add,
  so no backend can fuse them into an FMA with a different rounding.

With fp16 scales, values must stay within fp16's range (|x| < 65504); NaN inputs give
unspecified codes. Use scale_dtype=torch.float32 for anything wider.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from functools import cached_property
from typing import ClassVar

import torch
from torch import Tensor

from hybridgen.kvtiers.codec_base import BlockCodec, BlockSpec, Field, RecordLayout

SCALE_DTYPES = (torch.float16, torch.float32)


def _const(x: Tensor, value: float) -> Tensor:
    """A 0-dim fp32 tensor on x's device (see the module docstring for why not a float)."""
    return torch.full((), value, dtype=torch.float32, device=x.device)


def _stored_up(x: Tensor, dtype: torch.dtype) -> Tensor:
    """x (fp32) rounded toward +inf into the storage dtype, finite.

    Scales round up and zeros round down, so every value of a group lands inside the code
    range and the clamp never adds error, even where fp16 scales are subnormal (groups with
    amax below ~8e-3). The step to the next fp16 is done on the bit pattern (+1 away from
    zero for positives, -1 toward zero for negatives), which is exact on every device.
    """
    big = torch.finfo(dtype).max
    x = x.clamp(-big, big)
    y = x.to(dtype)
    if dtype == torch.float32:
        return y
    bits = y.view(torch.int16)
    above = torch.where(y < 0, bits - 1, bits + 1).view(dtype)
    return torch.where(y.float() < x, above, y)


def _stored_down(x: Tensor, dtype: torch.dtype) -> Tensor:
    return -_stored_up(-x, dtype)


def _nonzero(scale: Tensor) -> Tensor:
    """A usable divisor: a zero scale (constant group) quantizes everything to its base."""
    s = scale.float()
    return torch.where(s > 0, s, torch.ones_like(s))


def check_group(name: str, group: int, head_dim: int) -> int:
    """The effective group along head_dim: at most head_dim, and it must divide it evenly."""
    g = min(group, head_dim)
    if g <= 0 or head_dim % g or g % 2:
        raise ValueError(
            f"{name} codec: group_size={group} does not fit head_dim={head_dim}; use an even "
            "group that divides head_dim (32 or 64 for usual models)"
        )
    return g


def check_scale_dtype(name: str, dtype: torch.dtype) -> None:
    if dtype not in SCALE_DTYPES:
        raise ValueError(f"{name} codec: scale_dtype={dtype} is not float16 or float32")


# --- int8: symmetric, one scale per group of `g` channels of one token and head -------------


def quantize_sym_int8(x: Tensor, g: int, scale_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """x: [..., D] -> codes int8 [..., D] in [-127, 127], scales [..., D // g]."""
    xg = x.float().unflatten(-1, (-1, g))  # [..., D/g, g]
    scale = _stored_up(xg.abs().amax(-1) / _const(x, 127.0), scale_dtype)  # [..., D/g]
    q = torch.round(xg / _nonzero(scale).unsqueeze(-1)).clamp(-127, 127)
    return q.to(torch.int8).flatten(-2), scale


def dequantize_sym_int8(q: Tensor, scale: Tensor, g: int) -> Tensor:
    """codes [..., D], scales [..., D // g] -> fp32 [..., D]."""
    return (q.float().unflatten(-1, (-1, g)) * scale.float().unsqueeze(-1)).flatten(-2)


# --- int4: asymmetric, scale and zero (the group minimum) per group along `dim` -------------


def quantize_asym_u4(x: Tensor, dim: int, scale_dtype: torch.dtype) -> tuple[Tensor, ...]:
    """x -> codes uint8 in [0, 15] shaped like x, scale and zero reduced over `dim` (kept)."""
    x = x.float()
    zero = _stored_down(x.amin(dim, keepdim=True), scale_dtype)
    z = zero.float()
    # The range is measured from the *stored* zero so that the top of the group stays inside
    # code 15.
    scale = _stored_up((x.amax(dim, keepdim=True) - z) / _const(x, 15.0), scale_dtype)
    q = torch.round((x - z) / _nonzero(scale)).clamp(0, 15)
    return q.to(torch.uint8), scale, zero


def dequantize_asym_u4(q: Tensor, scale: Tensor, zero: Tensor) -> Tensor:
    return q.float() * scale.float() + zero.float()


def pack_u4(q: Tensor) -> Tensor:
    """codes [..., D] in [0, 15] -> [..., D // 2]: element 2i in the low nibble, 2i+1 high."""
    return q[..., 0::2] | (q[..., 1::2] << 4)


def unpack_u4(p: Tensor) -> Tensor:
    """[..., D // 2] -> codes [..., D]."""
    return torch.stack((p & 15, p >> 4), dim=-1).flatten(-2)


@dataclass(frozen=True)
class GroupQuantCodec(BlockCodec):
    """What int8 and int4 share: the block spec, the channel group and the scale storage."""

    spec: BlockSpec
    group_size: int = 32
    """Channels sharing one scale (and zero), along head_dim; capped at head_dim."""
    scale_dtype: torch.dtype = torch.float16
    """Storage of scales and zeros: float16 (smaller) or float32."""

    def __post_init__(self) -> None:
        check_group(self.name, self.group_size, self.spec.head_dim)
        check_scale_dtype(self.name, self.scale_dtype)

    @cached_property
    def g(self) -> int:
        return check_group(self.name, self.group_size, self.spec.head_dim)

    @property
    @abstractmethod
    def layout(self) -> RecordLayout: ...

    @property
    def record_bytes(self) -> int:
        return self.layout.record_bytes


@dataclass(frozen=True)
class Int8Codec(GroupQuantCodec):
    """Symmetric int8 with one scale per `group_size` channels of each token and head.

    Record, per block (S tokens, H heads, D channels, g = group_size, each field 16-aligned)::

        k_codes  int8        [S, H, D]
        v_codes  int8        [S, H, D]
        k_scale  scale_dtype [S, H, D/g]     x ~= code * scale, scale = amax(|group|) / 127
        v_scale  scale_dtype [S, H, D/g]
    """

    name: ClassVar[str] = "int8"

    @cached_property
    def layout(self) -> RecordLayout:
        s, h, d = self.spec.shape
        codes, scales = (s, h, d), (s, h, d // self.g)
        return RecordLayout(
            (
                Field("k_codes", torch.int8, codes),
                Field("v_codes", torch.int8, codes),
                Field("k_scale", self.scale_dtype, scales),
                Field("v_scale", self.scale_dtype, scales),
            )
        )

    def _encode(self, k: Tensor, v: Tensor) -> Tensor:
        # k, v: [N, S, H, D]
        kq, ks = quantize_sym_int8(k, self.g, self.scale_dtype)
        vq, vs = quantize_sym_int8(v, self.g, self.scale_dtype)
        return self.layout.pack((kq, vq, ks, vs))

    def _decode(self, records: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        kq, vq, ks, vs = self.layout.unpack(records)
        k = dequantize_sym_int8(kq, ks, self.g).to(dtype)
        return k, dequantize_sym_int8(vq, vs, self.g).to(dtype)


@dataclass(frozen=True)
class Int4Codec(GroupQuantCodec):
    """KIVI-style asymmetric int4: keys per channel, values per token, two codes per byte.

    Keys have a few outlier channels (10-20x the rest), so each channel of each head gets its
    own scale and zero over the block's S tokens; values have no such channels and are grouped
    per token along head_dim, as in KIVI (Liu et al., 2024). Record, per block (g = group_size,
    each field 16-aligned)::

        k_codes  uint8       [S, H, D/2]     low nibble: channel 2i, high nibble: 2i+1
        v_codes  uint8       [S, H, D/2]
        k_scale  scale_dtype [H, D]          over the S tokens of each channel
        k_zero   scale_dtype [H, D]          x ~= code * scale + zero, zero = min
        v_scale  scale_dtype [S, H, D/g]     over g channels of each token and head
        v_zero   scale_dtype [S, H, D/g]

    With `per_token_keys` the keys are grouped as the values are (k_scale, k_zero
    [S, H, D/g]): that record is an int4 Hot-KV block's fields byte for byte (kv_quant), the
    Warm tier of an int4 Hot cache, which stores Hot blocks as they are instead of quantizing
    them a second time.
    """

    name: ClassVar[str] = "int4"
    per_token_keys: bool = False

    @cached_property
    def layout(self) -> RecordLayout:
        s, h, d = self.spec.shape
        sd, vgroups = self.scale_dtype, (s, h, d // self.g)
        kgroups = vgroups if self.per_token_keys else (h, d)
        return RecordLayout(
            (
                Field("k_codes", torch.uint8, (s, h, d // 2)),
                Field("v_codes", torch.uint8, (s, h, d // 2)),
                Field("k_scale", sd, kgroups),
                Field("k_zero", sd, kgroups),
                Field("v_scale", sd, vgroups),
                Field("v_zero", sd, vgroups),
            )
        )

    def _encode(self, k: Tensor, v: Tensor) -> Tensor:
        # k, v: [N, S, H, D]
        vp, vs, vz = self._per_token(v)
        if self.per_token_keys:
            kp, ks, kz = self._per_token(k)
        else:
            kq, ks, kz = quantize_asym_u4(k, 1, self.scale_dtype)  # ks, kz: [N, 1, H, D]
            kp, ks, kz = pack_u4(kq), ks.squeeze(1), kz.squeeze(1)
        return self.layout.pack((kp, vp, ks, kz, vs, vz))

    def _per_token(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x [N, S, H, D] -> packed codes [N, S, H, D/2], scale and zero [N, S, H, D/g]."""
        q, scale, zero = quantize_asym_u4(x.unflatten(-1, (-1, self.g)), -1, self.scale_dtype)
        return pack_u4(q.flatten(-2)), scale.squeeze(-1), zero.squeeze(-1)

    def _decode(self, records: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        kp, vp, ks, kz, vs, vz = self.layout.unpack(records)
        if self.per_token_keys:
            k = self._from_tokens(kp, ks, kz)
        else:
            k = dequantize_asym_u4(unpack_u4(kp), ks.unsqueeze(1), kz.unsqueeze(1))
        return k.to(dtype), self._from_tokens(vp, vs, vz).to(dtype)

    def _from_tokens(self, packed: Tensor, scale: Tensor, zero: Tensor) -> Tensor:
        q = unpack_u4(packed).unflatten(-1, (-1, self.g))  # [N, S, H, D/g, g]
        return dequantize_asym_u4(q, scale.unsqueeze(-1), zero.unsqueeze(-1)).flatten(-2)
