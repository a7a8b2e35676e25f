"""CPU time of one mixtral-8x7b int4 expert at 1 and 4 tokens by torch thread count, alone,
beside busy-looping processes (the GPU daemon's thread spins while it waits on the device)
and beside host-to-device copies (a fetch's DMA reads host memory): what
device_topology.cpu.gpu_daemon_cores is for. Mean of 8 calls after one warm-up; prints a
table and writes $OUT/cpu_expert_contention.json when OUT is set.

    python bench/cpu_expert_contention.py [--beside alone,spin1,spin2,h2d] [--threads 16,15,8]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time
from multiprocessing.synchronize import Event

import torch
from cpu_expert_bench import expert_weights

from hybridgen.benchmarks.report import machine_info, write_out
from hybridgen.experts.format import PackedMatrices, swiglu_packed

CALLS = 8


def spin(stop: Event) -> None:
    while not stop.is_set():
        pass


def copy_to_device(stop: Event) -> None:
    src = torch.empty(1 << 28, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")
    while not stop.is_set():
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()


def mean_ms(threads: int, gate_up: PackedMatrices, down: PackedMatrices, x: torch.Tensor) -> float:
    torch.set_num_threads(threads)
    swiglu_packed(x, gate_up, down, 0)
    start = time.perf_counter()
    for _ in range(CALLS):
        swiglu_packed(x, gate_up, down, 0)
    return (time.perf_counter() - start) / CALLS * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--beside", default="alone,spin1,spin2,h2d")
    ap.add_argument("--threads", default=None, help="default: all, all but one, half")
    args = ap.parse_args()
    n = torch.get_num_threads()
    counts = sorted(
        set(map(int, (args.threads or f"{n},{max(n - 1, 1)},{max(n // 2, 1)}").split(","))),
        reverse=True,
    )
    gate_up, down = expert_weights(torch.Generator().manual_seed(0))
    gu, dn = PackedMatrices.pack(gate_up, "int4"), PackedMatrices.pack(down, "int4")
    x = torch.randn(4, gate_up.shape[-1], dtype=torch.bfloat16)
    ctx = mp.get_context("spawn")
    rows = []
    for beside in args.beside.split(","):
        stop = ctx.Event()
        target = copy_to_device if beside == "h2d" else spin
        count = 1 if beside in ("alone", "h2d") else int(beside.removeprefix("spin"))
        procs = (
            []
            if beside == "alone"
            else [ctx.Process(target=target, args=(stop,)) for _ in range(count)]
        )
        for p in procs:
            p.start()
        time.sleep(3.0 if beside == "h2d" else 0.5)  # CUDA's start-up
        for threads in counts:
            t1, t4 = (mean_ms(threads, gu, dn, x[:t]) for t in (1, 4))
            rows.append({"beside": beside, "threads": threads, "t1_ms": t1, "t4_ms": t4})
        stop.set()
        for p in procs:
            p.join()
    write_out("cpu_expert_contention.json", {"machine": machine_info(), "rows": rows})
    print("| beside | threads | 1 token ms | 4 tokens ms |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['beside']} | {r['threads']} | {r['t1_ms']:.2f} | {r['t4_ms']:.2f} |")


if __name__ == "__main__":
    main()
