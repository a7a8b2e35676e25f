"""Where a B7 decode token's time goes in the host layers (issue 23): llama3-70b int4 under a
24 GB budget, split between the CPU and the link, as `bench/served/b7.yaml` runs it.

    python bench/host_layer_profile.py [--config bench/served/b7.yaml] [--steps 8]

For each host projection call (models/host_layers.py: HostLayers.project), host wall-clock
marks: entering, the device's rows launched (after the input reached the host: `x_wait`),
the CPU's rows in the worker (`cpu`, started `cpu_lag` after the launch), leaving
(`result_lag` after the worker ended: the result's upload and join), the gap to the next
call (`between`: attention, norms, SiLU); and whether the link had delivered that part's
device rows when the CPU's were done (`link_late`). Per part, the means over the timed
decode steps; per step, the host layers' span and the rest (resident layers, sampling).
Then the same steps under variants that each test one explanation of the gap between a host
layer's time and max(CPU, link): the worker's torch threads one or two fewer than the cores
(the main thread's launches and syncs competing with the worker's spinning threads), and the
CPU's share moved by -0.05 / +0.05 (the balance). Prints a table last, writes JSON under
$OUT.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from hybridgen.benchmarks.report import machine_info, write_out
from hybridgen.config.file import load_config
from hybridgen.engine.engine import Engine
from hybridgen.models import host_layers as hl
from hybridgen.models.host_weights import HostProjection
from hybridgen.sampling.params import SamplingParams

MARKS = ("x_wait", "cpu_lag", "cpu", "result_lag", "between")


class Tracer:
    """Wraps HostLayers.project, HostLayers._cpu and HostProjection.device_linear to mark
    each projection call's phases (host clock)."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        self.on = False

    @contextmanager
    def installed(self) -> Iterator[None]:
        project, cpu = hl.HostLayers.project, hl.HostLayers._cpu
        device_linear = HostProjection.device_linear
        tracer = self

        def traced_project(self: hl.HostLayers, layer: int, part: int, x: torch.Tensor):  # type: ignore[no-untyped-def]
            if not tracer.on:
                return project(self, layer, part, x)
            call: dict[str, Any] = {"layer": layer, "part": part, "enter": time.perf_counter()}
            tracer.calls.append(call)
            out = project(self, layer, part, x)
            call["exit"] = time.perf_counter()
            return out

        def traced_cpu(self: hl.HostLayers, proj: HostProjection, x: torch.Tensor, key):  # type: ignore[no-untyped-def]
            start = time.perf_counter()
            out = cpu(self, proj, x, key)
            if tracer.on and tracer.calls:
                call = tracer.calls[-1]
                call["cpu_start"], call["cpu_end"] = start, time.perf_counter()
                ready = self._ready[key[0]][key[1]] if self._ready else None
                call["link_late"] = ready is not None and not ready.query()
            return out

        def traced_device_linear(self: HostProjection, staged, x):  # type: ignore[no-untyped-def]
            if tracer.on and tracer.calls:
                tracer.calls[-1]["dev"] = time.perf_counter()
            return device_linear(self, staged, x)

        hl.HostLayers.project = traced_project  # type: ignore[method-assign]
        hl.HostLayers._cpu = traced_cpu  # type: ignore[method-assign]
        HostProjection.device_linear = traced_device_linear  # type: ignore[method-assign]
        try:
            yield
        finally:
            hl.HostLayers.project = project  # type: ignore[method-assign]
            hl.HostLayers._cpu = cpu  # type: ignore[method-assign]
            HostProjection.device_linear = device_linear  # type: ignore[method-assign]


def phases(calls: list[dict[str, Any]]) -> dict[int, dict[str, float]]:
    """Per part: the mean ms of each mark over `calls` (one step's or several), and the
    share of calls whose link rows were late."""
    per: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for prev, call in zip([None, *calls[:-1]], calls, strict=True):
        p = per[call["part"]]
        if "cpu_start" in call:
            end_wait = call.get("dev", call["cpu_start"])
            p["x_wait"].append(end_wait - call["enter"])
            p["cpu_lag"].append(call["cpu_start"] - end_wait)
            p["cpu"].append(call["cpu_end"] - call["cpu_start"])
            p["result_lag"].append(call["exit"] - call["cpu_end"])
            p["link_late"].append(float(call["link_late"]))
        p["total"].append(call["exit"] - call["enter"])
        if prev is not None and prev["layer"] + (prev["part"] == 3) == call["layer"]:
            p["between"].append(call["enter"] - prev["exit"])
    return {
        part: {k: statistics.fmean(v) * (1 if k == "link_late" else 1e3) for k, v in d.items()}
        for part, d in sorted(per.items())
    }


def decode_steps(engine: Engine, tracer: Tracer, steps: int, prompt_len: int) -> dict:
    """One request of `prompt_len` tokens, then `steps` timed decode steps, traced."""
    params = SamplingParams(temperature=0.0, max_tokens=steps + 2, ignore_eos=True)
    engine.add_request(f"profile-{time.perf_counter()}", list(range(1, prompt_len + 1)), params)
    engine.step()  # the prefill (streamed)
    engine.step()  # a first decode step, untimed
    step_ms, host_ms, traced = [], [], []
    while engine.has_unfinished():
        tracer.calls.clear()
        tracer.on = True
        start = time.perf_counter()
        engine.step()
        end = time.perf_counter()
        tracer.on = False
        if not tracer.calls:
            continue
        step_ms.append((end - start) * 1e3)
        host_ms.append((tracer.calls[-1]["exit"] - tracer.calls[0]["enter"]) * 1e3)
        traced.extend(tracer.calls)
    layers = len({c["layer"] for c in traced}) or 1
    host = statistics.median(host_ms) if host_ms else 0.0
    return {
        "step_ms": statistics.median(step_ms) if step_ms else 0.0,
        "host_span_ms": host,
        "host_layer_ms": host / layers,
        "rest_ms": statistics.median(step_ms) - host if step_ms else 0.0,
        "parts": phases(traced),
    }


def variants(state: hl.HostLayers) -> list[tuple[str, int, float]]:
    """(name, the worker's torch threads, the CPU's share) of each variant."""
    f, cores, threads = state.fraction, os.cpu_count() or 1, torch.get_num_threads()
    return [
        ("default", threads, f),
        (f"worker threads {cores - 1}", cores - 1, f),
        (f"worker threads {cores - 2}", cores - 2, f),
        (f"share {f - 0.05:.3f}", threads, f - 0.05),
        (f"share {f + 0.05:.3f}", threads, f + 0.05),
    ]


def apply(state: hl.HostLayers, threads: int, share: float) -> None:
    """The worker thread's torch threads (set in that thread: OpenMP's count is per thread)
    and the CPU's share of each host layer's weight bytes."""
    state._pool().submit(torch.set_num_threads, max(threads, 1)).result()
    state.place(min(max(share, 0.0), 1.0))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="bench/served/b7.yaml")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    args = ap.parse_args(argv)
    config = load_config(args.config)
    engine = Engine(config.engine_config(args.device))
    state = engine.host_layers
    assert state is not None, "the config leaves no layer in host memory"
    tracer = Tracer()
    result: dict[str, Any] = {
        "machine": machine_info(),
        "config": args.config,
        "split_fraction": state.fraction,
        "host_layers": state.host_layers,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "variants": {},
    }
    try:
        with tracer.installed():
            for name, threads, share in variants(state):
                apply(state, threads, share)
                result["variants"][name] = decode_steps(engine, tracer, args.steps, args.prompt_len)
    finally:
        engine.release()
    write_out("host_layer_profile", result)
    print_table(result)


def print_table(result: dict[str, Any]) -> None:
    print(
        f"host layers {result['host_layers']}, split fraction {result['split_fraction']:.3f},"
        f" {result['cores']} cores, torch threads {result['torch_threads']}"
    )
    print("| variant | step ms | host span ms | a host layer ms | rest ms |")
    print("|---|---|---|---|---|")
    for name, v in result["variants"].items():
        print(
            f"| {name} | {v['step_ms']:.1f} | {v['host_span_ms']:.1f} | {v['host_layer_ms']:.2f}"
            f" | {v['rest_ms']:.1f} |"
        )
    print(f"| variant | part | {' | '.join(MARKS)} | total | link_late |")
    print(f"|---|---|{'---|' * len(MARKS)}---|---|")
    for name, v in result["variants"].items():
        for part, d in v["parts"].items():
            cells = [f"{d.get(k, 0.0):.3f}" for k in (*MARKS, "total")]
            print(f"| {name} | {part} | {' | '.join(cells)} | {d.get('link_late', 0.0):.2f} |")


if __name__ == "__main__":
    main()
