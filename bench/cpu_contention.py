"""One int4 mixtral-8x7b expert on the host's CPU, alone and beside a process that spins on a
core, at torch's thread count and at one thread fewer: how much a parallel op loses when one
of its threads shares a core (bench/NOTES.md, B4, "Why the CPU is slower while serving").

    python bench/cpu_contention.py
"""

from __future__ import annotations

import multiprocessing as mp
import time
from multiprocessing.synchronize import Event

import torch
from cpu_expert_bench import HIDDEN, expert_weights  # bench/, beside this script

from hybridgen.experts.format import PackedMatrices, swiglu_packed
from hybridgen.placement.timing import best_of


def _spin(stop: Event) -> None:
    while not stop.is_set():
        for _ in range(100_000):
            pass


def main() -> None:
    gen = torch.Generator().manual_seed(0)
    gate_up, down = (PackedMatrices.pack(w, "int4") for w in expert_weights(gen))
    x = torch.randn(1, HIDDEN, generator=gen).bfloat16()
    cpu = torch.device("cpu")
    cores = torch.get_num_threads()
    print(f"one int4 mixtral-8x7b expert at 1 token, best of 10 (ms); {cores} torch threads")
    for threads in sorted({cores, max(1, cores - 1)}, reverse=True):
        torch.set_num_threads(threads)
        alone = best_of(10, lambda: swiglu_packed(x, gate_up, down, 0), cpu) * 1e3
        stop = mp.Event()
        spinner = mp.Process(target=_spin, args=(stop,))
        spinner.start()
        time.sleep(0.2)
        beside = best_of(10, lambda: swiglu_packed(x, gate_up, down, 0), cpu) * 1e3
        stop.set()
        spinner.join()
        print(f"  {threads:3d} threads: alone {alone:6.2f}, beside a spinner {beside:6.2f}")


if __name__ == "__main__":
    main()
