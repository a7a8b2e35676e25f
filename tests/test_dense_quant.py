"""Weight-only int8 / int4 dense layers: the formats, GGUF repacking, and the fused Triton
kernel (CPU interpreter) against a float64 reference on fresh random inputs."""

from __future__ import annotations

from dataclasses import replace
from fractions import Fraction

import gguf
import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from hybridgen.kernels import ops, reference, split_counters, triton_activation, triton_dense_quant
from hybridgen.kernels.rope_write import RopeWrite
from hybridgen.kernels.triton_dense_quant import Tiles
from hybridgen.models.dense_quant import (
    QuantLinear,
    QuantWeight,
    choose_gemv,
    from_gguf_blocks,
    pack_int4,
    quantize,
    unpack_int4,
)

torch.manual_seed(0)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = x.double() @ w.double().T
    return y if bias is None else y + bias.double()


def _weight(fmt: str, n: int, k: int) -> QuantWeight:
    """A fresh random weight in `fmt`: int4 with K not a multiple of its group of 64 comes as
    GGUF Q4_1 blocks (groups of 32), as a file's would."""
    w = torch.randn(n, k) * 0.05
    if fmt == "int8" or k % 64 == 0:
        return quantize(w, fmt).to(DEVICE)  # type: ignore[arg-type]
    qw = from_gguf_blocks("Q4_1", gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType.Q4_1))
    assert qw is not None
    return qw.to(DEVICE)


def _check(qw: QuantWeight, t: int, dtype: torch.dtype, bias: bool, tiles=None) -> None:  # type: ignore[no-untyped-def]
    n, k = qw.shape
    x = torch.randn(t, k, device=DEVICE, dtype=dtype)
    b = torch.randn(n, device=DEVICE) if bias else None
    got = triton_dense_quant.quant_linear(
        x, qw.fmt, qw.codes, qw.scale, qw.zero, qw.group, b, tiles
    )
    # The reference multiplies x in its dtype by the exact dequantized weight (the GEMV keeps
    # it in fp32; the GEMM rounds it to x's dtype for the tensor cores: within tolerance).
    want = _reference(x, qw.dequantize(torch.float32), b)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert got.dtype == dtype and got.shape == (t, n)
    assert (got.double() - want).abs().max() < tol * (1 + want.abs().max())


# N = 72 and 130 are no multiple of any BLOCK_N; K = 4096 (llama3-8b's hidden) splits evenly,
# K = 1184 (37 runs) into a short last tile and slices of unequal length. Under one program
# per SM (the interpreter assumes the H200's 132) the default tiles split K.
SHAPES = [(1, 72, 4096), (1, 40, 1184), (3, 72, 4096), (3, 40, 1184), (16, 72, 1184)]
SHAPES += [(17, 72, 4096), (100, 130, 1184), (130, 72, 1184)]  # 130 rows: dequantized


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize(("t", "n", "k"), SHAPES)
def test_kernel_matches_float64(
    fmt: str, t: int, n: int, k: int, dtype: torch.dtype, bias: bool
) -> None:
    _check(_weight(fmt, n, k), t, dtype, bias)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize(
    "tiles",
    [
        Tiles(1, 8, 128, 4, 2, split=1),
        Tiles(1, 16, 256, 4, 2, split=3),
        Tiles(16, 16, 64, 4, 2, split=1),
        Tiles(16, 32, 128, 4, 2, split=4),
        Tiles(64, 64, 128, 4, 2, split=2),
    ],
)
def test_kernel_tiles_and_splits(fmt: str, tiles: Tiles) -> None:
    """Every path and explicit splits (also past the K tiles: no empty slice is launched)
    against the reference; T = 5 runs the GEMV once per row."""
    _check(_weight(fmt, 24, 1184), 5, torch.bfloat16, True, tiles)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_prefill_dequantizes_slab_by_slab(fmt: str, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """From DEQUANT_MIN_ROWS rows the weight is dequantized to x's dtype, a slab of rows at a
    time (here 64 rows: N = 200 takes four, the last short), exactly as the GEMM's tiles
    compute it, and multiplied by torch: against the reference; and the dequantized rows
    are the format's own dequantization (to fp32 rounding: the device may fuse the scale's
    multiply and the zero's add)."""
    qw = _weight(fmt, 200, 1184)
    monkeypatch.setattr(triton_dense_quant, "DEQUANT_SLAB_BYTES", 64 * 1184 * 2)
    calls: list[int] = []
    dequantize = triton_dense_quant.dequantize

    def counted(*args):  # type: ignore[no-untyped-def]
        out = dequantize(*args)
        calls.append(out.shape[0])
        return out

    monkeypatch.setattr(triton_dense_quant, "dequantize", counted)
    _check(qw, triton_dense_quant.DEQUANT_MIN_ROWS, torch.bfloat16, True)
    assert calls == [64, 64, 64, 8]
    out = torch.empty(201, 1184, device=DEVICE)  # a row more than the weight's: left alone
    out[200] = 7.0
    w = dequantize(qw.fmt, qw.codes, qw.scale, qw.zero, qw.group, out)
    assert w.shape == (200, 1184) and bool((out[200] == 7.0).all())
    torch.testing.assert_close(w, qw.dequantize(torch.float32), rtol=1e-6, atol=1e-9)


def test_split_k_fills_the_device() -> None:
    """A grid under one program per SM splits K for ~2 per SM, in slices of >= 2 tiles; a
    whole grid does not split."""
    assert triton_dense_quant.split_k(512, 4096, 1024, 132) == 1
    assert triton_dense_quant.split_k(132, 4096, 1024, 132) == 1
    assert triton_dense_quant.split_k(64, 14336, 512, 132) == 5
    assert triton_dense_quant.split_k(9, 4096, 1024, 132) == 2  # 2 slices of 2 tiles
    assert triton_dense_quant.split_k(9, 576, 1024, 132) == 1
    assert triton_dense_quant.tiles_for(1, "int4").block_m == 1  # decode: the GEMV
    assert triton_dense_quant.tiles_for(512, "int4").block_m == 128


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("x_bytes", [2, 4])
@pytest.mark.parametrize("t", [1, 16, 64, 100, 512])
def test_default_tiles_fit_shared_memory(fmt: str, x_bytes: int, t: int) -> None:
    """Every default GEMM tile's pipeline fits the H200's shared memory: fp32 activations
    in 128-row int8 tiles at 3 stages asked for 233,472 bytes of 232,448 there (Triton's
    OutOfResources at a 100-token step); bf16 keeps its 3 stages."""
    tiles = triton_dense_quant.tiles_for(t, fmt, x_bytes)
    if tiles.block_m > 1:
        need = triton_dense_quant.stage_bytes(tiles, fmt, x_bytes) * tiles.num_stages
        assert need <= triton_dense_quant.SHARED_MEMORY_BYTES
    if x_bytes == 2:
        assert tiles.num_stages == 3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("split", [None, 4])
@pytest.mark.parametrize("fmt", ["int8", "int4", "int4 words", "int4 mma"])
def test_decode_kernel_in_a_cuda_graph(fmt: str, split: int | None) -> None:
    """The decode path (and a split-K one, its partials summed by torch, or by the last slice
    in the tensor-core GEMV) captured in a CUDA graph replays with new inputs as it runs
    eagerly; `int4 words` the word GEMV, `int4 mma` the tensor-core one. CPU twins:
    test_kernel_tiles_and_splits, test_word_gemv_matches_float64, test_mma_gemv_*."""
    kernel = fmt.split()[1] if " " in fmt else None
    fmt = fmt.split()[0]
    qw = _weight(fmt, 4096, 4096)
    base = triton_dense_quant.tiles_for(1, fmt, 2, bf16=kernel == "words")
    tiles = replace(MMA if kernel == "mma" else base, split=split)
    x = torch.randn(1, 4096, device=DEVICE, dtype=torch.bfloat16)

    def run() -> torch.Tensor:
        return triton_dense_quant.quant_linear(
            x, qw.fmt, qw.codes, qw.scale, qw.zero, qw.group, None, tiles
        )

    run()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = run()
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, run())


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
def test_gguf_blocks_repack_exactly(qtype: str) -> None:
    """The repacked weight dequantizes to exactly gguf-py's values (what transformers loads)."""
    w = np.random.default_rng(1).standard_normal((8, 256)).astype(np.float32) * 0.1
    kind = gguf.GGMLQuantizationType[qtype]
    blocks = gguf.quants.quantize(w, kind)
    qw = from_gguf_blocks(qtype, blocks)
    assert qw is not None
    expected = torch.from_numpy(gguf.quants.dequantize(blocks, kind))
    assert torch.equal(qw.dequantize(torch.float32), expected)


@pytest.mark.parametrize(("fmt", "bound"), [("int8", 0.01), ("int4", 0.1)])
def test_quantize_error_is_bounded(fmt: str, bound: float) -> None:
    w = torch.randn(64, 512)
    err = (quantize(w, fmt).dequantize(torch.float32) - w).norm() / w.norm()
    assert err < bound


@pytest.mark.parametrize(("qtype", "fmt"), [("Q4_0", "int4"), ("Q4_1", "int4"), ("Q8_0", "int8")])
def test_repacked_gguf_gives_the_native_tokens(tmp_path, monkeypatch, qtype: str, fmt: str) -> None:  # type: ignore[no-untyped-def]
    """A GGUF's Q4_0/Q4_1/Q8_0 blocks repacked hold exactly the dequantized values, so the
    int4/int8 engine decodes as the native one (CPU, fp32); weights.format is honoured."""
    from hybridgen.config.file import parse_config
    from hybridgen.engine.engine import Engine
    from hybridgen.models.dense_quant import QuantLinear
    from hybridgen.sampling.params import SamplingParams
    from tests.test_gguf import _prompts, tiny_gguf

    path = tiny_gguf(tmp_path, "llama3", qtype)
    prompts = _prompts(path)
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    yaml = {"model": {"name_or_path": str(path)}, "weights": {"format": fmt}}
    config = parse_config(yaml).engine_config("cpu")
    quant = Engine(config)
    modules = [m for m in quant.loaded.model.modules() if isinstance(m, QuantLinear)]
    assert len(modules) == 2 * 4 and all(m.fmt == fmt and m.group == 32 for m in modules)
    native = Engine(parse_config({"model": {"name_or_path": str(path)}}).engine_config("cpu"))
    want = [c.token_ids for c in native.generate(prompts, greedy)]
    asked: set[str] = set()
    real = ops.quant_dense_linear

    def spy(x, w, bias=None, tiles=None, swiglu=False, rope=None):  # type: ignore[no-untyped-def]
        asked.add("swiglu" if swiglu else "rope" if rope is not None else "plain")
        return real(x, w, bias, tiles, swiglu, rope)

    monkeypatch.setattr(ops, "quant_dense_linear", spy)
    assert [c.token_ids for c in quant.generate(prompts, greedy)] == want
    # qkv takes RoPE and the cache write, gate_up SwiGLU (kernel epilogues on CUDA); o, down
    assert asked == {"rope", "swiglu", "plain"}


def test_engine_bench_runs_int4_weights(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The B1 int4 command's flag reaches the engine (tiny-llama on the CPU)."""
    import json

    from hybridgen.benchmarks import engine_bench

    out = tmp_path / "b1.json"
    engine_bench.main(
        [
            "--model",
            "tiny-llama",
            "--weights-format",
            "int4",
            "--batches",
            "1",
            "--prompt-len",
            "8",
            "--new-tokens",
            "4",
            "--runs",
            "1",
            "--out",
            str(out),
        ]
    )
    result = json.loads(out.read_text())
    assert result["config"]["weights_format"] == "int4"
    assert result["ours"]["1"]["decode_tok_s"] > 0


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quantize_in_row_chunks_is_exact(fmt: str) -> None:
    """Quantizing a few rows at a time (bounded temporaries) gives the very same weight."""
    w = torch.randn(10, 128)
    whole, chunked = quantize(w, fmt), quantize(w, fmt, chunk_bytes=3 * 128 * 4)  # type: ignore[arg-type]
    for a, b in [(whole.codes, chunked.codes), (whole.scale, chunked.scale)]:
        assert torch.equal(a, b)
    assert whole.zero is None or torch.equal(whole.zero, chunked.zero)  # type: ignore[arg-type]


def _check_words(
    qw: QuantWeight,
    t: int,
    bias: bool,
    split: int | None,
    block_n: int = 8,
    base: triton_dense_quant.Tiles = triton_dense_quant.WORD_GEMV_TILES,
) -> torch.Tensor:
    """The int4 word GEMV (or another bf16 GEMV on the words, `base`) against float64, element
    by element within one bf16 step of the result (a mapping of a nibble to the wrong input
    is off by ~|w x|, many steps)."""
    n, k = qw.shape
    x = torch.randn(t, k, device=DEVICE, dtype=torch.bfloat16)
    x[x.abs() > 2] *= 8  # outliers
    b = torch.randn(n, device=DEVICE) if bias else None
    tiles = replace(base, split=split, block_n=block_n)
    got = triton_dense_quant.quant_linear(
        x, qw.fmt, qw.codes, qw.scale, qw.zero, qw.group, b, tiles
    )
    want = _reference(x, qw.dequantize(torch.float32), b)
    assert got.dtype == torch.bfloat16 and got.shape == (t, n)
    bound = want.abs() / 128 + 1e-4 * want.abs().max()
    assert ((got.double() - want).abs() <= bound).all()
    return got


# N = 13 and 40 are no multiple of BLOCK_N (8: 13 leaves 3 rows of the last program); K =
# 4096 and 2048 fill whole 2048-input tiles, 1184 (37 runs) and 2080 end in a part tile.
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("split", [None, 1, 3])
@pytest.mark.parametrize(("t", "n", "k"), [(1, 40, 4096), (1, 13, 1184), (2, 13, 2080)])
def test_word_gemv_matches_float64(t: int, n: int, k: int, split: int | None, bias: bool) -> None:
    _check_words(_weight("int4", n, k), t, bias, split)


@pytest.mark.parametrize("split", [None, 2])
def test_word_gemv_16_rows(split: int | None) -> None:
    """16 rows a thread (the benchmark's `new16`), N = 40 ending in a part program."""
    _check_words(_weight("int4", 40, 2080), 1, True, split, block_n=16)


@pytest.mark.parametrize("group", [32, 64, 128, 2048])
def test_word_gemv_groups(group: int) -> None:
    """Any group of whole runs: a scale and zero a run (32, GGUF's), a group of several runs
    (64, the quantizer's; 128), and one as long as a whole tile (2048); zeros near -8 scale
    (Q4_0's) make s * sum(c x) and z * sum(x) nearly cancel."""
    n, k = 24, 4096
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    scale = (torch.rand(n, k // group) * 0.01 + 1e-3).half()
    zero = (-8 * scale.float() + torch.randn(n, k // group) * 1e-3).half()
    qw = QuantWeight("int4", pack_int4(codes), scale, zero, group).to(DEVICE)
    _check_words(qw, 1, False, None)


MMA = triton_dense_quant.MMA_GEMV_TILES


# N = 70 ends in a part program of 64 rows; K = 1184 (37 runs) and 2080 end in a part tile of
# 512 inputs, 4096 fills whole ones. Slow as a set (18 cases); the fast subset keeps the
# groups, the in-kernel split sum and 128 rows below.
@pytest.mark.slow
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("split", [None, 1, 3])
@pytest.mark.parametrize(("t", "n", "k"), [(1, 64, 4096), (1, 70, 1184), (2, 13, 2080)])
def test_mma_gemv_matches_float64(t: int, n: int, k: int, split: int | None, bias: bool) -> None:
    """The tensor-core GEMV (`_int4_gemv_mma`): each group's sum of (128 + code) x by one dot
    against x's block diagonal, scale and zero after."""
    _check_words(_weight("int4", n, k), t, bias, split, block_n=64, base=MMA)


def test_mma_gemv_128_rows() -> None:
    """The benchmark's `mma128`: 128 rows a program over 8 warps, N = 200 ending in a part."""
    _check_words(_weight("int4", 200, 2048), 1, True, None, block_n=128, base=MMA)


@pytest.mark.parametrize("group", [32, 64, 128, 2048])
def test_mma_gemv_groups(group: int) -> None:
    """16 groups of 32 a tile (GGUF's), 8 of 64, 4 of 128, and one group over four tiles;
    zeros near -8 scale (Q4_0's) make the terms nearly cancel."""
    n, k = 24, 4096
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    scale = (torch.rand(n, k // group) * 0.01 + 1e-3).half()
    zero = (-8 * scale.float() + torch.randn(n, k // group) * 1e-3).half()
    qw = QuantWeight("int4", pack_int4(codes), scale, zero, group).to(DEVICE)
    _check_words(qw, 1, False, None, block_n=64, base=MMA)


def test_mma_gemv_sums_its_splits_in_the_kernel() -> None:
    """K in 5 slices: the last slice of each row block to finish sums the partials in slice
    order (no extra launch), so two calls agree bit for bit, equal the same kernel unsplit
    to fp32 rounding, and leave every split counter at zero for the next launch."""
    qw = _weight("int4", 70, 2560)
    x = torch.randn(2, 2560, device=DEVICE, dtype=torch.bfloat16)
    b = torch.randn(70, device=DEVICE)

    def run(split: int) -> torch.Tensor:
        tiles = replace(MMA, split=split)
        return triton_dense_quant.quant_linear(
            x, "int4", qw.codes, qw.scale, qw.zero, qw.group, b, tiles
        )

    first, again, whole = run(5), run(5), run(1)
    assert torch.equal(first, again)
    assert torch.allclose(first.float(), whole.float(), rtol=1e-2, atol=1e-3)
    assert not split_counters.counters(x.device, 1).any()


DP4A = triton_dense_quant.DP4A_GEMV_TILES


def _check_dp4a(
    qw: QuantWeight, x: torch.Tensor, bias: bool, split: int | None, block_n: int = 8
) -> None:
    """The int8-activation GEMV against float64 of its own math (each run of x rounded to
    int8, `reference.int8_runs`, times the codes and scales; the zeros times x itself),
    element by element within one bf16 step of the result; and that math within the rounding
    of x (half a step of its run's scale an input) of the exact product."""
    t, k = x.shape
    n = qw.shape[0]
    b = torch.randn(n, device=DEVICE) if bias else None
    tiles = replace(DP4A, split=split, block_n=block_n)
    got = triton_dense_quant.quant_linear(
        x, qw.fmt, qw.codes, qw.scale, qw.zero, qw.group, b, tiles
    )
    assert got.dtype == torch.bfloat16 and got.shape == (t, n)
    assert qw.zero is not None
    cs = unpack_int4(qw.codes).double() * qw.scale.double().repeat_interleave(qw.group, 1)
    z = qw.zero.double().repeat_interleave(qw.group, 1)
    want = reference.int8_runs(x).double() @ cs.T + x.double() @ z.T
    want = want if b is None else want + b.double()
    bound = want.abs() / 128 + 1e-4 * want.abs().max()
    assert ((got.double() - want).abs() <= bound).all()
    exact = _reference(x, qw.dequantize(torch.float32), b)
    step = x.double().view(t, k // 32, 32).abs().amax(-1).repeat_interleave(32, 1) / 127
    assert ((want - exact).abs() <= (step / 2) @ cs.abs().T * 1.001 + 1e-6).all()


def _x(t: int, k: int) -> torch.Tensor:
    x = torch.randn(t, k, device=DEVICE, dtype=torch.bfloat16)
    x[x.abs() > 2] *= 8  # outliers: their runs round coarsely
    return x


# As the word GEMV's: N = 13 and 40 no multiple of 8, K = 4096 whole 2048-input tiles, 2112
# (66 runs) a part tile; T = 2 two rows of x, each its own rounding.
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("split", [None, 1, 3])
@pytest.mark.parametrize(("t", "n", "k"), [(1, 40, 4096), (2, 13, 2112)])
def test_dp4a_gemv_matches_its_int8_math(
    t: int, n: int, k: int, split: int | None, bias: bool
) -> None:
    """Split 3 gives K = 4096 slices of one tile each and 2112 a part slice: each slice's
    prefetch of the tile after it loads nothing."""
    _check_dp4a(_weight("int4", n, k), _x(t, k), bias, split)


def test_dp4a_gemv_16_rows_and_zero_runs() -> None:
    """16 rows a thread (the benchmark's `dp4a16`), N = 40 ending in a part program; a run of
    x all zero (scale 0: no division by it) and a row of x all zero (y = the bias)."""
    x = _x(2, 2112)
    x[0, 64:96] = 0
    x[1] = 0
    qw = _weight("int4", 40, 2112)
    _check_dp4a(qw, x, True, 2, block_n=16)
    b = torch.randn(40, device=DEVICE)
    y = triton_dense_quant.quant_linear(x, "int4", qw.codes, qw.scale, qw.zero, 64, b, DP4A)
    assert ((y[1].float() - b).abs() <= b.abs() / 128).all()  # one bf16 step


@pytest.mark.parametrize("group", [32, 128, 2048])
def test_dp4a_gemv_groups(group: int) -> None:
    """A scale and zero a run (GGUF's), a group of several runs, one as long as a tile; zeros
    near -8 scale (Q4_0's) make s d sum(c q) and z sum(x) nearly cancel."""
    n, k = 24, 4096
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    scale = (torch.rand(n, k // group) * 0.01 + 1e-3).half()
    zero = (-8 * scale.float() + torch.randn(n, k // group) * 1e-3).half()
    qw = QuantWeight("int4", pack_int4(codes), scale, zero, group).to(DEVICE)
    _check_dp4a(qw, _x(1, k), False, None)


def test_int8_runs_rounds_each_run_to_its_own_scale() -> None:
    """reference.int8_runs: 127 steps of max |x| / 127 a run, ties to even, a zero run zero."""
    x = torch.zeros(1, 96)
    x[0, :32] = torch.arange(32) - 16.0  # max 16: step 16 / 127
    x[0, 32] = 127.0  # a run of one value and zeros: exact
    got = reference.int8_runs(x)
    assert torch.allclose(got[0, :32], torch.round(x[0, :32] * 127 / 16) * (16 / 127))
    assert torch.equal(got[0, 32:], x[0, 32:])


def _ulp32(x: Fraction) -> Fraction:
    """The fp32 step at x > 0 (normal range): 2^(e - 23) for x in [2^e, 2^(e + 1))."""
    e = x.numerator.bit_length() - x.denominator.bit_length()  # e or e + 1
    return Fraction(2) ** (e - 24 if x < Fraction(2) ** e else e - 23)


def _rn32(x: Fraction) -> Fraction:
    """x rounded to the nearest fp32 (ties to even; x in the normal range, or zero)."""
    if x <= 0:
        return -_rn32(-x) if x else x
    m = x / _ulp32(x)  # in [2^23, 2^24)
    fl, rem = divmod(m.numerator, m.denominator)
    if 2 * rem > m.denominator or (2 * rem == m.denominator and fl % 2):
        fl += 1
    return fl * _ulp32(x)


def _div_127_steps(b: Fraction, y: Fraction) -> tuple[Fraction, Fraction]:
    """triton_dense_quant._div_127's PTX in exact arithmetic, each fma or mul rounded once,
    from y, the reciprocal's approximation: (the refined reciprocal, the quotient)."""
    y = _rn32(_rn32(1 - b * y) * y + y)  # fma(-b, y, 1), then fma(e, y, y)
    q = _rn32(127 * y)
    r = _rn32(127 - b * q)  # fma(-b, q, 127)
    return y, _rn32(r * y + q)  # fma(r, y, q)


def test_div_127_steps_round_as_a_true_quotient() -> None:
    """The int8-activation GEMV's run scale 127 / max |x| without div.rn's branch: for every
    bf16 mantissa of max |x| (x is bf16), 1e-30 (the floor) and random fp32 ones, whatever
    the device's reciprocal within 8 ulp of 1 / b, the steps give the nearest fp32 to 127 / b
    (what torch divides in reference.int8_runs). The refined reciprocal is within an ulp of
    1 / b, the premise of Markstein's theorem that one correction then rounds the quotient
    correctly for every b, not only those tried here."""
    gen = np.random.default_rng(0)
    mantissas = [1 + Fraction(m, 128) for m in range(128)]
    mantissas += [1 + Fraction(int(m), 1 << 23) for m in gen.integers(0, 1 << 23, 200)]
    for b in [*mantissas, Fraction(float(np.float32(1e-30)))]:
        want = _rn32(127 / b)
        y0 = _rn32(1 / b)
        ulp = _ulp32(y0)
        for k in range(-8, 9):
            y, q = _div_127_steps(b, y0 + k * ulp)
            assert abs(y - 1 / b) <= ulp and q == want, (b, k)


@triton.jit
def _div_127_kernel(b_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    b = tl.load(b_ptr + i, mask=ok, other=1.0)
    tl.store(out_ptr + i, triton_dense_quant._div_127(b, not triton_dense_quant.INTERPRETED), ok)


def test_div_127_on_the_device_equals_torchs_quotient() -> None:
    """The PTX itself (on CUDA; the interpreter divides in numpy): every bf16 value of
    2^-30 .. 2^30, 1e-30 and random fp32 values give torch's 127 / b bit for bit."""
    bf16 = torch.arange(0x3080, 0x4E80, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    b = torch.cat([bf16.float(), torch.tensor([1e-30]), torch.rand(4096) * 1e3 + 1e-6])
    b = b.to(DEVICE)
    got = torch.empty_like(b)
    _div_127_kernel[(triton.cdiv(len(b), 1024),)](b, got, len(b), BLOCK=1024)
    assert torch.equal(got, torch.full_like(b, 127.0) / b)


def test_word_gemv_split_is_deterministic() -> None:
    """Split-K partials are summed in a fixed order: the same output on every call."""
    qw = _weight("int4", 16, 4096)
    x = torch.randn(1, 4096, dtype=torch.bfloat16, device=DEVICE)
    tiles = replace(triton_dense_quant.WORD_GEMV_TILES, split=2)
    runs = [
        triton_dense_quant.quant_linear(x, "int4", qw.codes, qw.scale, qw.zero, 64, None, tiles)
        for _ in range(3)
    ]
    assert torch.equal(runs[0], runs[1]) and torch.equal(runs[1], runs[2])


def test_word_gemv_is_the_bf16_decode_default() -> None:
    """int4 at T = 1 with bf16 activations takes the word GEMV; fp32 activations, int8 and
    several rows keep their kernels."""
    assert triton_dense_quant.tiles_for(1, "int4", 2, bf16=True).words
    assert not triton_dense_quant.tiles_for(1, "int4", 4).words
    assert not triton_dense_quant.tiles_for(1, "int8", 2, bf16=True).words
    assert not triton_dense_quant.tiles_for(3, "int4", 2, bf16=True).words


def _int4_model(shapes: list[tuple[int, int]], layers: int) -> torch.nn.ModuleList:
    """`layers` copies of int4 projections of `shapes` (N, K), on DEVICE."""
    return torch.nn.ModuleList(
        QuantLinear(_weight("int4", n, k), None) for _ in range(layers) for n, k in shapes
    )


def test_choose_gemv_by_fake_timings(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """choose_gemv's choice on the CPU (the projections made to look on CUDA, the timer
    faked): each shape's projections, every layer's timed in one pass, take the faster
    kernel; fp32 activations choose nothing. QuantLinear passes its tiles at one row only."""
    model = _int4_model([(64, 256), (32, 512), (16, 128)], layers=3)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    seen: list[tuple[str, int]] = []
    # Seconds a pass by kernel, per shape's N: each shape has another fastest.
    fake = {
        64: {"words": 2.0, "mma": 1.0, "dp4a": 1.5},
        32: {"words": 2.0, "mma": 3.0, "dp4a": 2.5},
        16: {"words": 2.0, "mma": 3.0, "dp4a": 1.0},
    }

    def timer(tiles: Tiles, modules: list[QuantLinear]) -> float:
        name = "mma" if tiles.mma else "dp4a" if tiles.dp4a else "words"
        seen.append((name, len(modules)))
        return fake[modules[0].out_features][name]

    assert choose_gemv(model, torch.float32, timer) == {}
    chosen = choose_gemv(model, torch.bfloat16, timer)
    assert chosen == {
        (64, 256, 64): ("mma", fake[64]),
        (32, 512, 64): ("words", fake[32]),
        (16, 128, 64): ("dp4a", fake[16]),
    }
    assert sorted(seen) == sorted((name, 3) for name in fake[64] for _ in range(3))
    assert [(m.gemv.mma, m.gemv.dp4a) for m in model] == [  # type: ignore[union-attr]
        (True, False),
        (False, False),
        (False, True),
    ] * 3
    monkeypatch.undo()

    calls: list[Tiles | None] = []

    def record(x, w, bias=None, tiles=None, swiglu=False, rope=None):  # type: ignore[no-untyped-def]
        calls.append(tiles)
        return torch.zeros(x.shape[0], w.shape[0])

    monkeypatch.setattr(ops, "quant_dense_linear", record)
    model[0](torch.randn(1, 256))
    model[0](torch.randn(2, 256))
    assert calls == [triton_dense_quant.MMA_GEMV_TILES, None]


def test_gemv_fits_the_tensor_core_kernels_groups() -> None:
    """The tensor-core GEMV takes 1 to 16 whole groups a 512-input tile, or a group of whole
    tiles; the word GEMV any group of whole runs."""
    mma, words = triton_dense_quant.MMA_GEMV_TILES, triton_dense_quant.WORD_GEMV_TILES
    assert [triton_dense_quant.gemv_fits(mma, g) for g in (32, 64, 512, 1024)] == [True] * 4
    assert not triton_dense_quant.gemv_fits(mma, 96)  # no whole number a tile
    assert not triton_dense_quant.gemv_fits(replace(mma, block_k=1024), 32)  # 32 groups
    assert triton_dense_quant.gemv_fits(words, 96)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="times the kernels on a GPU")
def test_int4_model_on_cuda_chooses_and_keeps_its_logits() -> None:
    """A tiny llama loaded with int4 weights on CUDA: every device projection has a timed
    choice, and the logits of one decode row equal those with the default kernel to bf16
    rounding. CPU twin: test_choose_gemv_by_fake_timings."""
    from hybridgen.models.loader import load_model

    loaded = load_model("tiny-llama", torch.device("cuda"), weights="int4")
    linears = [m for m in loaded.model.modules() if isinstance(m, QuantLinear)]
    assert linears and all(m.gemv is not None for m in linears)
    for m in linears:
        x = torch.randn(1, m.in_features, device="cuda", dtype=torch.bfloat16)
        chosen = m(x)
        m.gemv = None
        default = m(x)
        assert torch.allclose(chosen.float(), default.float(), rtol=2e-2, atol=2e-2)


WORDS = triton_dense_quant.WORD_GEMV_TILES


@pytest.mark.parametrize(
    ("tiles", "t", "n", "k"),
    [
        (replace(DP4A, split=1), 1, 2 * 52, 2112),  # 52 outputs: the last program half past
        (replace(WORDS, split=1), 1, 2 * 40, 4096),
        (replace(DP4A, block_n=16, split=1), 2, 2 * 13, 4096),
        (replace(DP4A, split=3), 1, 2 * 40, 4096),  # split: the epilogue cannot; after it
        (None, 3, 2 * 40, 1184),  # the GEMM's tiles: after it
    ],
)
def test_swiglu_equals_the_projection_then_silu_and_mul(
    tiles: Tiles | None, t: int, n: int, k: int
) -> None:
    """silu(gate) * up of a fused [gate | up] weight: computed in the one-row kernels'
    epilogue (each program's rows alternate gate and up) or by the activation kernel after
    the projection, it equals the two kernels one after the other bit for bit."""
    qw = _weight("int4", n, k)
    x = _x(t, k)
    args = (x, qw.fmt, qw.codes, qw.scale, qw.zero, qw.group, None, tiles)
    got = triton_dense_quant.quant_linear(*args, swiglu=True)
    want = triton_activation.silu_and_mul(triton_dense_quant.quant_linear(*args))
    assert got.shape == (t, n // 2) and got.dtype == torch.bfloat16
    assert torch.equal(got, want)
    if tiles is not None and tiles.words:  # right, not merely the same twice
        exact = reference.silu_and_mul(_reference(x, qw.dequantize(torch.float32), None).float())
        assert (got.double() - exact.double()).abs().max() < 2e-2 * exact.abs().max()


def test_a_quantized_mlp_asks_its_gate_up_for_silu_and_mul(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The MLP of int4 weights hands SwiGLU to its gate_up projection (on CUDA one kernel:
    no silu_and_mul launch a layer) and gets what the projection then silu_and_mul give."""
    from hybridgen.models.llama import MLP
    from hybridgen.models.presets import PRESETS

    spec = replace(PRESETS["tiny-llama"], hidden_size=64, intermediate_size=128)
    mlp = MLP(spec)
    mlp.gate_up_proj = QuantLinear(quantize(torch.randn(256, 64) * 0.05, "int4"), None)
    mlp.down_proj = QuantLinear(quantize(torch.randn(64, 128) * 0.05, "int4"), None)
    x = torch.randn(3, 64)
    gate_up = mlp.gate_up_proj(x)
    want = mlp.down_proj(ops.silu_and_mul(gate_up))
    asked: list[bool] = []
    real = ops.quant_dense_linear

    def spy(x, w, bias=None, tiles=None, swiglu=False, rope=None):  # type: ignore[no-untyped-def]
        asked.append(swiglu)
        return real(x, w, bias, tiles, swiglu, rope)

    monkeypatch.setattr(ops, "quant_dense_linear", spy)
    monkeypatch.setattr(ops, "silu_and_mul", lambda x: pytest.fail("a silu_and_mul of its own"))
    assert torch.equal(mlp(x), want)
    assert asked == [True, False]


@pytest.mark.parametrize(
    ("tiles", "t", "bias"),
    [
        (replace(DP4A, split=1), 1, False),
        (replace(WORDS, split=1), 2, True),  # qwen2's qkv bias; two tokens, one padding
        (replace(DP4A, block_n=16, split=1), 2, False),
        (replace(DP4A, split=3), 1, False),  # split: the epilogue cannot; rope after
    ],
)
def test_rope_epilogue_equals_the_projection_then_rope_and_cache(
    tiles: Tiles, t: int, bias: bool
) -> None:
    """A fused qkv's one-row kernel rotates q and k and writes k and v to the cache in its
    epilogue (each program's rows pair a head's d and d + half): q and both caches equal the
    projection then triton_rope_cache's kernel bit for bit, a padding slot (-1) writes
    nothing, and every other cache row keeps its bytes."""
    heads, kv_heads, dim, block, blocks = 4, 2, 64, 4, 6
    n = (heads + 2 * kv_heads) * dim
    qw = _weight("int4", n, 2112)
    x = _x(t, 2112)
    b = torch.randn(n, device=DEVICE) if bias else None
    gen = torch.Generator().manual_seed(7)
    cos = torch.randn(40, dim, generator=gen).to(DEVICE)
    sin = torch.randn(40, dim, generator=gen).to(DEVICE)
    caches = [torch.randn(blocks, block, kv_heads, dim, generator=gen) for _ in range(2)]
    positions = torch.tensor([17, 3][:t], device=DEVICE)
    slots = torch.tensor([9, -1][:t], device=DEVICE)

    def run(fused: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        k_cache, v_cache = (c.to(DEVICE, torch.bfloat16) for c in caches)
        rope = RopeWrite(positions, cos, sin, k_cache, v_cache, slots, heads, kv_heads)
        args = (x, qw.fmt, qw.codes, qw.scale, qw.zero, qw.group, b, tiles)
        if fused:
            q = triton_dense_quant.quant_linear(*args, rope=rope)
        else:
            q = triton_dense_quant._after(triton_dense_quant.quant_linear(*args), False, rope)
        return q, k_cache, v_cache

    (q, k_cache, v_cache), (q2, k2, v2) = run(True), run(False)
    assert q.shape == (t, heads, dim)
    assert torch.equal(q, q2) and torch.equal(k_cache, k2) and torch.equal(v_cache, v2)
    written = torch.zeros(blocks * block, dtype=torch.bool)
    written[9] = True
    for cache, before in zip((k_cache, v_cache), caches, strict=True):
        kept = cache.flatten(0, 1)[~written].cpu()
        assert torch.equal(kept, before.to(torch.bfloat16).flatten(0, 1)[~written])
        assert not torch.equal(cache.flatten(0, 1)[9].cpu(), before.flatten(0, 1)[9].bfloat16())


@pytest.mark.slow
@pytest.mark.skipif(DEVICE != "cpu", reason="the interpreter's twin of the CUDA engine path")
def test_an_int4_engine_decodes_through_the_epilogues_as_without_them(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The whole decode path as CUDA runs it (every op's Triton kernel, under the interpreter:
    `ops._use_triton` says yes), tiny-llama with int4 weights in bf16: a decode step's qkv
    and gate_up take their epilogues (the kernels after them never run at one row), and
    the greedy tokens are those of the same kernels with the epilogues run apart."""
    from hybridgen.config.engine import EngineConfig
    from hybridgen.engine.engine import Engine
    from hybridgen.sampling.params import SamplingParams

    monkeypatch.setattr(ops, "_use_triton", lambda t: True)
    greedy = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    apart_at_one_row: list[str] = []
    after = triton_dense_quant._after

    def spied_after(y, swiglu, rope):  # type: ignore[no-untyped-def]
        if y.shape[0] == 1 and (swiglu or rope is not None):
            apart_at_one_row.append("swiglu" if swiglu else "rope")
        return after(y, swiglu, rope)

    monkeypatch.setattr(triton_dense_quant, "_after", spied_after)

    def tokens() -> list[int]:
        config = EngineConfig(
            model="tiny-llama",
            device="cpu",
            dtype="bfloat16",
            weights_format="int4",
            gpu_memory_mb=128,
            max_model_len=64,
        )
        return Engine(config).generate([[1, 2, 3]], greedy)[0].token_ids

    fused = tokens()
    assert apart_at_one_row == []
    real = triton_dense_quant.quant_linear

    def apart(x, fmt, codes, scale, zero, group, bias=None, tiles=None, swiglu=False, rope=None):  # type: ignore[no-untyped-def]
        y = real(x, fmt, codes, scale, zero, group, bias, tiles)
        return triton_dense_quant._after(y, swiglu, rope)

    monkeypatch.setattr(triton_dense_quant, "quant_linear", apart)
    assert tokens() == fused
    assert set(apart_at_one_row) == {"swiglu", "rope"}  # the second run did take them apart
