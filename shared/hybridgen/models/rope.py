"""Rotary position embeddings: inverse frequencies for each HF scaling type, as cos/sin tables.

The formulas follow transformers' `modeling_rope_utils` op for op, so that fp32 runs match
HF bit for bit. Tables are indexed by absolute position, which makes a token's rotation
independent of the batch it runs in.

`dynamic` (NTK) scaling differs from HF in one documented way: HF rescales every token of a
forward pass with the longest sequence length in that pass, so a prompt longer than
max_position_embeddings gets its early tokens rotated by the scaled base. Here position p
always uses the base for length p + 1, which is what HF does for every decoded token, and is
batch invariant.
"""

from __future__ import annotations

import math

import torch

from hybridgen.models.spec import RopeSpec


def _default_inv_freq(base: float, dim: int) -> torch.Tensor:
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim
    return 1.0 / (base**exponents)


def _llama3_inv_freq(rope: RopeSpec, dim: int) -> torch.Tensor:
    inv_freq = _default_inv_freq(rope.theta, dim)
    assert rope.original_max_position is not None
    old_len = rope.original_max_position
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # wavelen < high_wavelen: high frequency, kept; wavelen > low_wavelen: divided by factor;
    # in between: a smooth blend of the two.
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(rope: RopeSpec, dim: int, max_position: int) -> tuple[torch.Tensor, float]:
    base, factor = rope.theta, rope.factor
    original = rope.original_max_position or max_position
    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = _yarn_mscale(factor, rope.mscale) / _yarn_mscale(
                factor, rope.mscale_all_dim
            )
        else:
            attention_factor = _yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # HF: avoids a division by zero in the ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep, float(attention_factor)


def _table(freqs: torch.Tensor, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scaling, emb.sin() * scaling


def rope_tables(
    rope: RopeSpec, head_dim: int, max_position: int, num_positions: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [num_positions, head_dim] float32, HF layout cat(freqs, freqs) times scaling.

    `max_position` is the config's max_position_embeddings (the reference length of the
    dynamic and yarn formulas); `num_positions` is how many rows to build.
    """
    positions = torch.arange(num_positions, dtype=torch.float32)
    if rope.rope_type == "dynamic":
        return _dynamic_tables(rope, head_dim, max_position, num_positions)
    scaling = 1.0
    if rope.rope_type == "default":
        inv_freq = _default_inv_freq(rope.theta, head_dim)
    elif rope.rope_type == "linear":
        inv_freq = _default_inv_freq(rope.theta, head_dim) / rope.factor
    elif rope.rope_type == "llama3":
        inv_freq = _llama3_inv_freq(rope, head_dim)
    elif rope.rope_type == "yarn":
        inv_freq, scaling = _yarn(rope, head_dim, max_position)
    else:
        raise ValueError(f"rope_type={rope.rope_type!r} is not supported")
    if rope.freq_factors is not None:
        inv_freq = inv_freq / torch.tensor(rope.freq_factors, dtype=torch.float32)
    # An outer product, like HF's K=1 matmul: each entry is one fp32 multiply.
    freqs = positions[:, None] * inv_freq.float()[None, :]
    return _table(freqs, scaling)


def _dynamic_tables(
    rope: RopeSpec, head_dim: int, max_position: int, num_positions: int
) -> tuple[torch.Tensor, torch.Tensor]:
    positions = torch.arange(num_positions, dtype=torch.float32)
    # Position p uses the NTK base for sequence length max(p + 1, max_position).
    seq_len = torch.clamp(torch.arange(1, num_positions + 1, dtype=torch.float64), min=max_position)
    f = rope.factor
    base = rope.theta * ((f * seq_len / max_position) - (f - 1)) ** (head_dim / (head_dim - 2))
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(dtype=torch.float) / head_dim
    inv_freq = 1.0 / (base.float()[:, None] ** exponents[None, :])
    return _table(positions[:, None] * inv_freq, 1.0)


def max_model_len(rope: RopeSpec, max_position: int) -> int:
    """Longest context a model supports: dynamic scaling extends past max_position_embeddings."""
    if rope.rope_type == "dynamic":
        return int(max_position * rope.factor)
    return max_position
