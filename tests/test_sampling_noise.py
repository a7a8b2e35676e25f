"""The counter-based noise behind seeded sampling: exact, deterministic and uniform."""

from __future__ import annotations

import math

import torch

from hybridgen.sampling import noise
from tests.sampling_helpers import chi_square

# ---------------------------------------------------------------------------------------------
# Noise


_M64 = (1 << 64) - 1


def _mix64_ref(z: int) -> int:
    """SplitMix64 finaliser in Python integers, wrapping explicitly."""
    z ^= z >> 30
    z = (z * 0xBF58476D1CE4E5B9) & _M64
    z ^= z >> 27
    z = (z * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def _uniform_ref(seed: int, step: int, index: int) -> float:
    """The documented noise definition, in unsigned Python integers."""
    key = _mix64_ref(
        _mix64_ref(seed ^ (noise.SEED_SALT & _M64)) ^ _mix64_ref(step ^ (noise.STEP_SALT & _M64))
    )
    word = _mix64_ref((key + (index // 2 + 1) * (noise.GOLDEN_GAMMA & _M64)) & _M64)
    field = (word >> 41) if index % 2 == 0 else (word >> 18) & (2**23 - 1)
    signed = field - 2**23 if field >= 2**22 else field  # read as a signed 23-bit integer
    return (signed + 2**22 + 0.5) * 2.0**-23


def test_noise_matches_unsigned_reference() -> None:
    # Checks the int64 wrap-around, the shift emulation and the float mapping bit for bit.
    seeds = [0, 1, 12345, 2**31 - 1, 2**62 + 7, 2**63 - 1]
    steps = [0, 1, 7, 4096, 3, 2**40]
    keys = noise.row_keys(torch.tensor(seeds), torch.tensor(steps))
    u = noise.uniform_noise(keys, 51)
    for row, (seed, step) in enumerate(zip(seeds, steps, strict=True)):
        for index in (0, 1, 2, 3, 17, 48, 50):
            assert u[row, index].item() == _uniform_ref(seed, step, index)


def test_noise_is_deterministic() -> None:
    keys = noise.row_keys(torch.tensor([3, 99, 2**60]), torch.tensor([0, 5, 123]))
    first = noise.uniform_noise(keys, 1000)
    again = noise.uniform_noise(keys.clone(), 1000)
    assert torch.equal(first, again)
    # A row's noise does not depend on the other rows or on the vocabulary size asked for.
    alone = noise.uniform_noise(keys[1:2], 300)
    assert torch.equal(alone[0], first[1, :300])


def test_noise_is_roughly_uniform() -> None:
    seeds = torch.arange(64)
    keys = noise.row_keys(seeds, torch.full_like(seeds, 3))
    u = noise.uniform_noise(keys, 4096).double()  # 262144 values
    assert u.min() > 0 and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.005
    assert abs(u.var().item() - 1 / 12) < 0.002
    counts = torch.histc(u, bins=64, min=0, max=1)
    # 63 degrees of freedom: the 1e-6 tail of chi-square starts near 130.
    assert chi_square(counts, torch.full((64,), 1 / 64, dtype=torch.float64)) < 130
    # Neighbouring vocab indices and neighbouring seeds are uncorrelated.
    centred = u - 0.5
    lag_index = (centred[:, 1:] * centred[:, :-1]).mean() * 12
    lag_seed = (centred[1:] * centred[:-1]).mean() * 12
    assert abs(lag_index.item()) < 0.01 and abs(lag_seed.item()) < 0.01


def test_gumbel_noise_mean_and_range() -> None:
    keys = noise.row_keys(torch.arange(16), torch.zeros(16, dtype=torch.int64))
    g = noise.gumbel_noise(keys, 8192).double()
    assert torch.isfinite(g).all()
    assert abs(g.mean().item() - 0.5772156649) < 0.01  # Euler-Mascheroni constant
    assert abs(g.var().item() - math.pi**2 / 6) < 0.05


def test_noise_depends_on_seed_and_step() -> None:
    keys = noise.row_keys(torch.tensor([5, 5, 6]), torch.tensor([0, 1, 0]))
    u = noise.uniform_noise(keys, 256)
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
