"""Batch-1 projections of llama3-8b: cuBLAS vs the Triton GEMV over a tile sweep (device only).

Every timing replays a CUDA graph that runs the op over enough weight copies (>= 512 MB) that
L2 (50 MB on the H200) cannot hold them, as in a real decode step where each layer reads its
own weights. Prints GB/s per shape and method, the best Triton tiles per shape, and the best
single config over all shapes; writes $OUT/gemv.json.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from hybridgen.benchmarks.report import machine_info, write_out
from hybridgen.kernels.triton_gemv import GemvConfig, gemv

SHAPES = {
    "qkv": (6144, 4096),
    "o_proj": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "lm_head": (128256, 4096),
}
CONFIGS = [
    GemvConfig(bn, bk, w, s)
    for bn, bk, w, s in itertools.product((4, 8, 16), (256, 512, 1024), (4, 8), (2, 3, 4))
]


def time_us(fn, weights, x, reps: int = 5) -> float:
    """Per-call microseconds of fn(x, w) over every weight copy, replayed in a CUDA graph."""
    for w in weights[:2]:
        fn(x, w)  # compile / pick algorithms outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            for w in weights:
                fn(x, w)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (reps * len(weights))


def main() -> None:
    results: dict[str, dict[str, float]] = {}
    for name, (n, k) in SHAPES.items():
        nbytes = n * k * 2
        copies = max(2, -(-512 * 2**20 // nbytes))
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        ref = F.linear(x.double(), weights[0].double())
        row: dict[str, float] = {"cublas": time_us(F.linear, weights, x)}
        for cfg in CONFIGS:
            y = gemv(x, weights[0], None, cfg)
            err = float((y.double() - ref).norm() / ref.norm())
            assert err < 1e-2, (name, cfg, err)
            key = f"{cfg.block_n}x{cfg.block_k}w{cfg.num_warps}s{cfg.num_stages}"
            row[key] = time_us(lambda a, w, c=cfg: gemv(a, w, None, c), weights, x)
        results[name] = {m: nbytes / us / 1e3 for m, us in row.items()}  # GB/s
        best = max((m for m in row if m != "cublas"), key=lambda m: results[name][m])
        print(
            f"{name:8} cublas {results[name]['cublas']:7.0f} GB/s ({row['cublas']:7.1f} us)  "
            f"triton best {best} {results[name][best]:7.0f} GB/s ({row[best]:7.1f} us)",
            flush=True,
        )
        del weights
        torch.cuda.empty_cache()
    # One config for every shape: the best total time over the decode step's mix.
    layer_mix = {"qkv": 32, "o_proj": 32, "gate_up": 32, "down": 32, "lm_head": 1}

    def step_us(m: str) -> float:
        return sum(
            layer_mix[s] * SHAPES[s][0] * SHAPES[s][1] * 2 / results[s][m] / 1e3 for s in SHAPES
        )

    methods = [m for m in results["qkv"] if m != "cublas"]
    best_all = min(methods, key=step_us)
    print(
        f"decode-step GEMV time: cublas {step_us('cublas'):.0f} us, "
        f"triton {best_all} {step_us(best_all):.0f} us"
    )
    for s in SHAPES:
        r = results[s]
        print(f"  {s:8} cublas {r['cublas']:6.0f} GB/s  {best_all} {r[best_all]:6.0f} GB/s")
    write_out(
        "gemv.json", {"gb_per_s": results, "best_single": best_all, "machine": machine_info()}
    )


if __name__ == "__main__":
    main()
