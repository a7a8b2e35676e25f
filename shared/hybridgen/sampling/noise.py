"""Counter-based random noise for reproducible, batch-invariant sampling.

Every random number is a pure function of (seed, step, vocab index): there is no generator
state, so a row's noise never depends on which other rows share its batch, on their order, or
on how many steps other requests have taken. The hash is SplitMix64 (Steele et al., "Fast
splittable pseudorandom number generators", 2014; finaliser "Mix13" by D. Stafford), written
with plain torch int64 ops so it runs unchanged on any device:

    row_key(seed, step) = mix64(mix64(seed ^ SEED_SALT) ^ mix64(step ^ STEP_SALT))
    word(seed, step, w) = mix64(row_key + (w + 1) * GOLDEN_GAMMA)        (mod 2**64)
    token i uses 23 bits of word i // 2: bits 63..41 for even i, bits 40..18 for odd i

``word`` is exactly the SplitMix64 output stream started at state ``row_key``. Two rows share
noise only if their keys coincide or their streams overlap within a vocabulary's length, which
for distinct (seed, step) pairs happens with probability ~V / 2**64.

Portability invariants (why the ops below look the way they do):
- torch has no uint64 arithmetic on every device, so values live in int64 and are reinterpreted
  as two's-complement. Constants above 2**63 are stored as their negative int64 equivalents.
- int64 multiplication and addition wrap modulo 2**64 on CPU and CUDA (the kernels compile to a
  plain 64-bit ``imul`` / ``mul.lo.s64``); ``test_sampling.py`` checks the bits against a pure
  Python reference that wraps explicitly.
- ``>>`` on int64 is an arithmetic shift (sign-filling), so logical shifts are emulated by masking
  off the copied sign bits; ``<<`` is done on the unsigned bit pattern by torch, so it wraps.
- Each uniform uses 23 random bits so that ``(k + 0.5) * 2**-23`` is exact in float32 and lies
  strictly inside (0, 1) on every device; the Gumbel transform is then bounded to about
  [-2.8, 16.6], which truncates tails of mass ~1e-7. The integer bits are identical on every
  device; the float logs may differ in the last ulp between CPU and CUDA libm.
"""

from __future__ import annotations

import torch
from torch import Tensor

_MASK64 = (1 << 64) - 1


def _as_int64(value: int) -> int:
    """Reinterpret an unsigned 64-bit constant as the signed int64 torch can hold."""
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


GOLDEN_GAMMA = _as_int64(0x9E3779B97F4A7C15)
"""SplitMix64's odd Weyl increment (2**64 / golden ratio)."""
_MIX_MUL1 = _as_int64(0xBF58476D1CE4E5B9)
_MIX_MUL2 = _as_int64(0x94D049BB133111EB)
SEED_SALT = _as_int64(0x5EED5EED5EED5EED)
"""Xored into the seed so that seed and step use different bijections before combining."""
STEP_SALT = _as_int64(0x57E957E957E957E9)
"""Xored into the step; see SEED_SALT."""

_UNIFORM_BITS = 23
"""Random bits kept per uniform: (k + 0.5) * 2**-23 is exact in float32 for k < 2**23."""


def _xor_lshr_(z: Tensor, shift: int) -> Tensor:
    """In place: z ^= z >>> shift (logical shift on the two's-complement bit pattern)."""
    # torch's >> on int64 copies the sign bit; masking the top `shift` bits makes it logical.
    z.bitwise_xor_(torch.bitwise_right_shift(z, shift).bitwise_and_((1 << (64 - shift)) - 1))
    return z


def mix64_(z: Tensor) -> Tensor:
    """In place SplitMix64 finaliser (Stafford's Mix13): a bijection on 64-bit patterns."""
    # z: [...] int64, overwritten
    _xor_lshr_(z, 30).mul_(_MIX_MUL1)
    _xor_lshr_(z, 27).mul_(_MIX_MUL2)
    return _xor_lshr_(z, 31)


def mix64(z: Tensor) -> Tensor:
    """SplitMix64 finaliser, out of place."""
    return mix64_(z.to(torch.int64, copy=True))


def row_keys(seeds: Tensor, steps: Tensor) -> Tensor:
    """Per-row stream keys from (seed, step); both int64 and >= 0."""
    # seeds: [B] int64, steps: [B] int64 -> [B] int64
    return mix64_(mix64(seeds.bitwise_xor(SEED_SALT)).bitwise_xor_(mix64(steps ^ STEP_SALT)))


def random_bits(keys: Tensor, num_words: int) -> Tensor:
    """The first num_words outputs of each row key's SplitMix64 stream."""
    # keys: [B] int64 -> [B, W] int64
    # (w + 1) * gamma is SplitMix64's state after w + 1 increments; it wraps mod 2**64.
    offsets = torch.arange(1, num_words + 1, dtype=torch.int64, device=keys.device)
    offsets.mul_(GOLDEN_GAMMA)
    return mix64_(keys[:, None] + offsets[None, :])


def uniform_noise(keys: Tensor, vocab_size: int) -> Tensor:
    """Uniform float32 noise strictly inside (0, 1), one value per (row, vocab index)."""
    # keys: [B] int64 -> [B, V] float32
    # Each 64-bit word feeds two tokens, halving the (memory-bound) mixing work: token 2w gets
    # bits 63..41 of word w, token 2w + 1 bits 40..18. Both fields are read as signed 23-bit
    # integers s in [-2**22, 2**22) with arithmetic shifts, so no masking pass is needed, and
    # u = (s + 2**22 + 0.5) * 2**-23 is exact in float32.
    words = random_bits(keys, (vocab_size + 1) // 2)  # [B, W]
    out = torch.empty(*words.shape, 2, dtype=torch.float32, device=keys.device)  # [B, W, 2]
    out[..., 0].copy_(torch.bitwise_right_shift(words, 64 - _UNIFORM_BITS))
    words.bitwise_left_shift_(_UNIFORM_BITS).bitwise_right_shift_(64 - _UNIFORM_BITS)
    out[..., 1].copy_(words)
    out = out.view(keys.shape[0], 2 * words.shape[1])[:, :vocab_size]
    return out.add_(2.0 ** (_UNIFORM_BITS - 1) + 0.5).mul_(2.0**-_UNIFORM_BITS)


def gumbel_noise(keys: Tensor, vocab_size: int) -> Tensor:
    """Standard Gumbel noise -log(-log(u)), float32, one value per (row, vocab index)."""
    # keys: [B] int64 -> [B, V] float32; u in (0, 1) so both logs are finite.
    return uniform_noise(keys, vocab_size).log_().neg_().log_().neg_()


def gumbel_at(keys: Tensor, ids: Tensor) -> Tensor:
    """The Gumbel noise `gumbel_noise(keys, V)[:, ids]` for a few vocab ids only (sampling
    from top-k candidates on the CPU draws exactly the noise the device would have)."""
    # keys: [B] int64, ids: [B, K] int64 -> [B, K] float32
    offsets = (torch.div(ids, 2, rounding_mode="floor") + 1).mul_(GOLDEN_GAMMA)
    words = mix64_(keys[:, None] + offsets)
    odd = words.bitwise_left_shift(_UNIFORM_BITS).bitwise_right_shift_(64 - _UNIFORM_BITS)
    even = torch.bitwise_right_shift(words, 64 - _UNIFORM_BITS)
    bits = torch.where(ids % 2 == 1, odd, even).to(torch.float32)
    u = bits.add_(2.0 ** (_UNIFORM_BITS - 1) + 0.5).mul_(2.0**-_UNIFORM_BITS)
    return u.log_().neg_().log_().neg_()
