"""Batch-1 decode time per token of tiny-mixtral on the CPU with Cold-Weights (a device
cache of 24 of its 32 experts, the rest computed on the CPU), best of 3 runs of 128 tokens:
with tiny matrices this is the host's own time per step, the cost of the MoE block's ops
and syncs that a GPU decode without CUDA graphs pays too. Prints ms per token and the torch
ops dispatched per MoE layer; writes $OUT/moe_decode_cpu.json when OUT is set.

    python bench/moe_decode_cpu.py [--format native|int8|int4]
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from hybridgen.benchmarks.report import machine_info, write_out
from hybridgen.config.engine import EngineConfig
from hybridgen.engine.engine import Engine
from hybridgen.models.moe import moe_blocks
from hybridgen.sampling.params import SamplingParams

TOKENS = 128


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--format", default="native", choices=("native", "int8", "int4"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    config = EngineConfig(
        model="tiny-mixtral",
        device="cpu",
        expert_cache_slots=24,
        expert_format=args.format,
        max_num_seqs=1,
        max_model_len=512,
    )
    engine = Engine(config)
    greedy = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
    engine.generate([[5, 6, 7, 8]], greedy)  # warm-up
    runs = []
    for i in range(3):
        start = time.perf_counter()
        engine.generate([[5, 6, 7, 9 + i]], greedy)
        runs.append((time.perf_counter() - start) / TOKENS * 1e3)
    block = moe_blocks(engine.loaded.model)[1]
    x = torch.randn(1, engine.spec.hidden_size)
    block(x)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        block(x)
    ops = sum(1 for e in prof.events() if e.name.startswith("aten::") and e.cpu_parent is None)
    machine = machine_info()
    commit = machine["commit"][:10]
    result = {
        "machine": machine,
        "format": args.format,
        "ms_per_token": min(runs),
        "runs_ms_per_token": runs,
        "top_level_ops_per_moe_layer": ops,
    }
    listed = ", ".join(f"{r:.3f}" for r in runs)
    print(
        f"tiny-mixtral {args.format}, commit {commit}: {min(runs):.3f} ms per token "
        f"(runs {listed}), {ops} torch ops per MoE layer"
    )
    write_out("moe_decode_cpu.json", result)


if __name__ == "__main__":
    main()
