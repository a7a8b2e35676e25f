"""One int4 mixtral-8x7b expert on the host's CPU at 1 and 4 tokens, alone, beside a process
that spins on a core (the GPU daemon's thread while it waits on the device) and, with CUDA,
beside host-to-device copies (a fetch's DMA reads host memory), at torch's thread count and
at one thread fewer: how much a parallel op loses when one of its threads shares a core, and
what device_topology.cpu.gpu_daemon_cores is for (bench/NOTES.md, B4, "Why the CPU is slower
while serving"). Best of 10 calls; prints a table, writes $OUT/cpu_contention.json.

One expert called again and again may be read from the last-level cache (a server's is ~100
MB and more), which serving's experts, a different one each call, never are: "cold" calls each
read another of COLD_COPIES copies (~1.1 GB), as the CPU daemon does. On the H200's host the
warm figure was 1.2-1.7 ms at one token where the engine's start-up timed 4.8.

    python bench/cpu_contention.py
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import time
from collections.abc import Callable
from multiprocessing.synchronize import Event

import torch
from cpu_expert_bench import HIDDEN, expert_weights  # bench/, beside this script

from hybridgen.benchmarks.report import machine_info, write_out
from hybridgen.experts.format import PackedMatrices, swiglu_packed
from hybridgen.placement.timing import best_of, torch_threads

COLD_COPIES = 12
"""Copies of the expert the cold calls go round (12 x 94.5 MB), past any last-level cache."""


def _copies(m: PackedMatrices, n: int) -> list[PackedMatrices]:
    return [
        PackedMatrices(m.fmt, {k: v.clone() for k, v in m.parts.items()}, m.dtype) for _ in range(n)
    ]


def _spin(stop: Event) -> None:
    while not stop.is_set():
        for _ in range(100_000):
            pass


def _copy_to_device(stop: Event) -> None:
    src = torch.empty(1 << 28, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")
    while not stop.is_set():
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()


def main() -> None:
    gen = torch.Generator().manual_seed(0)
    gate_up, down = (PackedMatrices.pack(w, "int4") for w in expert_weights(gen))
    x = torch.randn(4, HIDDEN, generator=gen).bfloat16()
    cold = itertools.cycle(
        list(zip(_copies(gate_up, COLD_COPIES), _copies(down, COLD_COPIES), strict=True))
    )

    def cold_call() -> None:  # each call another copy: read from memory, not the cache
        swiglu_packed(x[:1], *next(cold), 0)

    cpu = torch.device("cpu")
    cores = torch.get_num_threads()
    besides: dict[str, Callable[[Event], None] | None] = {"alone": None, "a spinner": _spin}
    if torch.cuda.is_available():
        besides["H2D copies"] = _copy_to_device
    ctx = mp.get_context("spawn")  # CUDA in the copier
    rows = []
    for beside, target in besides.items():
        stop = ctx.Event()
        other = None if target is None else ctx.Process(target=target, args=(stop,))
        if other is not None:
            other.start()
            time.sleep(3.0)  # the interpreter's (and CUDA's) start-up
        for threads in sorted({cores, max(1, cores - 1)}, reverse=True):
            with torch_threads(threads):
                ms = [
                    best_of(10, lambda t=t: swiglu_packed(x[:t], gate_up, down, 0), cpu) * 1e3
                    for t in (1, 4)
                ]
                cold_ms = best_of(10, cold_call, cpu) * 1e3
            rows.append(
                {
                    "beside": beside,
                    "threads": threads,
                    "t1_ms": ms[0],
                    "t4_ms": ms[1],
                    "t1_cold_ms": cold_ms,
                }
            )
        stop.set()
        if other is not None:
            other.join()
    write_out("cpu_contention.json", {"machine": machine_info(), "rows": rows})
    print(f"one int4 mixtral-8x7b expert, best of 10 (ms); {cores} torch threads")
    print("| beside | threads | 1 token | 4 tokens | 1 token, cold |\n|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['beside']} | {r['threads']} | {r['t1_ms']:.2f} | {r['t4_ms']:.2f} "
            f"| {r['t1_cold_ms']:.2f} |"
        )


if __name__ == "__main__":
    main()
