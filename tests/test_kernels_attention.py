"""Paged decode and prefill attention, and the partial merge, against float64 references
(Triton under TRITON_INTERPRET=1 on the CPU, compiled on a GPU)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor

from hybridgen.kernels import ops, reference
from hybridgen.kernels import triton_paged_decode as t_decode
from hybridgen.kernels.exact_float import int4_words_half, int8_float, int8_words_half
from tests.kernel_helpers import DEVICE, FP32_TOL, LOW_TOL, randn, rel_err, tol

# ----------------------------------------------------------------------------------------------
# paged attention

DECODE_IMPLS: dict[str, Callable[..., Any]] = {
    "triton": t_decode.paged_decode_attention,
    "reference": reference.paged_decode_attention,
}


def _paged_setup(
    seed: int,
    seq_lens: list[int],
    hkv: int,
    dim: int,
    block: int,
    dtype: torch.dtype,
    first_keys: list[int] | None = None,
    extra_blocks: int = 3,
) -> tuple[Tensor, Tensor, Tensor]:
    """Caches [N, S, Hkv, D] and a shuffled block table [B, M] int32.

    Table entries a kernel must never read (past the sequence, or wholly before first_keys[b],
    the oldest key inside a sliding window) point at poison blocks full of NaN, so reading one
    shows up in the output.
    """
    gen = torch.Generator().manual_seed(seed)
    m = max(max(math.ceil(s / block) for s in seq_lens), 1) + 1
    n_real = sum(math.ceil(s / block) for s in seq_lens) + extra_blocks
    n_poison = 2
    k_cache = randn(gen, n_real + n_poison, block, hkv, dim, dtype=dtype)
    v_cache = randn(gen, n_real + n_poison, block, hkv, dim, dtype=dtype)
    k_cache[n_real:] = float("nan")
    v_cache[n_real:] = float("nan")
    perm = torch.randperm(n_real, generator=gen).tolist()
    table = torch.empty(len(seq_lens), m, dtype=torch.int32)
    for b, s in enumerate(seq_lens):
        first_live = first_keys[b] // block if first_keys else 0
        for i in range(m):
            live = first_live <= i < math.ceil(s / block)
            table[b, i] = perm.pop() if live else n_real + (i % n_poison)
    return k_cache, v_cache, table.to(DEVICE)


def _decode_case(
    impl: str,
    seq_lens: list[int],
    hq: int,
    hkv: int,
    dim: int,
    block: int,
    dtype: torch.dtype,
    window: int,
    num_splits: int | None,
    seed: int = 0,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed + 1000)
    first_keys = [max(0, s - window) if window else 0 for s in seq_lens]
    k_cache, v_cache, table = _paged_setup(seed, seq_lens, hkv, dim, block, dtype, first_keys)
    q = randn(gen, len(seq_lens), hq, dim, dtype=dtype)
    scale = dim**-0.5
    out = torch.full_like(q, float("nan"))
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    got = DECODE_IMPLS[impl](
        q,
        k_cache,
        v_cache,
        table,
        sl,
        scale,
        window,
        out=out,
        return_lse=True,
        num_splits=num_splits,
    )
    o, lse = got
    assert o.data_ptr() == out.data_ptr()
    qsl = list(range(len(seq_lens) + 1))
    ref_o, ref_lse = reference.paged_attention_naive(
        q, k_cache, v_cache, table, qsl, seq_lens, scale, window
    )
    return o, lse, ref_o, ref_lse


def _check_decode(o: Tensor, lse: Tensor, ref_o: Tensor, ref_lse: Tensor, tol_o: float) -> None:
    o, lse = o.cpu(), lse.cpu()
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()
    assert lse.dtype == torch.float32
    if ref_o.norm() > 0:
        assert rel_err(o, ref_o) < tol_o
    empty = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), empty) and (lse[empty] < 0).all()
    assert (o[empty] == 0).all()
    if not empty.all():
        lse_err = (lse[~empty].double() - ref_lse[~empty]).abs().max()
        assert lse_err < 1e-5 * (1 + ref_lse[~empty].abs().max())


DECODE_CASES = [
    # (seq_lens, hq, hkv, dim, block, window)
    ([37, 0, 90, 16], 8, 2, 64, 16, 0),  # GQA 4, empty row, partial and exact blocks
    ([37, 0, 90, 16], 8, 2, 64, 16, 21),  # sliding window
    ([130, 5, 0], 4, 4, 64, 8, 0),  # MHA, block 8 < key tile
    ([61, 1], 6, 2, 48, 16, 0),  # GQA 3, head dim not a power of two
    ([70, 33], 40, 2, 64, 16, 0),  # 20 heads per kv head: a check step's 5 rows of GQA 4
    ([45, 3], 16, 1, 576, 16, 0),  # DeepSeek-V2-Lite's MLA: 16 heads on one 576-wide latent
]


@pytest.mark.usefixtures("poison_empty")
@pytest.mark.parametrize("impl", sorted(DECODE_IMPLS))
@pytest.mark.parametrize("num_splits", [1, 3, None])
@pytest.mark.parametrize("case", range(len(DECODE_CASES)))
def test_paged_decode_fp32(impl: str, num_splits: int | None, case: int) -> None:
    seq_lens, hq, hkv, dim, block, window = DECODE_CASES[case]
    o, lse, ref_o, ref_lse = _decode_case(
        impl, seq_lens, hq, hkv, dim, block, torch.float32, window, num_splits, seed=case
    )
    _check_decode(o, lse, ref_o, ref_lse, FP32_TOL)


@pytest.mark.usefixtures("poison_empty")
@pytest.mark.parametrize("impl", sorted(DECODE_IMPLS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_paged_decode_low_precision(impl: str, dtype: torch.dtype) -> None:
    o, lse, ref_o, ref_lse = _decode_case(impl, [70, 0, 33], 8, 2, 64, 16, dtype, 0, 2, seed=7)
    assert o.dtype == dtype
    _check_decode(o, lse, ref_o, ref_lse, tol(dtype))


@pytest.mark.slow
def test_paged_decode_splits_agree() -> None:
    results = [
        _decode_case("triton", [150, 3, 64], 8, 2, 64, 16, torch.float32, 0, ns, seed=3)[:2]
        for ns in (1, 2, 5, 16)
    ]
    for o, lse in results[1:]:
        assert rel_err(o, results[0][0]) < 1e-6
        assert torch.allclose(lse, results[0][1], atol=1e-5, rtol=0)


def test_paged_decode_without_lse_and_out() -> None:
    k_cache, v_cache, table = _paged_setup(4, [40, 0], 2, 64, 16, torch.float32)
    q = torch.randn(2, 4, 64, device=DEVICE)
    sl = torch.tensor([40, 0], dtype=torch.int32, device=DEVICE)
    o = t_decode.paged_decode_attention(q, k_cache, v_cache, table, sl, 0.125, num_splits=2)
    ref_o, _ = reference.paged_attention_naive(
        q, k_cache, v_cache, table, [0, 1, 2], [40, 0], 0.125
    )
    assert isinstance(o, Tensor) and rel_err(o, ref_o) < FP32_TOL


@pytest.mark.usefixtures("poison_empty")
@pytest.mark.parametrize("impl", sorted(DECODE_IMPLS))
def test_paged_decode_all_empty(impl: str) -> None:
    o, lse, ref_o, ref_lse = _decode_case(impl, [0, 0], 4, 2, 64, 16, torch.float32, 0, 3)
    assert torch.isinf(ref_lse).all()
    _check_decode(o, lse, ref_o, ref_lse, FP32_TOL)


def test_pick_num_splits() -> None:
    # Big batches fill the GPU without splitting; one long sequence is split, capped by length.
    assert t_decode.pick_num_splits(256, 8, 32768, 64, 132) == 1
    assert t_decode.pick_num_splits(4, 8, 8192, 64, 132) == 16
    assert t_decode.pick_num_splits(1, 8, 512, 64, 132) == 4
    assert t_decode.pick_num_splits(1, 8, 1 << 20, 64, 132) == 64


@pytest.mark.parametrize("impl", sorted(DECODE_IMPLS))
def test_merge_attention_partials(impl: str) -> None:
    """Attention over tier A's keys merged with tier B's equals attention over both."""
    gen = torch.Generator().manual_seed(21)
    hq, hkv, dim, block = 8, 2, 64, 16
    # Tier A holds keys [0, len_a), tier B keys [len_a, full), both in the same paged cache:
    # len_a is block aligned, so tier B's table is the full table shifted by len_a / S.
    len_a, len_b = [16, 0, 32, 0], [45, 17, 0, 0]
    full = [a + b for a, b in zip(len_a, len_b, strict=True)]
    kc, vc, table = _paged_setup(22, full, hkv, dim, block, torch.float32)
    table_b = torch.stack([table[i].roll(-(n // block)) for i, n in enumerate(len_a)])
    q = randn(gen, len(full), hq, dim)
    outs = []
    for lens, tb in ((len_a, table), (len_b, table_b)):
        sl = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
        outs.append(DECODE_IMPLS[impl](q, kc, vc, tb, sl, 0.1, return_lse=True, num_splits=2))
    (o_a, l_a), (o_b, l_b) = outs
    o_a[torch.isinf(l_a)] = float("nan")  # an empty side's out must be ignored
    o, lse = reference.merge_attention_partials(o_a, l_a, o_b, l_b)
    ref_o, ref_lse = reference.paged_attention_naive(
        q, kc, vc, table, list(range(len(full) + 1)), full, 0.1
    )
    _check_decode(o, lse, ref_o, ref_lse, FP32_TOL)
    assert ops.merge_attention_partials is reference.merge_attention_partials


PREFILL_CASES = [
    # (query lens, seq_lens, hq, hkv, window)
    ([5, 12, 1], [5, 30, 17], 8, 2, 0),  # fresh prompt (causal path), chunk with context, decode
    ([7, 20], [40, 20], 4, 4, 6),  # sliding window, with and without context
    ([0, 9], [11, 9], 6, 3, 0),  # an idle sequence in the batch
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", range(len(PREFILL_CASES)))
def test_paged_prefill(dtype: torch.dtype, case: int) -> None:
    q_lens, seq_lens, hq, hkv, window = PREFILL_CASES[case]
    dim, block = 64, 8
    gen = torch.Generator().manual_seed(case)
    # The first query's window reaches back furthest; older blocks are poisoned.
    first_keys = [
        max(0, s - n - window + 1) if window else 0 for n, s in zip(q_lens, seq_lens, strict=True)
    ]
    k_cache, v_cache, table = _paged_setup(case, seq_lens, hkv, dim, block, dtype, first_keys)
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    q = randn(gen, qsl[-1], hq, dim, dtype=dtype)
    out = ops.paged_prefill_attention(q, k_cache, v_cache, table, qsl, seq_lens, 0.125, window)
    ref_o, _ = reference.paged_attention_naive(
        q, k_cache, v_cache, table, qsl, seq_lens, 0.125, window
    )
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert rel_err(out, ref_o) < tol(dtype)


# ----------------------------------------------------------------------------------------------
# dispatch


def test_ops_dispatch_cpu_uses_reference() -> None:
    gen = torch.Generator().manual_seed(3)
    x, res, w = (randn(gen, *shape, device="cpu") for shape in ((4, 32), (4, 32), (32,)))
    for got, exp in zip(
        ops.add_rms_norm(x, res, w, 1e-6), reference.add_rms_norm(x, res, w, 1e-6), strict=True
    ):
        assert torch.equal(got, exp)
    y = randn(gen, 3, 64, device="cpu")
    assert torch.equal(ops.silu_and_mul(y), reference.silu_and_mul(y))
    k_cache, v_cache, table = (t.cpu() for t in _paged_setup(1, [25, 0], 2, 32, 8, torch.float32))
    q = randn(gen, 2, 4, 32, device="cpu")
    sl = torch.tensor([25, 0], dtype=torch.int32)
    got_o, got_l = ops.paged_decode_attention(q, k_cache, v_cache, table, sl, 0.2, return_lse=True)
    exp_o, exp_l = reference.paged_decode_attention(
        q, k_cache, v_cache, table, sl, 0.2, return_lse=True
    )
    assert torch.equal(got_o, exp_o) and torch.equal(got_l, exp_l)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("num_splits", [1, 4, None])
def test_paged_decode_cuda_graph(num_splits: int | None) -> None:
    """Captured once, replayed with other seq_lens (0 included) and block tables."""
    hq, hkv, dim, block = 8, 2, 128, 16
    # Blocks past these lengths are poison; replays use lengths up to them.
    k_cache, v_cache, table = _paged_setup(31, [300, 20, 300, 40], hkv, dim, block, torch.bfloat16)
    gen = torch.Generator().manual_seed(32)
    q = randn(gen, 4, hq, dim, dtype=torch.bfloat16)
    sl = torch.tensor([300, 0, 77, 5], dtype=torch.int32, device=DEVICE)
    out = torch.empty_like(q)
    lse = torch.empty(4, hq, device=DEVICE)

    def step() -> None:
        _, l_ = ops.paged_decode_attention(
            q, k_cache, v_cache, table, sl, 0.09, out=out, return_lse=True, num_splits=num_splits
        )
        lse.copy_(l_)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for lens in ([300, 0, 77, 5], [0, 20, 300, 17], [0, 0, 0, 0]):
        sl.copy_(torch.tensor(lens, dtype=torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref_o, ref_lse = reference.paged_attention_naive(
            q, k_cache, v_cache, table, list(range(5)), lens, 0.09
        )
        _check_decode(out, lse, ref_o, ref_lse, LOW_TOL[torch.bfloat16])


def test_int8_codes_convert_to_float_exactly() -> None:
    # _load_kv_tile's int8 conversion without an I2F: every byte value, on the test device.
    import triton
    import triton.language as tl

    @triton.jit
    def _convert(c_ptr, out_ptr):
        i = tl.arange(0, 256)
        tl.store(out_ptr + i, int8_float(tl.load(c_ptr + i)))

    codes = torch.arange(-128, 128, dtype=torch.int8, device=DEVICE)
    out = torch.empty(256, dtype=torch.float32, device=DEVICE)
    _convert[(1,)](codes, out)
    assert torch.equal(out, codes.float())


def test_int8_words_convert_to_halves_exactly() -> None:
    # The folded int8 decode's codes: every byte value, four a word, to fp16 in byte order
    # (the PTX on the test device; the same bits by integer ops under the interpreter).
    import triton
    import triton.language as tl

    @triton.jit
    def _convert(w_ptr, out_ptr, ASM: tl.constexpr):
        i = tl.arange(0, 64)
        h = int8_words_half(tl.load(w_ptr + i), ASM)
        tl.store(out_ptr + 4 * i[:, None] + tl.arange(0, 4)[None, :], tl.reshape(h, (64, 4)))

    codes = torch.arange(-128, 128, dtype=torch.int8, device=DEVICE)
    out = torch.empty(256, dtype=torch.float16, device=DEVICE)
    _convert[(1,)](codes.view(torch.int32), out, ASM=DEVICE == "cuda")
    assert torch.equal(out, codes.half())


def test_u4_words_convert_to_halves_exactly() -> None:
    # The folded int4 decode's codes: words of eight nibbles (channel c in bits 4c..4c+3) to
    # fp16 in channel order, every nibble value in every position.
    import triton
    import triton.language as tl

    @triton.jit
    def _convert(w_ptr, out_ptr, ASM: tl.constexpr):
        i = tl.arange(0, 16)
        h = tl.reshape(int4_words_half(tl.load(w_ptr + i), ASM), (16, 8))
        tl.store(out_ptr + 8 * i[:, None] + tl.arange(0, 8)[None, :], h)

    codes = (torch.arange(16)[:, None] + torch.arange(8)[None, :]) % 16  # [word, channel]
    words = (codes << (4 * torch.arange(8))).sum(1).to(torch.uint32).view(torch.int32)
    out = torch.empty(128, dtype=torch.float16, device=DEVICE)
    _convert[(1,)](words.to(DEVICE), out, ASM=DEVICE == "cuda")
    assert torch.equal(out.cpu(), codes.flatten().half())
