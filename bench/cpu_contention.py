"""One int4 mixtral-8x7b expert on the host's CPU at 1 and 4 tokens, alone, beside a process
that spins on a core (the GPU daemon's thread while it waits on the device) and, with CUDA,
beside host-to-device copies (a fetch's DMA reads host memory), at torch's thread count and
at one thread fewer: how much a parallel op loses when one of its threads shares a core, and
what device_topology.cpu.gpu_daemon_cores is for (bench/NOTES.md, B4, "Why the CPU is slower
while serving"). Best of 10 calls; prints a table, writes $OUT/cpu_contention.json.

    python bench/cpu_contention.py
"""

from __future__ import annotations

import multiprocessing as mp
import time
from collections.abc import Callable
from multiprocessing.synchronize import Event

import torch
from cpu_expert_bench import HIDDEN, expert_weights  # bench/, beside this script

from hybridgen.benchmarks.report import machine_info, write_out
from hybridgen.experts.format import PackedMatrices, swiglu_packed
from hybridgen.placement.timing import best_of, torch_threads


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
            rows.append({"beside": beside, "threads": threads, "t1_ms": ms[0], "t4_ms": ms[1]})
        stop.set()
        if other is not None:
            other.join()
    write_out("cpu_contention.json", {"machine": machine_info(), "rows": rows})
    print(f"one int4 mixtral-8x7b expert, best of 10 (ms); {cores} torch threads")
    print("| beside | threads | 1 token | 4 tokens |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['beside']} | {r['threads']} | {r['t1_ms']:.2f} | {r['t4_ms']:.2f} |")


if __name__ == "__main__":
    main()
