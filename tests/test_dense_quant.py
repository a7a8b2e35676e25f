"""Weight-only int8 / int4 dense layers: the formats, GGUF repacking, and the fused Triton
kernel (CPU interpreter) against a float64 reference on fresh random inputs."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from hybridgen.kernels import triton_dense_quant
from hybridgen.models.dense_quant import from_gguf_blocks, quantize

torch.manual_seed(0)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = x.double() @ w.double().T
    return y if bias is None else y + bias.double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize(("t", "n", "k"), [(1, 96, 576), (3, 64, 256), (37, 130, 192)])
def test_kernel_matches_float64(fmt: str, t: int, n: int, k: int, dtype: torch.dtype) -> None:
    w = torch.randn(n, k) * 0.05
    qw = quantize(w, fmt) if fmt == "int8" or k % 64 == 0 else None
    if qw is None:  # K = 192 is no multiple of the int4 group of 64: GGUF's groups of 32
        blocks = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType.Q4_1)
        qw = from_gguf_blocks("Q4_1", blocks)
    assert qw is not None
    qw = qw.to(DEVICE)
    x, bias = torch.randn(t, k, device=DEVICE, dtype=dtype), torch.randn(n, device=DEVICE)
    got = triton_dense_quant.quant_linear(x, qw.fmt, qw.codes, qw.scale, qw.zero, qw.group, bias)
    # The reference multiplies what the kernel multiplies: x and the weight in x's dtype.
    want = _reference(x, qw.dequantize(dtype), bias)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert got.dtype == dtype
    assert (got.double() - want).abs().max() < tol * (1 + want.abs().max())


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
def test_repacked_gguf_gives_the_native_tokens(tmp_path, qtype: str, fmt: str) -> None:  # type: ignore[no-untyped-def]
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
    assert [c.token_ids for c in quant.generate(prompts, greedy)] == want


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
