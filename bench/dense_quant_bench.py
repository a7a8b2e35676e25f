"""llama3-8b's dense projections with int8 / int4 weights (kernels/triton_dense_quant.py)
against cuBLAS on the bf16 weights, at decode (T = 1) and prefill (T = 512) (device only).

Timed as bench/gemv_bench.py times (its `time_us`): a CUDA graph replayed over enough weight
copies (>= 512 MB) that L2 cannot hold them, as in a decode step where each layer reads its
own weights. Prints microseconds and GB/s of the stored weight bytes (codes, scales, zeros)
per shape, and the B1 step the projections take (32 layers of qkv, o, gate_up and down, and
the LM head); writes $OUT/dense_quant.json.

`--sweep decode` (T = 1) or `--sweep prefill` (T = 512) also times a grid of tiles and K
splits per format and prints, per shape and for the whole model step, the best of them
against the defaults (tiles_for, split_k): what to set as the defaults.

`--kernel` adds int4 rows at T = 1 side by side: `old` the byte GEMV (`_int4_gemv`), `new`
the word GEMV (`_int4_gemv_words`, the bf16 default), `new16` it with 16 rows a thread
(fewer instructions a weight, twice the registers), `mma` the tensor-core GEMV
(`_int4_gemv_mma`, ~3 instructions a weight offline against the word GEMV's 4.8), `mma1` it
with one pipeline stage, `mma_whole` it without split-K, `mma128` with 128 rows over 8 warps
(2.83 instructions a weight offline, one program an SM), `tinygemm` torch's own int4 kernel
(`_weight_int4pack_mm`, CUDA only, skipped where this torch lacks it) on the same codes,
scales and zeros (group 64; its zero is the group's value at code 8), `dp4a` the
int8-activation GEMV (`_int4_gemv_dp4a`: x rounded to int8 a 32-input run, four codes a
DP4A; 2.4 instructions a weight offline with Triton 3.9, the word GEMV 4.3), `dp4a16` it
with 16 rows a thread, `dp4a_w4` with 4 warps along K (4096 inputs a step), `dp4a_k1` with one
(1024).

    python3 bench/dense_quant_bench.py                  # defaults, T = 1 and 512
    python3 bench/dense_quant_bench.py --sweep decode   # + tiles and splits at T = 1
    python3 bench/dense_quant_bench.py --tokens 1 --kernel old,new,new16,mma,tinygemm
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from gemv_bench import time_us  # bench/, beside this script

from hybridgen.benchmarks.report import machine_info, write_out
from hybridgen.kernels.triton_dense_quant import (
    DP4A_GEMV_TILES,
    MMA_GEMV_TILES,
    WORD_GEMV_TILES,
    Tiles,
    quant_linear,
    tiles_for,
)
from hybridgen.models.dense_quant import QuantWeight, quantize, unpack_int4

SHAPES = {
    "qkv": (6144, 4096),
    "o_proj": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "lm_head": (128256, 4096),
}
LAYERS = 32
"""llama3-8b's layers: a step runs each projection but the LM head this many times."""
DECODE_TILES = [
    Tiles(1, bn, bk, w, s, split)
    for bn, bk, w, s, split in itertools.product(
        (4, 8, 16, 32), (256, 512, 1024, 2048), (4, 8), (2, 4), (None, 1, 2, 4)
    )
    if bn * bk <= 64 * 32 * w  # the fp32 accumulator within 64 registers a thread
] + [Tiles(16, bn, bk, 4, 3) for bn, bk in itertools.product((16, 32), (128, 256))]
PREFILL_TILES = [
    Tiles(bm, bn, bk, w, s, split)
    for bm, bn, bk, (w, s), split in itertools.product(
        (64, 128), (64, 128, 256), (64, 128), ((4, 3), (8, 3), (8, 4)), (None, 1)
    )
]


def key(t: Tiles) -> str:
    return f"m{t.block_m}n{t.block_n}k{t.block_k}w{t.num_warps}s{t.num_stages}p{t.split or 'auto'}"


def _copies(w: QuantWeight, nbytes: int) -> list[QuantWeight]:
    count = max(2, -(-512 * 2**20 // nbytes))
    zero = w.zero
    return [
        QuantWeight(
            w.fmt,
            w.codes.clone(),
            w.scale.clone(),
            None if zero is None else zero.clone(),
            w.group,
        )
        for _ in range(count)
    ]


def _fused(tiles: Tiles | None) -> Callable[[torch.Tensor, QuantWeight], torch.Tensor]:
    def run(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
        return quant_linear(x, w.fmt, w.codes, w.scale, w.zero, w.group, None, tiles)

    return run


KERNELS = {
    "old": tiles_for(1, "int4"),
    "new": WORD_GEMV_TILES,
    "new16": replace(WORD_GEMV_TILES, block_n=16),
    "mma": MMA_GEMV_TILES,
    "mma1": replace(MMA_GEMV_TILES, num_stages=1),
    "mma_whole": replace(MMA_GEMV_TILES, split=1),
    "mma128": replace(MMA_GEMV_TILES, block_n=128, num_warps=8),
    "dp4a": DP4A_GEMV_TILES,
    "dp4a16": replace(DP4A_GEMV_TILES, block_n=16),
    "dp4a_w4": replace(DP4A_GEMV_TILES, block_k=4096, num_warps=4),
    "dp4a_k1": replace(DP4A_GEMV_TILES, block_k=1024, num_warps=1),
}
"""`--kernel` names of the int4 GEMVs at T = 1 (and `tinygemm`, torch's)."""
TINYGEMM_INNER_K_TILES = 8


def tinygemm(w: QuantWeight, copies: int) -> tuple[Callable, list] | None:
    """torch's int4 GEMM (tinygemm) on w's codes, scales and zeros, `copies` times (as the
    fused kernels' copies, so that L2 cannot hold them): (fn(x, copy), the copies), or None
    where this torch has no `_weight_int4pack_mm`. Its weights are (code - 8) * s + z', so
    z' = z + 8 s."""
    aten = torch.ops.aten
    if not (hasattr(aten, "_convert_weight_to_int4pack") and hasattr(aten, "_weight_int4pack_mm")):
        return None
    codes = unpack_int4(w.codes).to(torch.int32)
    packed = aten._convert_weight_to_int4pack(
        (codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8), TINYGEMM_INNER_K_TILES
    )
    assert w.zero is not None
    s, z = w.scale.float(), w.zero.float() + 8 * w.scale.float()
    params = torch.stack([s, z], dim=2).transpose(0, 1).contiguous().to(torch.bfloat16)

    def run(x: torch.Tensor, weight: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return aten._weight_int4pack_mm(x, weight[0], w.group, weight[1])

    return run, [(packed.clone(), params.clone()) for _ in range(copies)]


def bench_kernels(
    qw: QuantWeight, x: torch.Tensor, ref: torch.Tensor, kernels: tuple[str, ...], copies: list
) -> tuple[dict[str, float], dict[str, float]]:
    """-> (microseconds, relative error) of each `--kernel` int4 GEMV at T = 1."""
    us: dict[str, float] = {}
    err: dict[str, float] = {}
    for name in kernels:
        try:
            made = (
                tinygemm(qw, len(copies)) if name == "tinygemm" else (_fused(KERNELS[name]), copies)
            )
            out = None if made is None else made[0](x, made[1][0])
        except (RuntimeError, NotImplementedError) as e:  # tinygemm: no kernel for this device
            made, out = None, repr(e)
        if made is None or not isinstance(out, torch.Tensor):
            print(f"int4 {name}: not available in this torch ({out}), skipped", flush=True)
            continue
        err[f"int4 {name}"] = float((out.double() - ref).norm() / ref.norm())
        us[f"int4 {name}"] = time_us(made[0], made[1], x)
        del made
    return us, err


def bench_shape(
    n: int, k: int, t: int, sweep: list[Tiles], kernels: tuple[str, ...] = ()
) -> tuple[dict, dict]:
    """-> (microseconds, GB/s) by method for one [n, k] projection at t rows of x."""
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
    us: dict[str, float] = {}
    stored: dict[str, int] = {}
    dense = [w] + [w.clone() for _ in range(max(1, -(-512 * 2**20 // (n * k * 2)) - 1))]
    us["bf16 cublas"], stored["bf16 cublas"] = time_us(F.linear, dense, x), n * k * 2
    del dense
    for fmt in ("int8", "int4"):
        qw = quantize(w, fmt)  # type: ignore[arg-type]
        ref = x.double() @ qw.dequantize(torch.float32).double().T
        copies = _copies(qw, qw.nbytes)
        methods = {f"{fmt} default": None} | {f"{fmt} {key(c)}": c for c in sweep}
        for name, tiles in methods.items():
            fn = _fused(tiles)
            err = float((fn(x, copies[0]).double() - ref).norm() / ref.norm())
            assert err < 1e-2, (n, k, t, name, err)
            us[name], stored[name] = time_us(fn, copies, x), qw.nbytes
        if fmt == "int4" and t == 1 and kernels:
            extra, errors = bench_kernels(qw, x, ref, kernels, copies)
            for name, value in extra.items():
                us[name], stored[name] = value, qw.nbytes
                print(f"  {n}x{k} {name}: {value:.1f} us, error {errors[name]:.1e}", flush=True)
        del copies
        torch.cuda.empty_cache()
    return us, {m: stored[m] / v / 1e3 for m, v in us.items()}


def step_us(us: dict[str, dict[str, float]], method: str) -> float:
    """A model step's projections by `method`: LAYERS x the layer's four, plus the LM head."""
    return sum(us[s][method] * (1 if s == "lm_head" else LAYERS) for s in SHAPES)


def report(t: int, us: dict[str, dict[str, float]], gbs: dict[str, dict[str, float]]) -> dict:
    """Prints one T's table and the best tiles; returns its summary."""
    summary: dict[str, Any] = {}
    for s in SHAPES:
        row = us[s]
        line = (
            f"T={t:<4} {s:8} bf16 {row['bf16 cublas']:8.1f} us ({gbs[s]['bf16 cublas']:5.0f} GB/s)"
        )
        for fmt in ("int8", "int4"):
            d = f"{fmt} default"
            best = min((m for m in row if m.startswith(fmt)), key=row.__getitem__)
            line += f" | {fmt} {row[d]:8.1f} us ({gbs[s][d]:5.0f} GB/s)"
            if best != d:
                line += f", best {best.split()[1]} {row[best]:.1f}"
        print(line, flush=True)
    for fmt in ("bf16", "int8", "int4"):
        methods = [m for m in us["qkv"] if m.startswith(fmt)]
        steps = {m: step_us(us, m) for m in methods}
        best = min(steps, key=steps.__getitem__)
        default = "bf16 cublas" if fmt == "bf16" else f"{fmt} default"
        summary[fmt] = {
            "default_ms": steps[default] / 1e3,
            "best": best,
            "best_ms": steps[best] / 1e3,
        }
        print(
            f"T={t} model step ({LAYERS} layers + LM head), {fmt}: default "
            f"{steps[default] / 1e3:.3f} ms; best single tiles {best} {steps[best] / 1e3:.3f} ms",
            flush=True,
        )
    for m in (m for m in us["qkv"] if m.split()[-1] in (*KERNELS, "tinygemm")):
        summary[m] = step_us(us, m) / 1e3
        print(f"T={t} model step ({LAYERS} layers + LM head), {m}: {summary[m]:.3f} ms", flush=True)
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--tokens", default="1,512", help="rows of x, comma-separated")
    ap.add_argument("--sweep", choices=("decode", "prefill"), default=None)
    ap.add_argument(
        "--kernel",
        default="",
        help="int4 GEMVs at T = 1, comma-separated: " + ", ".join([*KERNELS, "tinygemm"]),
    )
    args = ap.parse_args()
    result: dict[str, Any] = {"machine": machine_info(), "defaults": {}, "by_tokens": {}}
    kernels = tuple(v for v in args.kernel.split(",") if v)
    assert all(v in KERNELS or v == "tinygemm" for v in kernels), kernels
    for t in (int(v) for v in args.tokens.split(",")):
        sweep = []
        if args.sweep == "decode" and t == 1:
            sweep = DECODE_TILES
        elif args.sweep == "prefill" and t > 16:
            sweep = PREFILL_TILES
        us: dict[str, dict[str, float]] = {}
        gbs: dict[str, dict[str, float]] = {}
        for name, (n, k) in SHAPES.items():
            us[name], gbs[name] = bench_shape(n, k, t, sweep, kernels)
        result["defaults"][t] = {f: key(tiles_for(t, f)) for f in ("int8", "int4")}
        result["by_tokens"][t] = {"us": us, "gb_per_s": gbs, "step": report(t, us, gbs)}
    write_out("dense_quant.json", result)


if __name__ == "__main__":
    main()
