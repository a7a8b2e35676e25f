"""A prefill's int4 expert (more rows than the fused kernels take, triton_quant_gemv.MAX_ROWS):
dequantized, then multiplied by cuBLAS. The one-launch Triton dequantization
(ops.int4_matrix on CUDA) against torch's ops (reference.int4_dequantize, what ran before),
for mixtral-8x7b's and qwen3-30b-a3b's expert matrices at 64 and 256 rows (device only).

Timed as bench/gemv_bench.py times (`time_us`: a CUDA graph over enough weight copies that
L2 cannot hold them). Prints microseconds per matrix; writes $OUT/expert_dequant.json.

    python bench/expert_dequant_bench.py
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from gemv_bench import time_us  # bench/, beside this script

from hybridgen.benchmarks.report import machine_info, write_out
from hybridgen.experts.format import GROUP, PackedMatrices
from hybridgen.kernels import reference, triton_quant_gemv

SHAPES = {
    "mixtral gate_up": (28672, 4096),
    "mixtral down": (4096, 14336),
    "qwen3 gate_up": (1536, 2048),
    "qwen3 down": (2048, 768),
}
ROWS = (64, 256)
METHODS = {
    "torch ops": lambda q, sz: reference.int4_dequantize(q, sz, GROUP, torch.bfloat16),
    "triton": lambda q, sz: triton_quant_gemv.int4_dequantize(q, sz, GROUP, torch.bfloat16),
}


def main() -> None:
    us: dict[str, dict[str, float]] = {}
    for (name, (n, k)), t in itertools.product(SHAPES.items(), ROWS):
        w = torch.randn(1, n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        packed = PackedMatrices.pack(w.cpu(), "int4")
        q, sz = packed.parts["q"][0].cuda(), packed.parts["sz"][0].cuda()
        copies = max(2, -(-512 * 2**20 // packed.matrix_bytes))
        stacks = [(q.clone(), sz.clone()) for _ in range(copies)]
        x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
        exact = METHODS["torch ops"](q, sz)
        row = {}
        for method, dequant in METHODS.items():
            assert torch.allclose(dequant(q, sz), exact, rtol=1e-2, atol=1e-6), (name, method)
            row[method] = time_us(lambda a, st, d=dequant: F.linear(a, d(*st)), stacks, x)
        us[f"{name} T={t}"] = row
        print(f"{name:16} T={t:3}: " + ", ".join(f"{m} {v:8.1f} us" for m, v in row.items()))
        del stacks
        torch.cuda.empty_cache()
    write_out("expert_dequant.json", {"us": us, "machine": machine_info()})


if __name__ == "__main__":
    main()
