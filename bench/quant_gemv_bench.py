"""One mixtral-8x7b expert's projections, int8 and int4 as stored, at 1 and 4 tokens: the fused
kernels (kernels/triton_quant_gemv.py) over a sweep of int4 tiles, against dequantize-then-
cuBLAS and against cuBLAS on the bf16 weights (device only).

Timed as bench/gemv_bench.py times (its `time_us`): a CUDA graph replayed over enough weight
copies (>= 512 MB) that L2 cannot hold them, as when each layer reads its own experts.
Prints microseconds and GB/s of the stored bytes per shape and method, then the int4 tiles
with the least time over an expert (gate_up + down); writes $OUT/quant_gemv.json.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from gemv_bench import time_us  # bench/, beside this script

from hybridgen.benchmarks.report import machine_info, write_out
from hybridgen.experts.format import GROUP, PackedMatrices
from hybridgen.kernels.triton_quant_gemv import Int4Config, int4_linear, int8_linear

SHAPES = {"gate_up": (28672, 4096), "down": (4096, 14336)}
TOKENS = (1, 4)
INT4_CONFIGS = [
    Int4Config(bk, w, s, sp)
    for bk, w, s, sp in itertools.product((64, 128, 256), (4, 8), (2, 3, 4), (None, 1, 2, 8))
]


def key(cfg: Int4Config) -> str:
    return f"int4 k{cfg.block_k}w{cfg.num_warps}s{cfg.num_stages}p{cfg.splits or 'auto'}"


def main() -> None:
    us: dict[str, dict[str, float]] = {}
    gbs: dict[str, dict[str, float]] = {}
    for (name, (n, k)), t in itertools.product(SHAPES.items(), TOKENS):
        label = f"{name} T={t}"
        w = torch.randn(1, n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
        row: dict[str, float] = {}
        stored: dict[str, int] = {}
        copies = max(2, -(-512 * 2**20 // (n * k * 2)))
        dense = [w[0].clone() for _ in range(copies)]
        row["bf16 cublas"] = time_us(lambda a, m: F.linear(a, m), dense, x)  # type: ignore[arg-type]
        stored["bf16 cublas"] = n * k * 2
        del dense
        for fmt in ("int8", "int4"):
            packed = PackedMatrices.pack(w, fmt)  # type: ignore[arg-type]
            copies = max(2, -(-512 * 2**20 // packed.matrix_bytes))
            stacks = [
                PackedMatrices(fmt, {p: v.clone() for p, v in packed.parts.items()}, torch.bfloat16)
                for _ in range(copies)
            ]
            ref = x.double() @ packed.matrix(0).double().T
            row[f"{fmt} dequant+cublas"] = time_us(
                lambda a, st: F.linear(a, st.matrix(0)), stacks, x
            )
            stored[f"{fmt} dequant+cublas"] = packed.matrix_bytes
            if fmt == "int8":
                fused = {
                    "int8 fused": lambda a, st: int8_linear(a, st.parts["q"][0], st.parts["s"][0])
                }
            else:
                fused = {
                    key(c): lambda a, st, c=c: int4_linear(
                        a, st.parts["q"][0], st.parts["sz"][0], GROUP, c
                    )
                    for c in INT4_CONFIGS
                }
            for m, fn in fused.items():
                err = float((fn(x, stacks[0]).double() - ref).norm() / ref.norm())
                assert err < 1e-2, (label, m, err)
                row[m] = time_us(fn, stacks, x)
                stored[m] = packed.matrix_bytes
            del stacks
            torch.cuda.empty_cache()
        us[label] = row
        gbs[label] = {m: stored[m] / v / 1e3 for m, v in row.items()}
        best4 = min((m for m in row if m.startswith("int4 k")), key=row.__getitem__)
        print(
            f"{label:12} bf16 {row['bf16 cublas']:6.1f} us | int8 fused {row['int8 fused']:6.1f} "
            f"us ({gbs[label]['int8 fused']:5.0f} GB/s), dequant {row['int8 dequant+cublas']:6.1f}"
            f" | int4 best {best4} {row[best4]:6.1f} us ({gbs[label][best4]:5.0f} GB/s), "
            f"default {row[key(Int4Config())]:6.1f}, dequant {row['int4 dequant+cublas']:6.1f}",
            flush=True,
        )
    configs = [key(c) for c in INT4_CONFIGS]
    for t in TOKENS:
        expert = {c: sum(us[f"{s} T={t}"][c] for s in SHAPES) for c in configs}
        best = min(expert, key=expert.__getitem__)
        print(
            f"one int4 expert at T={t}: best {best} {expert[best]:.1f} us, "
            f"default {expert[key(Int4Config())]:.1f} us"
        )
    write_out("quant_gemv.json", {"us": us, "gb_per_s": gbs, "machine": machine_info()})


if __name__ == "__main__":
    main()
