"""Where a batch-1 decode step of llama3-8b spends its time on the GPU (device tool only).

Prints the graph replay time alone (GPU time per step), the per-token time of a 256-token
greedy decode for several decode_steps (GPU plus host gaps: the gap is what a step costs
beyond the replay), and the top kernels by CUDA time over one multi-step group.
`--cublas` runs every projection through cuBLAS instead of the batch-1 Triton GEMV.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from hybridgen.config.engine import EngineConfig
from hybridgen.engine.engine import Engine
from hybridgen.kernels import ops
from hybridgen.runtime import log
from hybridgen.sampling.params import SamplingParams

log.configure(level="warning")
if "--cublas" in sys.argv:
    ops.USE_GEMV = False
engine = Engine(
    EngineConfig(
        model="llama3-8b",
        gpu_memory_mb=40960,
        max_num_seqs=8,
        max_graph_batch=8,
        max_model_len=4096,
    )
)
prompt = list(range(1000, 1512))


def decode_ms_per_token(steps: int, new_tokens: int = 256) -> float:
    """Median over 3 runs of the decode-only time per token at batch 1."""
    engine.config = dataclasses.replace(engine.config, decode_steps=steps)
    runs = []
    for r in range(4):
        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
        engine.add_request(f"p{steps}-{r}", prompt, params)
        engine.step()  # the prefill
        torch.cuda.synchronize()
        t0, n = time.perf_counter(), 0
        while engine.has_unfinished():
            n += sum(len(o.new_token_ids) for o in engine.step())
        torch.cuda.synchronize()
        if r:  # the first run warms up
            runs.append((time.perf_counter() - t0) * 1e3 / n)
    return sorted(runs)[1]


decode_ms_per_token(4)
graphs = engine.runner.graphs
assert graphs is not None
g = graphs.graphs[1]
start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
start.record()
for _ in range(100):
    g.replay()
end.record()
torch.cuda.synchronize()
replay = start.elapsed_time(end) / 100
print(f"graph replay alone: {replay:.3f} ms/step")
sweep = {}
for steps in (1, 4, 8, 16):
    ms = decode_ms_per_token(steps)
    sweep[steps] = ms
    print(
        f"decode_steps={steps:2d}: {ms:.3f} ms/token ({1e3 / ms:.1f} tok/s), "
        f"{ms - replay:.3f} ms beyond the replay"
    )
engine.config = dataclasses.replace(engine.config, decode_steps=8)
engine.add_request("prof", prompt, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
for _ in range(2):
    engine.step()
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    for _ in range(3):
        engine.step()
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=20, max_name_column_width=60))
print(
    prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60)
)
out = os.environ.get("OUT")
if out:
    name = "profile_decode.json" if ops.USE_GEMV else "profile_decode_cublas.json"
    with open(os.path.join(out, name), "w") as f:
        result = {"gemv": ops.USE_GEMV, "replay_ms": replay, "ms_per_token_by_steps": sweep}
        json.dump(result, f, indent=1)
