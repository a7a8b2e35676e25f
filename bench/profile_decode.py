"""Where a batch-1 decode step of llama3-8b spends its time on the GPU (device tool only).

Prints the graph replay time alone (GPU time per step), the engine's step time (GPU plus
host gaps) and the top kernels by CUDA time.
"""

from __future__ import annotations

import time

import torch
from torch.profiler import ProfilerActivity, profile

from hybridgen import log
from hybridgen.engine_config import EngineConfig
from hybridgen.gpu_daemon.engine import Engine
from hybridgen.sampling.params import SamplingParams

log.configure(level="warning")
engine = Engine(
    EngineConfig(
        model="llama3-8b",
        gpu_memory_mb=40960,
        max_num_seqs=8,
        max_graph_batch=8,
        max_model_len=4096,
    )
)
params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
engine.add_request("p", list(range(1000, 1512)), params)
for _ in range(20):
    engine.step()
graphs = engine.runner.graphs
assert graphs is not None
g = graphs.graphs[1]
start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
start.record()
for _ in range(100):
    g.replay()
end.record()
torch.cuda.synchronize()
print(f"graph replay alone: {start.elapsed_time(end) / 100:.3f} ms/step")
t0 = time.perf_counter()
for _ in range(100):
    engine.step()
torch.cuda.synchronize()
print(f"engine.step: {(time.perf_counter() - t0) * 10:.3f} ms/step")
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    for _ in range(10):
        engine.step()
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))
print(
    prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60)
)
