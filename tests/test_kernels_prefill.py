"""The Triton paged prefill kernel (varlen, causal, GQA, one launch per step) against the
float64 reference, on fresh random inputs: native caches of fp32 / bf16, int8 / int4 caches,
sliding windows, idle rows, and a Warm prefix held outside the cache (Triton under
TRITON_INTERPRET=1 on the CPU, compiled on a GPU)."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from hybridgen.kernels import reference, triton_paged_decode
from hybridgen.kernels import triton_paged_prefill as t_prefill
from hybridgen.kernels.kv_quant import QuantKvCache, dequantize_blocks
from tests.kernel_helpers import DEVICE, randn, rel_err, tol
from tests.test_kernels_attention import _paged_setup

CASES = [
    # (query lens, seq_lens, hq, hkv, dim, block, window)
    ([5, 12, 1], [5, 30, 17], 8, 2, 64, 8, 0),  # fresh prompt, chunk after context, one row
    ([7, 20], [40, 20], 4, 4, 64, 8, 6),  # MHA; sliding window with and without context
    ([0, 9, 3], [11, 9, 3], 6, 3, 48, 16, 0),  # idle sequence; GQA 3; head dim 48
    ([40], [70], 32, 4, 64, 16, 0),  # GQA 8: queries spread over several row tiles
    ([130, 2], [200, 2], 4, 2, 32, 16, 0),  # chunk longer than a row tile
    ([9, 1], [30, 17], 16, 1, 576, 16, 0),  # DeepSeek-V2-Lite's MLA: 16 heads on one latent
]


def _qsl(q_lens: list[int]) -> list[int]:
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    return qsl


def _first_keys(q_lens: list[int], seq_lens: list[int], window: int) -> list[int]:
    """The oldest key each sequence's first query sees; blocks before it are poisoned."""
    return [
        max(0, s - n - window + 1) if window else 0 for n, s in zip(q_lens, seq_lens, strict=True)
    ]


@pytest.mark.usefixtures("poison_empty")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_prefill_native(dtype: torch.dtype, case: int) -> None:
    q_lens, seq_lens, hq, hkv, dim, block, window = CASES[case]
    gen = torch.Generator().manual_seed(100 + case)
    first = _first_keys(q_lens, seq_lens, window)
    k, v, table = _paged_setup(200 + case, seq_lens, hkv, dim, block, dtype, first)
    qsl = _qsl(q_lens)
    q = randn(gen, qsl[-1] + 2, hq, dim, dtype=dtype)  # two trailing padding rows
    out = t_prefill.paged_prefill_attention(
        q, t_prefill.native_kv(k, v), table, qsl, seq_lens, 0.125, window
    )
    ref, _ = reference.paged_attention_naive(q, k, v, table, qsl, seq_lens, 0.125, window)
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert (out[qsl[-1] :] == 0).all(), "rows past the packed tokens are zero"
    assert rel_err(out[: qsl[-1]], ref[: qsl[-1]]) < tol(dtype)


@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_prefill_quantized(codec: str) -> None:
    q_lens, seq_lens, hq, hkv, dim, block = [9, 1, 16], [25, 1, 40], 8, 2, 64, 16
    gen = torch.Generator().manual_seed(7)
    k, v, table = _paged_setup(8, seq_lens, hkv, dim, block, torch.bfloat16)
    k, v = k.nan_to_num(0.0), v.nan_to_num(0.0)
    cache = QuantKvCache.empty(codec, k.shape[0], block, hkv, dim, k.device)
    slots = torch.arange(k.shape[0] * block, device=k.device)
    reference.write_kv_cache_quant(k.flatten(0, 1), v.flatten(0, 1), cache, slots)
    qsl = _qsl(q_lens)
    q = randn(gen, qsl[-1], hq, dim, dtype=torch.bfloat16)
    out = t_prefill.paged_prefill_attention(
        q, t_prefill.quant_kv(cache), table, qsl, seq_lens, 0.125
    )
    blocks = torch.arange(k.shape[0], device=k.device)
    kd, vd = dequantize_blocks(cache, blocks, torch.bfloat16)  # what the kernel must attend
    ref, _ = reference.paged_attention_naive(q, kd, vd, table, qsl, seq_lens, 0.125)
    assert rel_err(out, ref) < tol(torch.bfloat16)


@pytest.mark.usefixtures("poison_empty")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_with_warm_prefix(dtype: torch.dtype) -> None:
    """Sequence 1 holds its first 32 keys outside the cache: its block table starts after
    them, and the kernel merges the two partials as the reference does."""
    q_lens, seq_lens, hq, hkv, dim, block, p = [6, 10], [6, 50], 8, 2, 64, 8, 32
    gen = torch.Generator().manual_seed(11)
    hot_lens = [seq_lens[0], seq_lens[1] - p]
    k, v, table = _paged_setup(12, hot_lens, hkv, dim, block, dtype)
    prefix = (randn(gen, p, hkv, dim, dtype=dtype), randn(gen, p, hkv, dim, dtype=dtype))
    qsl = _qsl(q_lens)
    q = randn(gen, qsl[-1], hq, dim, dtype=dtype)
    prefixes: list[tuple[Tensor, Tensor] | None] = [None, prefix]
    out = t_prefill.paged_prefill_attention(
        q, t_prefill.native_kv(k, v), table, qsl, seq_lens, 0.125, 0, prefixes
    )
    prefix64: list[tuple[Tensor, Tensor] | None] = [None, (prefix[0].double(), prefix[1].double())]
    ref = reference.paged_prefill_attention(
        q.double(), k.double(), v.double(), table, qsl, seq_lens, 0.125, 0, prefix64
    )
    assert rel_err(out, ref) < tol(dtype)


def test_plan_is_one_per_step() -> None:
    """Every layer of a step asks for the same tiles: built once, kept for the next call."""
    a = t_prefill._plan([0, 5, 200], [5, 300], 32, DEVICE)
    assert a[2] == 1 + 7  # ceil(5 / 32) + ceil(195 / 32)
    assert t_prefill._plan([0, 5, 200], [5, 300], 32, DEVICE) is a
    assert a[0].tolist()[:3] == [[0, 0], [1, 0], [1, 32]]
    assert a[1].tolist() == [[0, 5, 5], [5, 195, 300]]


@pytest.mark.parametrize("head_dim", [48, 64, 128, 576])
def test_tiles_fit_shared_memory(head_dim: int) -> None:
    """The decode and prefill tiles of every head width the models use (576: DeepSeek-V2's
    latent, 16 query heads on one) keep their fp32 query rows, K tile and V tile within the
    H200's 232,448 bytes of shared memory: 32 keys of the padded 1,024 asked 329,792 there."""
    limit = 232_448
    d, g, n = triton_paged_decode._tile_sizes(head_dim, 16)
    assert (g * d + 2 * n * d) * 4 <= limit
    d, g, m, n = t_prefill._tile_sizes(head_dim, 16)
    assert (m * g * d + 2 * n * d) * 4 <= limit
