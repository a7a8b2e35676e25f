"""Element-wise kernels (RMSNorm, SiLU-and-mul, RoPE + cache write) against float64 references.

Triton kernels run under TRITON_INTERPRET=1 (set by conftest.py) on CPU tensors; the torch
references run natively. Both are compared with float64 formulas on fresh random inputs with
outliers. torch.empty is poisoned with NaN while a kernel runs, so any output element a kernel
forgets to write shows up as NaN. On a machine with CUDA the same tests run the compiled kernels
on the GPU, plus a CUDA-graph capture test.

Interpreter caveats (Triton 3.9): fp32->bf16 casts truncate instead of rounding to nearest
even, so bf16 results may differ from torch by one bf16 ulp; bounds for bf16 are loose.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from hybridgen.experts.format import GROUP, PackedMatrices, _scale_dtype
from hybridgen.kernels import int4_layout, ops, reference
from hybridgen.kernels import triton_activation as t_act
from hybridgen.kernels import triton_gemv as t_gemv
from hybridgen.kernels import triton_grouped_experts as t_grouped
from hybridgen.kernels import triton_norm as t_norm
from hybridgen.kernels import triton_quant_gemv as t_qgemv
from hybridgen.kernels import triton_rope_cache as t_rope
from tests.kernel_helpers import DEVICE, FP32_TOL, randn, rel_err, tol

# ----------------------------------------------------------------------------------------------
# add_rms_norm / silu_and_mul

NORM_IMPLS = {"triton": t_norm.add_rms_norm, "reference": reference.add_rms_norm}


@pytest.mark.usefixtures("poison_empty")
@pytest.mark.parametrize("impl", sorted(NORM_IMPLS))
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "hidden", "seed"), [(7, 96, 0), (3, 256, 1)])
def test_add_rms_norm(
    impl: str, with_residual: bool, dtype: torch.dtype, rows: int, hidden: int, seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = randn(gen, rows, hidden, dtype=dtype)
    res = randn(gen, rows, hidden, dtype=dtype) if with_residual else None
    w = (1.0 + 0.5 * randn(gen, hidden)).to(dtype)
    eps = 1e-6
    res_in = None if res is None else res.clone()
    out, res_out = NORM_IMPLS[impl](x, res_in, w, eps)

    # Ground truth: residual rounded to the model dtype (as HF), the rest in float64.
    exp_res = x if res is None else (x.double() + res.double()).to(dtype)
    r = exp_res.double()
    expected = w.double() * r / torch.sqrt(r.pow(2).mean(-1, keepdim=True) + eps)
    assert out.dtype == dtype and out.shape == x.shape
    assert torch.isfinite(out).all() and torch.isfinite(res_out).all()
    assert rel_err(out, expected) < tol(dtype)
    if dtype == torch.float32:
        assert torch.equal(res_out, exp_res)
    else:
        assert rel_err(res_out, exp_res) < 1e-2
    if res is None:
        assert res_out.data_ptr() == x.data_ptr()


def test_reference_rms_norm_matches_hf_bitwise() -> None:
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    gen = torch.Generator().manual_seed(5)
    x, res = randn(gen, 6, 64, device="cpu"), randn(gen, 6, 64, device="cpu")
    hf = llama.LlamaRMSNorm(64, eps=1e-5)
    with torch.no_grad():
        hf.weight.copy_(1.0 + randn(gen, 64, device="cpu"))
        out, res_out = reference.add_rms_norm(x, res, hf.weight, 1e-5)
        assert torch.equal(out, hf(x + res))
    assert torch.equal(res_out, x + res)


ACT_IMPLS = {"triton": t_act.silu_and_mul, "reference": reference.silu_and_mul}


@pytest.mark.usefixtures("poison_empty")
@pytest.mark.parametrize("impl", sorted(ACT_IMPLS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "inter", "seed"), [(5, 80, 0), (2, 1500, 1)])
def test_silu_and_mul(impl: str, dtype: torch.dtype, rows: int, inter: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = randn(gen, rows, 2 * inter, dtype=dtype) * 3.0
    out = ACT_IMPLS[impl](x)
    g, u = x[:, :inter].double(), x[:, inter:].double()
    expected = g / (1.0 + torch.exp(-g)) * u
    assert out.shape == (rows, inter) and out.dtype == dtype
    assert torch.isfinite(out).all()
    assert rel_err(out, expected) < tol(dtype)


# ----------------------------------------------------------------------------------------------
# rope_and_cache

ROPE_IMPLS = {"triton": t_rope.rope_and_cache, "reference": reference.rope_and_cache}


def _rope_tables(max_pos: int, dim: int, scaling: float) -> tuple[Tensor, Tensor]:
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)  # HF layout: [max_pos, D]
    return emb.cos() * scaling, emb.sin() * scaling


def _hf_rope64(x: Tensor, cos: Tensor, sin: Tensor, pos: Tensor) -> Tensor:
    # x: [T, H, D]; direct HF formula q*cos + rotate_half(q)*sin in float64.
    half = x.shape[-1] // 2
    xd = x.double()
    rot = torch.cat((-xd[..., half:], xd[..., :half]), dim=-1)
    return xd * cos[pos].double().unsqueeze(1) + rot * sin[pos].double().unsqueeze(1)


@pytest.mark.parametrize("impl", sorted(ROPE_IMPLS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("hq", "hkv", "dim", "block"), [(8, 2, 64, 16), (3, 3, 48, 8)])
def test_rope_and_cache(
    impl: str, dtype: torch.dtype, hq: int, hkv: int, dim: int, block: int
) -> None:
    gen = torch.Generator().manual_seed(hq * 100 + dim)
    n_tok, n_blocks = 9, 6
    # q, k, v are strided views into one fused qkv projection output.
    qkv = randn(gen, n_tok, (hq + 2 * hkv) * dim, dtype=dtype)
    q = qkv[:, : hq * dim].view(n_tok, hq, dim)
    k = qkv[:, hq * dim : (hq + hkv) * dim].view(n_tok, hkv, dim)
    v = qkv[:, (hq + hkv) * dim :].view(n_tok, hkv, dim)
    q0, k0, v0 = q.clone(), k.clone(), v.clone()
    cos, sin = (t.to(DEVICE) for t in _rope_tables(4096, dim, scaling=1.3))
    pos = torch.randint(0, 4096, (n_tok,), generator=gen).to(DEVICE)
    slots = torch.randperm(n_blocks * block, generator=gen)[:n_tok]
    slots[[1, 4, 8]] = -1  # padding tokens
    slots = slots.to(DEVICE)
    k_cache = torch.full((n_blocks, block, hkv, dim), float("nan"), dtype=dtype, device=DEVICE)
    v_cache = torch.full_like(k_cache, float("nan"))

    ROPE_IMPLS[impl](q, k, v, pos, cos, sin, k_cache, v_cache, slots)

    assert rel_err(q, _hf_rope64(q0, cos, sin, pos)) < tol(dtype)
    assert rel_err(k, _hf_rope64(k0, cos, sin, pos)) < tol(dtype)
    assert torch.equal(v, v0)
    valid = slots >= 0
    blk, off = slots[valid] // block, slots[valid] % block
    assert torch.equal(k_cache[blk, off], k[valid])
    assert torch.equal(v_cache[blk, off], v0[valid])
    # Nothing else was written: padding tokens were skipped.
    written = ~torch.isnan(k_cache).all(dim=(-1, -2))
    assert int(written.sum()) == int(valid.sum())
    assert int((~torch.isnan(v_cache).all(dim=(-1, -2))).sum()) == int(valid.sum())


def test_reference_rope_matches_hf_bitwise() -> None:
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    gen = torch.Generator().manual_seed(11)
    n_tok, hq, hkv, dim = 5, 4, 2, 32
    q, k, v = (randn(gen, n_tok, h, dim, device="cpu") for h in (hq, hkv, hkv))
    cos, sin = _rope_tables(128, dim, scaling=1.0)
    pos = torch.randint(0, 128, (n_tok,), generator=gen)
    # HF layout: q [1, H, T, D], cos [1, T, D]
    hf_q, hf_k = llama.apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[pos][None], sin[pos][None]
    )
    caches = torch.zeros(2, 4, 8, hkv, dim)
    reference.rope_and_cache(q, k, v, pos, cos, sin, caches[0], caches[1], torch.arange(n_tok))
    assert torch.equal(q, hf_q[0].transpose(0, 1))
    assert torch.equal(k, hf_k[0].transpose(0, 1))


# ----------------------------------------------------------------------------------------------
# gemv (batch-1 projections)


@pytest.mark.usefixtures("poison_empty")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("n", "k", "bias", "cfg"),
    [
        (37, 256, False, t_gemv.GemvConfig(8, 64)),  # N not a multiple of BLOCK_N
        (64, 200, True, t_gemv.GemvConfig(16, 64)),  # K not a multiple of BLOCK_K
        (5, 1024, True, t_gemv.GemvConfig()),  # the production tiles, fewer rows than a tile
    ],
)
def test_gemv(dtype: torch.dtype, n: int, k: int, bias: bool, cfg: t_gemv.GemvConfig) -> None:
    gen = torch.Generator().manual_seed(n + k)
    x = randn(gen, 1, k, dtype=dtype)
    w = randn(gen, n, k, dtype=dtype)
    b = randn(gen, n, dtype=dtype) if bias else None
    ref = x.double() @ w.double().T + (b.double() if b is not None else 0.0)
    out = t_gemv.gemv(x, w, b, cfg)
    assert out.shape == (1, n) and out.dtype == dtype
    assert rel_err(out, ref) < tol(dtype)


def test_linear_matches_reference() -> None:
    """ops.linear, as the model calls it: on CUDA one row takes the Triton GEMV and three rows
    cuBLAS; on the CPU both are F.linear."""
    gen = torch.Generator().manual_seed(3)
    w, b = randn(gen, 48, 128), randn(gen, 48)
    for rows in (1, 3):
        x = randn(gen, rows, 128)
        ref = x.double() @ w.double().T + b.double()
        assert rel_err(ops.linear(x, w, b), ref) < FP32_TOL


# ----------------------------------------------------------------------------------------------
# int8 / int4 expert GEMV (cold_weights.expert_format on the device)


@pytest.mark.slow
@pytest.mark.usefixtures("poison_empty")
@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("rows", "n", "k"),
    [
        (1, 64, 512),  # one int4 row block (int8: N a multiple of BLOCK_N), K of whole tiles
        (3, 192, 320),  # several rows of x, K not a multiple of either kernel's K tile
        (t_qgemv.MAX_ROWS, 128, 2048),  # the most rows the kernels take; int4 splits K in 2
    ],
)
def test_quant_gemv(fmt: str, dtype: torch.dtype, rows: int, n: int, k: int) -> None:
    """The fused kernels against the float64 product with the dequantized weights, on fresh
    random weights with an outlier input channel, and against expert_format's own path."""
    gen = torch.Generator().manual_seed(rows * n + k)
    w = randn(gen, 1, n, k, dtype=torch.float64)
    w[0, :, 5] *= 20  # an outlier input channel
    x = randn(gen, rows, k, dtype=dtype)
    packed = PackedMatrices.pack(w.to(dtype), fmt)  # type: ignore[arg-type]
    ref = x.double() @ packed.matrix(0).double().T  # the codes, dequantized
    if fmt == "int8":
        out = t_qgemv.int8_linear(x, packed.parts["q"][0], packed.parts["s"][0])
    else:
        assert fmt != "int4" or t_qgemv.int4_splits(n, k) == (2 if k == 2048 else 1)
        out = t_qgemv.int4_linear(x, packed.parts["q"][0], packed.parts["sz"][0], GROUP)
    assert out.shape == (rows, n) and out.dtype == dtype
    assert rel_err(out, ref) < tol(dtype)
    assert rel_err(out, packed.linear(x, 0).double()) < tol(dtype)  # the CPU's kernels


@pytest.mark.parametrize("row_block", int4_layout.ROW_BLOCKS)
def test_int4_kernels_read_each_cpu_layout(row_block: int) -> None:
    """The fused and grouped int4 kernels on codes in either CPU layout's row blocks (AVX-512's
    64, AVX2's 32), whichever this machine stores: the float64 product of the codes."""
    gen = torch.Generator().manual_seed(row_block)
    n, k = 64, 256
    codes = torch.randint(0, 16, (2, n, k), generator=gen, dtype=torch.uint8)
    sz = torch.rand(2, k // GROUP, n, 2, generator=gen) * 0.02
    w = [
        (codes[e].double() - 8).unflatten(-1, (-1, GROUP)) * sz[e, ..., 0].T[..., None].double()
        + sz[e, ..., 1].T[..., None].double()
        for e in range(2)
    ]
    q = int4_layout.pack(codes, row_block).to(DEVICE)
    sz = sz.to(DEVICE)
    x = randn(gen, 2, k)
    for e in range(2):
        ref = x.double().cpu() @ w[e].flatten(-2).T
        out = t_qgemv.int4_linear(x, q[e], sz[e], GROUP, row_block=row_block)
        assert rel_err(out.cpu(), ref) < FP32_TOL
    rows, slots = (
        torch.tensor([1, 0, 1], dtype=torch.int32),
        torch.tensor([0, 1, 1], dtype=torch.int32),
    )
    parts = {"q": q, "sz": sz}
    out = t_grouped.grouped_linear(
        x, "int4", parts, rows.to(DEVICE), slots.to(DEVICE), GROUP, row_block=row_block
    )
    ref = torch.stack(
        [
            x[r].double().cpu() @ w[s].flatten(-2).T
            for r, s in zip([1, 0, 1], [0, 1, 1], strict=True)
        ]
    )
    assert rel_err(out.cpu(), ref) < FP32_TOL


@pytest.mark.usefixtures("poison_empty")
@pytest.mark.parametrize("row_block", int4_layout.ROW_BLOCKS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("n", "k"), [(64, 128), (192, 320)])  # K past whole tiles
def test_int4_dequantize(row_block: int, dtype: torch.dtype, n: int, k: int) -> None:
    """The one-launch dequantization (a prefill's experts) against the float64 weights of
    fresh random codes, scales and zeros, in either CPU layout's row blocks: every weight
    written, each within half a ulp of `dtype` of the exact value (Triton's interpreter
    truncates to bf16: one ulp there)."""
    gen = torch.Generator().manual_seed(n + k + row_block)
    codes = torch.randint(0, 16, (1, n, k), generator=gen, dtype=torch.uint8)
    sz = (torch.rand(k // GROUP, n, 2, generator=gen) * 0.02).to(_scale_dtype(dtype))
    exact = (codes[0].double() - 8).unflatten(-1, (-1, GROUP)) * sz[..., 0].T[..., None].double()
    exact = (exact + sz[..., 1].T[..., None].double()).flatten(-2)
    q = int4_layout.pack(codes, row_block)[0].to(DEVICE)
    out = t_qgemv.int4_dequantize(q, sz.to(DEVICE), GROUP, dtype, row_block=row_block).cpu()
    assert out.shape == (n, k) and out.dtype == dtype and torch.isfinite(out).all()
    ulp = torch.finfo(dtype).eps * exact.abs().clamp_min(torch.finfo(dtype).tiny)
    bound = 1.0 if dtype == torch.bfloat16 and DEVICE.type == "cpu" else 0.5
    assert ((out.double() - exact).abs() <= bound * ulp * 1.0001 + 1e-12).all()


def test_expert_matrix_on_the_device_is_the_hosts() -> None:
    """PackedMatrices.matrix on CUDA takes int4_dequantize, on the CPU torch's ops (what the
    rows past MAX_ROWS multiply): the same weights, to a bf16 ulp (FMA on the device)."""
    gen = torch.Generator().manual_seed(3)
    packed = PackedMatrices.pack(randn(gen, 2, 128, 256).bfloat16(), "int4")
    host = packed.matrix(1)
    on = PackedMatrices("int4", {k: t.to(DEVICE) for k, t in packed.parts.items()}, packed.dtype)
    ulp = torch.finfo(torch.bfloat16).eps * host.double().abs()
    assert ((on.matrix(1).cpu().double() - host.double()).abs() <= ulp + 1e-12).all()


@pytest.mark.usefixtures("poison_empty")
@pytest.mark.parametrize(
    "cfg",
    [
        t_qgemv.Int4Config(64, 4, 2, splits=3),  # uneven splits
        t_qgemv.Int4Config(64, 4, 2, splits=11),  # 11 x 64 > 640: the last split is empty
        t_qgemv.Int4Config(256, 8, 4, splits=1),
    ],
)
def test_int4_gemv_tiles(cfg: t_qgemv.Int4Config) -> None:
    """Other tiles and K splits than the default, as bench/quant_gemv_bench.py sweeps them:
    the same product."""
    gen = torch.Generator().manual_seed(11)
    x = randn(gen, 2, 640)
    packed = PackedMatrices.pack(randn(gen, 1, 128, 640), "int4")
    ref = x.double() @ packed.matrix(0).double().T
    out = t_qgemv.int4_linear(x, packed.parts["q"][0], packed.parts["sz"][0], GROUP, cfg)
    assert rel_err(out, ref) < FP32_TOL
