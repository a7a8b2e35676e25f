"""Where a long prompt's prefill spends its time: the engine's prefill of one prompt per
--prompt-len (its chunks of --chunk tokens, max_num_batched_tokens), timed, then profiled,
with the device time summed by kind of kernel: attention (the paged prefill kernel), GEMMs
(the projections), and the rest (norms, rope and the cache write, sampling, copies).

    python bench/profile_prefill.py [--model llama3-8b] [--budget-mb 24576]
        [--prompt-len 8192,32768] [--chunk 2048] [--device auto] [--out prefill.json]

For each length it prints the prefill's wall time, its tokens a second and the FLOP rate it
reached (dense: 2 x the layers' parameters a token; attention: 4 x query x key pairs x
heads x head_dim a layer, causal), then the time and share of each kind and the top
kernels. B6's prefill reached ~231 TFLOPS on an H100 at 6ad42fe (bench/NOTES.md, B6), a
quarter of the card's dense bf16 peak: this says which kernels hold it there. On a CPU (a
tiny model) it profiles the CPU's operators instead, which is what its test runs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from hybridgen.config.engine import EngineConfig
from hybridgen.engine.engine import Engine
from hybridgen.runtime import log
from hybridgen.sampling.params import SamplingParams

KINDS = (
    ("attention", ("prefill_kernel", "attention", "flash", "sdpa")),
    ("gemm", ("gemm", "gemv", "cutlass", "nvjet", "sm90_", "sm80_", "addmm", "aten::mm", "matmul")),
)
"""Kernel name fragments (lower case) that make a kernel of each kind; the rest is "other"."""
TOP = 12


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, fragments in KINDS:
        if any(f in low for f in fragments):
            return kind
    return "other"


def flops(engine: Engine, n: int, chunk: int) -> tuple[float, float]:
    """(dense, attention) FLOPs of an n-token prefill in chunks of `chunk` (module doc)."""
    spec = engine.spec
    embed = spec.vocab_size * spec.hidden_size
    params = sum(p.numel() for p in engine.loaded.model.parameters()) - embed
    pairs = 0.0
    for start in range(0, n, chunk):
        c = min(chunk, n - start)
        pairs += c * (start + (c + 1) / 2)  # causal: each query sees its context and itself
    attn = 4 * pairs * spec.num_heads * spec.head_dim * spec.num_layers
    return 2.0 * params * n, attn


def prefill_once(engine: Engine, prompt: list[int], tag: str) -> float:
    """Seconds from admission to the first token of a 1-token request for `prompt`."""
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    engine.add_request(tag, prompt, params)
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    return time.perf_counter() - start


def kernel_times(prof: Any, cuda: bool) -> list[tuple[str, float]]:
    """(name, seconds) of each kernel (each operator on a CPU), by self device time."""
    rows = []
    for evt in prof.key_averages():
        us = evt.self_device_time_total if cuda else evt.self_cpu_time_total
        if us > 0 and (not cuda or evt.device_type == torch.autograd.DeviceType.CUDA):
            rows.append((evt.key, us / 1e6))
    return sorted(rows, key=lambda r: -r[1])


def measure(engine: Engine, n: int, chunk: int, seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    vocab = engine.spec.vocab_size

    def prompt() -> list[int]:
        return torch.randint(0, vocab, (n,), generator=g).tolist()

    prefill_once(engine, prompt(), f"warm-{n}")  # compiles, allocator growth
    wall = prefill_once(engine, prompt(), f"timed-{n}")
    cuda = engine.device.type == "cuda"
    activities = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        prefill_once(engine, prompt(), f"profiled-{n}")
    kernels = kernel_times(prof, cuda)
    total = sum(s for _, s in kernels) or 1.0
    by_kind = {k: 0.0 for k, _ in KINDS} | {"other": 0.0}
    for name, s in kernels:
        by_kind[kind_of(name)] += s
    dense, attn = flops(engine, n, chunk)
    return {
        "prompt_len": n,
        "wall_s": wall,
        "tok_s": n / wall,
        "tflops": (dense + attn) / wall / 1e12,
        "dense_tflop": dense / 1e12,
        "attention_tflop": attn / 1e12,
        "profiled_s": total,
        "by_kind_s": by_kind,
        "top": [{"name": k, "s": s, "kind": kind_of(k)} for k, s in kernels[:TOP]],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--budget-mb", type=int, default=24576)
    ap.add_argument("--prompt-len", default="8192,32768")
    ap.add_argument("--chunk", type=int, default=2048, help="max_num_batched_tokens")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    lengths = [int(x) for x in args.prompt_len.split(",")]
    log.configure(level="warning")
    engine = Engine(
        EngineConfig(
            model=args.model,
            device=args.device,
            gpu_memory_mb=args.budget_mb,
            max_num_seqs=1,
            max_model_len=max(lengths) + 16,
            max_num_batched_tokens=args.chunk,
            prefix_reuse=False,
        )
    )
    try:
        results = [measure(engine, n, args.chunk, seed=n) for n in lengths]
    finally:
        engine.release()
    if args.out is not None:
        args.out.write_text(json.dumps({"model": args.model, "results": results}, indent=1) + "\n")
    for r in results:
        print(
            f"prompt {r['prompt_len']}: {r['wall_s'] * 1e3:.0f} ms, {r['tok_s']:.0f} tok/s, "
            f"{r['tflops']:.0f} TFLOPS ({r['dense_tflop']:.1f} dense + "
            f"{r['attention_tflop']:.1f} attention TFLOP)"
        )
        shares = ", ".join(
            f"{k} {s * 1e3:.0f} ms ({s / r['profiled_s']:.0%})" for k, s in r["by_kind_s"].items()
        )
        print(f"  profiled {r['profiled_s'] * 1e3:.0f} ms: {shares}")
        for t in r["top"]:
            print(f"  {t['s'] * 1e3:9.2f} ms  {t['kind']:9s} {t['name'][:90]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
