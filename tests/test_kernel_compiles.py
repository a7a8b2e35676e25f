"""A served step compiles no kernel: what changes from step to step (batch size, the block
table's width, the token count, offsets of the index tables packed into one upload) never
makes a new Triton compile.

Triton compiles a kernel once per specialization key: its constexprs and, by default, for
every integer argument whether it is 1 or a multiple of 16, and for every pointer whether it
is 16-byte aligned. Arguments that vary per step therefore each multiplied the compiles, and
a compile on the H100 costs ~0.5-1 s in the step that meets it: B6 (ii)'s hybrid run, the
first of its pair on a fresh cache, stalled 0.55 s and 1.0 s in mid-run (bench/NOTES.md).
The kernels leave those arguments unspecialized; these tests launch them at the shapes a
server meets and compute each launch's key the way Triton's launcher does (its binder
over the kernel's signature, with the backend-independent specialization), so they run under
the interpreter on a CPU too."""

from __future__ import annotations

import importlib
import pkgutil
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from triton.backends.compiler import BaseBackend
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction, create_function_from_signature

import hybridgen.kernels as kernels_pkg
from hybridgen.experts.format import GROUP, PackedMatrices
from hybridgen.kernels import triton_block_gather as gather
from hybridgen.kernels import triton_grouped_experts as grouped
from hybridgen.kernels import triton_grouped_gemm as gemm
from hybridgen.kernels import triton_paged_decode as decode
from hybridgen.kernels import triton_paged_prefill as prefill
from hybridgen.kernels import triton_rope_cache as rope
from hybridgen.kernels.triton_dense_quant import quant_linear
from hybridgen.models.dense_quant import quantize
from tests.kernel_helpers import DEVICE, randn

pytestmark = pytest.mark.skipif(DEVICE.type != "cpu", reason="reads the interpreter's kernels")

Key = tuple[tuple[str, ...], tuple[str, ...]]
"""(the constexprs and launch options, the runtime arguments' specialization)."""


def _binder(kernel: InterpretedFunction) -> tuple[Any, list[bool]]:
    jit = JITFunction(
        kernel.fn,
        do_not_specialize=kernel.kwargs.get("do_not_specialize"),
        do_not_specialize_on_alignment=kernel.kwargs.get("do_not_specialize_on_alignment"),
    )
    binder = create_function_from_signature(jit.signature, jit.params, BaseBackend)
    return binder, [p.is_constexpr for p in jit.params]


@contextmanager
def launch_keys() -> Iterator[dict[str, set[Key]]]:
    """Every kernel launch in the block, keyed as Triton's launcher keys its compiles."""
    keys: dict[str, set[Key]] = defaultdict(set)
    patched: list[InterpretedFunction] = []
    for info in pkgutil.iter_modules(kernels_pkg.__path__):
        module = importlib.import_module(f"hybridgen.kernels.{info.name}")
        for kernel in vars(module).values():
            if not isinstance(kernel, InterpretedFunction) or "run" in vars(kernel):
                continue
            binder, constexpr = _binder(kernel)
            run = kernel.run

            def record(
                *args: Any, _k=kernel, _b=binder, _c=constexpr, _run=run, **kwargs: Any
            ) -> Any:
                launch = {k: v for k, v in kwargs.items() if k not in ("grid", "warmup")}
                _, spec, options = _b(*args, **launch)
                const = tuple(str(s) for s, c in zip(spec, _c, strict=True) if c)
                const += tuple(f"{k}={v}" for k, v in sorted(options.items()))
                runtime = tuple(str(s) for s, c in zip(spec, _c, strict=True) if not c)
                keys[_k.fn.__name__].add((const, runtime))
                return _run(*args, **kwargs)

            kernel.run = record  # type: ignore[method-assign]
            patched.append(kernel)
    try:
        yield keys
    finally:
        for kernel in patched:
            del kernel.run


def _compiles(keys: dict[str, set[Key]]) -> dict[str, int]:
    """Per kernel, the most compiles one configuration of its constexprs took."""
    out = {}
    for name, seen in keys.items():
        per: dict[tuple[str, ...], set[tuple[str, ...]]] = defaultdict(set)
        for const, runtime in seen:
            per[const].add(runtime)
        out[name] = max(len(r) for r in per.values())
    return out


def _packed(parts: list[list[int]], dtype: torch.dtype) -> list[torch.Tensor]:
    """`parts` as views into one tensor, back to back, as ModelRunner._pack uploads a step's
    index tables (their offsets, so their alignment, follow the step's sizes)."""
    flat = torch.tensor([v for p in parts for v in p], dtype=dtype, device=DEVICE)
    views, at = [], 0
    for p in parts:
        views.append(flat[at : at + len(p)])
        at += len(p)
    return views


def test_attention_compiles_once_whatever_the_batch() -> None:
    """Prefill and decode over batches of 1 to 5 sequences whose longest holds 1 to 64 blocks
    (so 1 to 8 decode splits), the tables packed after the sequence lengths: one compile per
    kernel configuration; the split merge compiles once for every number of splits."""
    gen = torch.Generator().manual_seed(0)
    size, heads, kv_heads, dim, blocks = 16, 4, 2, 16, 80
    k_cache = randn(gen, blocks, size, kv_heads, dim)
    v_cache = randn(gen, blocks, size, kv_heads, dim)
    kv = prefill.native_kv(k_cache, v_cache)
    with launch_keys() as keys:
        for batch, width in [(1, 1), (2, 2), (3, 16), (4, 17), (5, 33), (1, 16), (4, 64)]:
            lens = [max(1, width * size - 1 - i) for i in range(batch)]
            tables = [[(7 * i + j) % blocks for j in range(width)] for i in range(batch)]
            lens_t, table = _packed([lens, [b for t in tables for b in t]], torch.int32)
            table = table.view(batch, width)
            chunk = [min(n, 5) for n in lens]
            qsl = [0]
            for n in chunk:
                qsl.append(qsl[-1] + n)
            q = randn(gen, qsl[-1], heads, dim)
            prefill.paged_prefill_attention(q, kv, table, qsl, lens, 0.25)
            q1 = randn(gen, batch, heads, dim)
            decode.paged_decode_attention(q1, k_cache, v_cache, table, lens_t, 0.25)
    assert {"_prefill_kernel", "_decode_split_kernel", "_decode_merge_kernel"} <= set(keys)
    assert _compiles(keys) == dict.fromkeys(keys, 1)
    assert len(keys["_decode_merge_kernel"]) == 1


def test_rope_and_cache_compiles_once_whatever_the_tokens() -> None:
    """A step's positions and slots are views of one upload (ids, positions, slots): steps of
    1, 2, 3, 16 and 17 tokens compile the rope kernels once each."""
    gen = torch.Generator().manual_seed(1)
    size, heads, kv_heads, dim = 4, 4, 2, 16
    cos, sin = randn(gen, 64, dim), randn(gen, 64, dim)
    k_cache = torch.zeros(32, size, kv_heads, dim, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    with launch_keys() as keys:
        for t in [1, 2, 3, 16, 17]:
            _, pos, slots = _packed([[0] * t, list(range(t)), list(range(t))], torch.int64)
            qkv = randn(gen, t, (heads + 2 * kv_heads) * dim)
            q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=1)
            q = q.view(t, heads, dim)
            k, v = k.view(t, kv_heads, dim), v.view(t, kv_heads, dim)
            rope.rope_and_cache(q, k, v, pos, cos, sin, k_cache, v_cache, slots)
    assert set(keys) == {"_rope_and_cache_kernel"}
    assert _compiles(keys) == {"_rope_and_cache_kernel": 1}


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quantized_linear_compiles_once_per_tile_shape(fmt: str) -> None:
    """int8 / int4 weights at 1, 2, 3, 5, 16 and 17 rows (a decode batch, a prompt chunk): the
    GEMM's token count is not specialized on, so each tile shape compiles once. (The GEMVs
    take one row only, so their T stays the constant 1 Triton makes of it.)"""
    w = quantize(torch.randn(64, 128) * 0.05, fmt).to(DEVICE)  # type: ignore[arg-type]
    with launch_keys() as keys:
        for t in [1, 2, 3, 5, 16, 17]:
            x = torch.randn(t, 128, device=DEVICE)
            quant_linear(x, w.fmt, w.codes, w.scale, w.zero, w.group)
    assert keys and _compiles(keys) == dict.fromkeys(keys, 1)


def test_grouped_experts_compile_once_whatever_the_step() -> None:
    """A MoE step's expert tables are views of one upload (pairs, slots, outputs, weights'
    index): steps of 1 to 6 pairs compile each grouped kernel once."""
    gen = torch.Generator().manual_seed(2)
    n, k, slots, top_k = 64, 128, 4, 2
    w = randn(gen, slots, n, k, dtype=torch.float64, device="cpu").float()
    stack = PackedMatrices.pack(w, "int4")
    parts = {name: t.to(DEVICE) for name, t in stack.parts.items()}
    x = randn(gen, 8, k)
    with launch_keys() as keys:
        for pairs in [1, 2, 3, 4, 5, 6]:
            rows = [p % 8 for p in range(pairs)]
            picks = [p % slots for p in range(pairs)]
            rows_t, slots_t = _packed([rows, picks], torch.int32)
            grouped.grouped_linear(x, "int4", parts, rows_t, slots_t, GROUP)
            tokens = max(pairs // top_k, 1)
            y = randn(gen, tokens * top_k, n)
            _, widx = _packed([[0] * pairs, list(range(tokens * top_k))], torch.int32)
            grouped.weighted_sum(y, torch.rand(tokens, top_k, device=DEVICE), widx, top_k)
            bm = gemm.BLOCK_MS[0]
            padded = rows + [-1] * (bm - pairs)
            outs = list(range(pairs)) + [-1] * (bm - pairs)
            _, rows_g, outs_g, block_slot = _packed(
                [[0] * pairs, padded, outs, [picks[0]]], torch.int32
            )
            y_g = torch.zeros(pairs, n, device=DEVICE)
            gemm.int4_grouped_gemm(x, rows_g, outs_g, block_slot, parts, GROUP, y_g)
    names = {"_int4_grouped_kernel", "_weighted_sum_kernel", "_int4_grouped_gemm_kernel"}
    assert names <= set(keys)
    assert _compiles(keys) == dict.fromkeys(keys, 1)


def test_block_gathers_compile_once_whatever_the_slots() -> None:
    """Warm blocks and records gathered by slot lists of 1 to 5 that sit at any offset of a
    packed index: one compile each."""
    gen = torch.Generator().manual_seed(3)
    cache = (randn(gen, 12, 4, 2, 16), randn(gen, 12, 4, 2, 16))
    records = torch.randint(0, 255, (12, 64), dtype=torch.uint8, device=DEVICE)
    with launch_keys() as keys:
        for n in [1, 2, 3, 4, 5]:
            _, slots = _packed([[0] * n, [(3 * i) % 12 for i in range(n)]], torch.int64)
            gather.gather_blocks(cache, slots, torch.float32)
            gather.gather_rows(records, slots)
    assert set(keys) == {"_gather_kernel", "_rows_kernel"}
    assert _compiles(keys) == {"_gather_kernel": 1, "_rows_kernel": 1}
