"""The latency model that places each routed expert (Fiddler-style): the CPU's time for an
expert as a function of its routed tokens against fetching it into the device cache and
computing it there.

    cpu_s(t)   = cpu_fixed_s + t * cpu_s_per_token     (the weights are read once per call,
                                                          then each token adds its FLOPs)
    device_s   = expert_bytes / pcie_bytes_per_s + gpu_s   (fetch, then its share of the
                                                          layer's grouped launch, or a call)

A cached expert always runs on the device. An uncached one with t tokens, taken on its own,
runs on the CPU while cpu_s(t) < device_s (Fiddler's rule). When the CPU's experts run beside
the device's (the CPU daemon computes them while the device fetches and runs the rest), a
layer takes the longer of the two sides, so `cpu_experts` places a layer's uncached experts
one by one on the side that ends the layer sooner: with two misses and a CPU a little slower
than a fetch, one of them goes to the CPU.

Calibrated at start (`calibrate`): the CPU at 1 and 16 tokens, the copy and the device's
share of an expert (`_device_expert_s`) on CUDA. device_topology.cpu.bandwidth_gbps /
gpu.bandwidth_gbps, when set, replace the measured weight-read times (expert_bytes /
bandwidth on either side: both read the stored codes once); cold_weights.cpu_max_tokens pins
the crossover outright.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import partial

import torch

from hybridgen.experts.format import GROUP
from hybridgen.experts.grouped import finish_step, launch_hits, pack_step, step_table
from hybridgen.experts.store import ExpertCache, ExpertStore
from hybridgen.kernels import ops
from hybridgen.placement.timing import best_of, torch_threads

CPU_PCIE_BYTES_PER_S = 25e9
"""Host-to-device bandwidth assumed without a GPU to time (PCIe 4.0 x16 in practice); a
CPU-only engine never moves bytes anyway, the figure only drives the CPU-or-cache choice."""
CALIBRATION_TOKENS = (1, 16)
"""The two token counts the CPU is timed at."""
GROUPED_CALIBRATION_EXPERTS = 8
"""Pairs of the grouped launch timed against a launch of one (a token's top 8)."""
RUNS = 3
"""Timed calls per figure (the shortest counts)."""
CALIBRATION_ATTEMPTS = 3
"""Timings of the CPU at CALIBRATION_TOKENS, until one token takes no longer than sixteen."""
CPU_SCALE_WEIGHT = 0.1
"""Weight of each observation in LatencyModel.cpu_scale's moving average."""
CPU_SCALE_LIMIT = 8.0
"""One observation counts as at most this factor either way (a page fault, a stall)."""
EXPLORE_LAYERS = 64
"""cpu_scale learns only from experts the CPU computes, so a layer with misses, after this
many in a row that put none on the CPU, sends its fewest-token miss there anyway and learns
its time. A start-up timing or a few early experts that read too slow cannot keep the CPU
out for good: on the H200 (503b927) B4a's start-up timed an expert at 4.8 ms (1.1-1.7 in the
contention probe on the same host), and the CPU daemon computed 163 of 46,042 experts. At
B4a's 32 layers that is one CPU expert every two steps, at worst a few ms of a ~80 ms step
where the CPU is as slow as timed. (Before: each such layer moved cpu_scale 0.2 % towards the
start-up timing, which kept a pessimistic one.)"""


@dataclass
class LatencyModel:
    """CPU compute time against transfer time of one expert, as a function of its tokens."""

    cpu_fixed_s: float
    """CPU time of a call beyond its tokens: reading the expert's weights."""
    cpu_s_per_token: float
    """CPU time each routed token adds."""
    pcie_bytes_per_s: float
    """Host-to-device copy bandwidth (timed at start on CUDA)."""
    expert_bytes: int
    """gate_up and down of one expert, as stored: what a fetch copies."""
    gpu_s: float = 0.0
    """What one fetched expert adds on the device: its share of the layer's grouped launch
    (one call where there is none)."""
    max_cpu_tokens_override: int | None = None
    """config cold_weights.cpu_max_tokens: a fixed crossover instead of the timings."""
    cpu_scale: float = 1.0
    """What the CPU's experts have really taken against cpu_fixed_s + t * cpu_s_per_token,
    a moving average (observe_cpu): the start-up timing runs on an idle host, while serving
    the CPU computes beside the engine's own thread and, under the daemons, behind a ring."""

    remote_s: float = 0.0
    """Under the daemons: what one EXPERT_RUN round trip adds to the CPU daemon's compute (the
    rings, the wake-ups, the copies), a moving average (observe_remote); a layer that sends
    any expert to the CPU daemon pays it once."""

    _unused: int = field(default=0, init=False, repr=False)
    """Layers with misses in a row that put none on the CPU (_explore)."""

    def observe_remote(self, seconds: float) -> None:
        """One EXPERT_RUN took `seconds` from hand-over to answer beyond its compute."""
        self.remote_s += CPU_SCALE_WEIGHT * (max(seconds, 0.0) - self.remote_s)

    def observe_cpu(self, calls: int, tokens: int, seconds: float) -> None:
        """One layer's CPU experts, `calls` of them with `tokens` routed tokens in all, took
        `seconds` from their hand-over to their answer."""
        predicted = calls * self.cpu_fixed_s + tokens * self.cpu_s_per_token
        if predicted > 0:
            ratio = min(max(seconds / predicted, 1 / CPU_SCALE_LIMIT), CPU_SCALE_LIMIT)
            self.cpu_scale += CPU_SCALE_WEIGHT * (ratio - self.cpu_scale)

    @property
    def fetch_s(self) -> float:
        return self.expert_bytes / self.pcie_bytes_per_s

    def cpu_s(self, tokens: int) -> float:
        return (self.cpu_fixed_s + tokens * self.cpu_s_per_token) * self.cpu_scale

    @property
    def cpu_max_tokens(self) -> int:
        """Most tokens an uncached expert may have and still run on the CPU."""
        if self.max_cpu_tokens_override is not None:
            return self.max_cpu_tokens_override
        spare = self.fetch_s + self.gpu_s - self.cpu_s(0)  # what the tokens may cost
        if spare <= 0:
            return 0
        if self.cpu_s_per_token <= 0:
            return 2**31 - 1
        per_token = self.cpu_s_per_token * self.cpu_scale
        return max(math.ceil(spare / per_token) - 1, 0)  # the largest t below

    def cpu_experts(self, cached: int, uncached: list[tuple[int, int]], overlap: bool) -> set[int]:
        """Which of a layer's uncached experts, (id, routed tokens), the CPU computes, beside
        `cached` experts the device runs. Without `overlap` (the CPU's experts run in the
        engine's own thread) or with cpu_max_tokens pinned, each on its own; with it, the
        fewest-token experts first, each where the layer's later side ends sooner, the CPU's
        side starting with the round trip (remote_s)."""
        chosen: set[int] = set()
        if not overlap or self.max_cpu_tokens_override is not None:
            chosen = {e for e, tokens in uncached if tokens <= self.cpu_max_tokens}
            return self._explore(uncached, chosen)
        device_s, cpu_s = cached * self.gpu_s, 0.0
        for expert, tokens in sorted(uncached, key=lambda job: job[1]):
            cost = self.cpu_s(tokens) + (0.0 if chosen else self.remote_s)
            on_cpu = max(cpu_s + cost, device_s)
            on_device = max(cpu_s, device_s + self.fetch_s + self.gpu_s)
            if on_cpu < on_device:
                chosen.add(expert)
                cpu_s += cost
            else:
                device_s += self.fetch_s + self.gpu_s
        return self._explore(uncached, chosen)

    def _explore(self, uncached: list[tuple[int, int]], chosen: set[int]) -> set[int]:
        """`chosen`, or after EXPLORE_LAYERS layers with misses in a row and none on the CPU,
        the fewest-token miss (not where the crossover is pinned)."""
        if chosen:
            self._unused = 0
        if chosen or not uncached or self.max_cpu_tokens_override is not None:
            return chosen
        self._unused += 1
        if self._unused < EXPLORE_LAYERS:
            return chosen
        self._unused = 0
        return {min(uncached, key=lambda job: job[1])[0]}

    def figures(self) -> dict[str, float]:
        return {
            "cpu_fixed_us": self.cpu_fixed_s * 1e6,
            "cpu_us_per_token": self.cpu_s_per_token * 1e6,
            "fetch_us": self.fetch_s * 1e6,
            "gpu_us": self.gpu_s * 1e6,
            "cpu_scale": self.cpu_scale,
            "remote_us": self.remote_s * 1e6,
            "cpu_max_tokens": self.cpu_max_tokens,
        }


def calibrate(
    store: ExpertStore,
    cache: ExpertCache,
    device: torch.device,
    override: int | None,
    cpu_bandwidth_gbps: float | None = None,
    gpu_bandwidth_gbps: float | None = None,
    cpu_threads: int | None = None,
) -> LatencyModel:
    """Time expert 0 on the CPU at CALIBRATION_TOKENS (at `cpu_threads`, the pool that will
    compute them, if not this process's) and, on CUDA, its fetch into slot 0 (which nothing
    holds yet; the cache's counters are left untouched) and one call there."""
    lo, hi = CALIBRATION_TOKENS
    x = torch.randn(hi, store.hidden_size, dtype=store.gate_up.dtype)
    cpu = torch.device("cpu")
    for _ in range(CALIBRATION_ATTEMPTS):
        with torch_threads(cpu_threads):
            t_lo, t_hi = (best_of(RUNS, partial(store.run_cpu, 0, x[:n]), cpu) for n in (lo, hi))
        if t_lo <= t_hi:
            break
        # One token slower than sixteen: a stall (B4 at 7b4c420 timed 12.0 ms for an expert
        # that takes 1.5), which would keep the CPU out for good: cpu_scale learns only from
        # experts the CPU computes. Time both again.
    per_token = max((t_hi - t_lo) / (hi - lo), 0.0)
    fixed = max(t_lo - lo * per_token, 0.0)
    if cpu_bandwidth_gbps is not None:
        fixed = store.expert_bytes / (cpu_bandwidth_gbps * 1e9)
    bandwidth = CPU_PCIE_BYTES_PER_S
    if device.type == "cuda":

        def fetch() -> None:
            cache.gate_up.copy_(0, store.gate_up, 0, non_blocking=True)
            cache.down.copy_(0, store.down, 0, non_blocking=True)

        bandwidth = store.expert_bytes / max(best_of(RUNS, fetch, device), 1e-9)
    if gpu_bandwidth_gbps is not None:  # the stored weights, read once (fused kernels)
        gpu_s = store.expert_bytes / (gpu_bandwidth_gbps * 1e9)
    else:
        cache.gate_up.copy_(0, store.gate_up, 0, non_blocking=False)
        cache.down.copy_(0, store.down, 0, non_blocking=False)
        gpu_s = _device_expert_s(cache, x[:1].to(device))
    return LatencyModel(fixed, per_token, bandwidth, store.expert_bytes, gpu_s, override)


def _device_expert_s(cache: ExpertCache, x: torch.Tensor) -> float:
    """What one more expert adds to a layer's device time, for one token x [1, H]: where the
    step's device experts run in one grouped launch (models/moe.py), the launch over
    GROUPED_CALIBRATION_EXPERTS pairs less the launch over one, shared out (the launch's own
    cost is the layer's, paid with or without the expert); else one call. Both launches
    read slot 0 (the cache may have one slot yet: expert_cache_slots auto sizes it after).
    Timed as one call each, a layer of 28 experts (B4c at 4 streams) read as 28 calls of
    ~220 us on an H100, so the CPU daemon was handed misses it answered long after the
    device was done (served step 155 ms against 89 with no expert on the CPU, cf0aadf)."""
    if not ops.grouped_experts_usable(x, cache.gate_up.fmt):
        return best_of(RUNS, partial(cache.run, 0, x), x.device)

    def launch_s(n: int) -> float:
        table = step_table(
            pack_step(torch.arange(n)[None], dict.fromkeys(range(n), 0), []), n, x.device
        )
        weights = torch.full((1, n), 1 / n, device=x.device)
        return best_of(
            RUNS,
            lambda: finish_step(x, table, launch_hits(x, table, cache, GROUP), [], weights),
            x.device,
        )

    n = GROUPED_CALIBRATION_EXPERTS
    return max(launch_s(n) - launch_s(1), 0.0) / (n - 1)
