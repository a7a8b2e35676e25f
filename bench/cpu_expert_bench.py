"""CPU time of one mixtral-8x7b expert (gate_up 28672 x 4096, down 4096 x 14336, bf16
activations) in each stored format at 1 and 16 tokens: what the Cold-Weights latency model's
CPU side costs on this host. Best of 3 calls after one warm-up; prints a table and writes
$OUT/cpu_expert.json when OUT is set.

    python bench/cpu_expert_bench.py [--formats int8,int4,native]
"""

from __future__ import annotations

import argparse
import functools

import torch

from hybridgen.benchmarks.report import machine_info, write_out
from hybridgen.experts.format import PackedMatrices, swiglu_packed
from hybridgen.placement.timing import best_of

HIDDEN, INTER = 4096, 14336


def expert_weights(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """One random mixtral-8x7b expert in bf16: gate_up [1, 2I, H], down [1, H, I]."""
    gate_up = (torch.randn(1, 2 * INTER, HIDDEN, generator=gen) * 0.02).bfloat16()
    return gate_up, (torch.randn(1, HIDDEN, INTER, generator=gen) * 0.02).bfloat16()


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--formats", default="int8,int4")
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    gate_up, down = expert_weights(gen)
    machine = machine_info()
    result = {"machine": machine, "threads": torch.get_num_threads(), "ms": {}}
    threads, commit = torch.get_num_threads(), machine["commit"][:10]
    print(f"one mixtral-8x7b expert on the CPU, {threads} threads, commit {commit}")
    for fmt in args.formats.split(","):
        gu = PackedMatrices.pack(gate_up, fmt)  # type: ignore[arg-type]
        dn = PackedMatrices.pack(down, fmt)  # type: ignore[arg-type]
        for tokens in (1, 16):
            x = torch.randn(tokens, HIDDEN, generator=gen).bfloat16()
            run = functools.partial(swiglu_packed, x, gu, dn, 0)
            ms = best_of(3, run, torch.device("cpu")) * 1e3
            result["ms"][f"{fmt} tokens={tokens}"] = ms
            mb = (gu.matrix_bytes + dn.matrix_bytes) / 2**20
            print(f"  {fmt:6} {tokens:2} tokens {ms:8.1f} ms  ({mb:.1f} MiB stored)", flush=True)
    write_out("cpu_expert.json", result)


if __name__ == "__main__":
    main()
