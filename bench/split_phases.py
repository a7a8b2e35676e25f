"""Where a split-mode decode step's layer time goes (device tool only): B3b's engine (llama3-8b,
24 GB, lossless Warm), a CONTEXT-token prompt, 24 decode steps with attn_warm MODE.

    python bench/split_phases.py CONTEXT MODE      e.g. 131072 split

Per Warm layer call, on the host clock: to_host (the CPU share's queries crossing, which
waits for the kernels that made them), dev_launch (queuing the device's share), cpu (the CPU
share) and join (its partial to the device, with a sync: the wait for the device's share).
The join's sync is the one added; the rest times the calls as they run. Prints one line.
Results: bench/results/split_phases_h200.txt.
"""

import os
import sys
import time

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
import torch

from hybridgen.benchmarks.engine_bench import random_prompts
from hybridgen.config.engine import EngineConfig
from hybridgen.engine.engine import Engine
from hybridgen.kvtiers import warm_context as wc
from hybridgen.kvtiers.warm_tier import warm_mb_for
from hybridgen.models.loader import load_model
from hybridgen.sampling.params import SamplingParams

ctx = int(sys.argv[1])
loaded = load_model("llama3-8b", torch.device("cuda"), None, 0)
spec = loaded.model.spec
cfg = EngineConfig(
    model="llama3-8b",
    gpu_memory_mb=24576,
    max_num_seqs=1,
    max_model_len=ctx + 100,
    max_num_batched_tokens=2048,
    prefix_reuse=False,
    warm_codec="lossless",
    attn_warm=sys.argv[2],
    warm_pool_mb=warm_mb_for(spec, "lossless", 16, ctx + 100),
)
eng = Engine(cfg, loaded=loaded)
phases = {"to_host": 0.0, "dev_launch": 0.0, "cpu": 0.0, "join": 0.0, "calls": 0}
orig_host, orig_dev, orig_cpu = wc._to_host, None, eng.warm.cpu_partial
marks = {}


def to_host(q):
    t = time.perf_counter()
    r = orig_host(q)
    marks["h"] = time.perf_counter()
    phases["to_host"] += marks["h"] - t
    return r


orig_devp = eng.warm.device_partial


def devp(*a, **k):
    t = time.perf_counter()
    r = orig_devp(*a, **k)
    phases["dev_launch"] += time.perf_counter() - t
    return r


def cpup(*a, **k):
    t = time.perf_counter()
    r = orig_cpu(*a, **k)
    t2 = time.perf_counter()
    phases["cpu"] += t2 - t
    o, s = r
    t3 = time.perf_counter()
    o2 = o.to("cuda")
    s2 = s.to("cuda")
    torch.cuda.current_stream().synchronize()
    phases["join"] += time.perf_counter() - t3
    phases["calls"] += 1
    return o2, s2


wc._to_host = to_host
eng.warm.device_partial = devp
eng.warm.cpu_partial = cpup
prompt = random_prompts(1, ctx, spec.vocab_size, seed=1)[0]
eng.add_request("p", prompt, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
t_steps = []
while eng.has_unfinished():
    if eng.seqs["p"].num_computed_tokens >= ctx and not t_steps:
        for k in phases:
            phases[k] = 0
    t = time.perf_counter()
    outs = eng.step()
    torch.cuda.synchronize()
    dt = time.perf_counter() - t
    if eng.seqs.get("p") is None or eng.seqs["p"].num_computed_tokens > ctx:
        t_steps.append(dt)
n = max(phases["calls"], 1)
print(
    "TABLE",
    sys.argv[2],
    "steps",
    len(t_steps),
    "step_ms",
    1e3 * sum(t_steps[2:]) / max(len(t_steps) - 2, 1),
    {k: round(1e3 * v / n, 3) for k, v in phases.items() if k != "calls"},
    "calls",
    phases["calls"],
    "share",
    eng.warm.split,
)
