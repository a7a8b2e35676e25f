"""The sparse mixture-of-experts block of Mixtral, Qwen2-MoE and Qwen3-MoE, which replaces
the dense MLP of a decoder layer.

A router scores every expert for each token and keeps the top k; each kept expert is an
ordinary SwiGLU MLP that sees only the tokens routed to it, so a step costs one matmul pair
per *active* expert. The router (`route`) and the per-expert call (`run_expert`) stay separate
methods: expert offloading hooks in at `run_expert`, without touching the routing. With
Cold-Weights on (`to_cold_weights`), the experts live in host memory (expert_store.py) and each
one runs on the CPU or from the shared device cache, as the latency model places the layer's
uncached experts (expert_latency.LatencyModel.cpu_experts).

Order of operations and dtypes follow transformers' MixtralSparseMoeBlock (and Qwen's), so
fp32 results are HF's to the last bit up to matmul blocking:
  logits = x W_gate^T (model dtype) -> softmax in fp32 -> top-k -> divide by their sum (fp32;
  Qwen2-MoE's norm_topk_prob false skips it);
  out[t] = sum over its experts, ascending id, of (expert_e(x[t]) * w[t, e]).to(model dtype);
  Qwen2-MoE then adds its shared expert, sigmoid(x W_sg^T) * shared(x), a dense MLP that every
  token runs: it stays on the device with the router, only the routed experts move.
  DeepSeek-V2's shared experts are one such MLP without a gate; its router (grouped top-k,
  scaled weights) is deepseek_moe.py's subclass, which overrides `router_logits` and `pick`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog
import torch
from torch import nn

from hybridgen.experts.format import GROUP, PackedMatrices
from hybridgen.experts.grouped import (
    copied_last,
    finish_step,
    launch_hits,
    launch_many,
    pack_step,
    step_table,
)
from hybridgen.experts.latency import LatencyModel, calibrate
from hybridgen.experts.store import ExpertCache, ExpertStore, MoeStats, RemoteDown
from hybridgen.kernels import ops
from hybridgen.models.spec import ModelSpec
from hybridgen.runtime.upload import upload

log = structlog.get_logger()

SIDE_COPY_BYTES = 16 << 20
"""A layer's misses of at least this many bytes (~0.3 ms at the link's ~52 GB/s, more than the
~0.25 ms of host time that launching the layer eagerly costs where a CUDA graph would run it)
are copied on a side stream while the device computes the layer's cache hits: a mixtral-8x7b
int4 expert (99 MB, 1.9 ms) always, a qwen3-30b-a3b one (2.4 MB) only with six others."""


class StepRows:
    """A step of several tokens grouped by expert: each expert's (token, position in the top
    k) pairs, row-major, on the host. They go to the device in one copy, made only when some
    expert's rows are first asked for: the grouped launch reads the cache hits' pairs from
    its own table, so a step whose experts all hit copies nothing here."""

    def __init__(self, ids: torch.Tensor, device: torch.device) -> None:
        self.top_k = ids.shape[1]
        self.device = device
        by_expert: dict[int, list[int]] = {}
        for p, e in enumerate(ids.flatten().tolist()):
            by_expert.setdefault(e, []).append(p)
        self.experts = sorted(by_expert)
        self.counts = [len(by_expert[e]) for e in self.experts]
        self._flat = [p for e in self.experts for p in by_expert[e]]
        self._start: dict[int, int] = {}
        start = 0
        for e, n in zip(self.experts, self.counts, strict=True):
            self._start[e], start = start, start + n
        self._packed: torch.Tensor | None = None

    def on_device(self, expert: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`expert`'s rows of x and positions in the top k [tokens] each, on the device."""
        if self._packed is None:
            flat = torch.tensor(self._flat)
            # [2, T * k]: rows, positions
            self._packed = upload(torch.stack([flat // self.top_k, flat % self.top_k]), self.device)
        start = self._start[expert]
        return self._packed[0, start : start + tokens], self._packed[1, start : start + tokens]


@dataclass(frozen=True)
class Routed:
    """One expert of a step and the tokens routed to it."""

    expert: int
    tokens: int
    step: StepRows | None
    """The step's grouping; None for a step of one token."""
    position: int = 0
    """A one-token step's position of the expert in its top k."""

    @property
    def rows(self) -> torch.Tensor | slice:
        """Their rows of x [N], or every row (a step of one token: a view, no gather)."""
        if self.step is None:
            return slice(None)
        return self.step.on_device(self.expert, self.tokens)[0]

    @property
    def slot(self) -> torch.Tensor | int:
        """Their positions in the top k [N], or the one position of a one-token step."""
        if self.step is None:
            return self.position
        return self.step.on_device(self.expert, self.tokens)[1]


Sent = tuple[int, dict[int, torch.Tensor], float]
"""An EXPERT_RUN handed to the CPU daemon: (request number, {expert: its rows}, when)."""


@dataclass(frozen=True)
class Placement:
    """One step's experts and where each runs, decided before any of them is computed."""

    routed: list[Routed]
    """The step's experts in ascending order, each with its tokens."""
    on_cpu: set[int]
    """Those the CPU computes: the latency model's pick among the uncached (Cold-Weights)."""
    remote: Sent | None
    """The CPU daemon's request for them, already sent; None: they are computed here."""


class SparseMoeBlock(nn.Module):
    """`gate` ([E, H] router weight), `experts` (E dense MLPs of spec.expert_size) and, with
    a shared expert, `shared_expert` and `shared_expert_gate` ([1, H]); names follow HF's
    `mlp.`. `expert(spec, width)` builds one MLP.

    Cold-Weights: `experts` is empty and `store` holds their weights in host memory.
    """

    def __init__(self, spec: ModelSpec, expert: Callable[[ModelSpec, int], nn.Module]) -> None:
        super().__init__()
        self.num_experts, self.top_k = spec.num_local_experts, spec.num_experts_per_tok
        self.norm_topk = spec.norm_topk_prob
        self.cast_weights = spec.router_weights_in_model_dtype
        self.gate = nn.Linear(spec.hidden_size, self.num_experts, bias=False)
        self.experts = nn.ModuleList(
            expert(spec, spec.expert_size) for _ in range(self.num_experts)
        )
        self.shared_expert: nn.Module | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if spec.shared_expert_intermediate_size:
            self.shared_expert = expert(spec, spec.shared_expert_intermediate_size)
        if spec.shared_expert_intermediate_size and spec.shared_expert_gated:
            self.shared_expert_gate = nn.Linear(spec.hidden_size, 1, bias=False)
        self.gate_on = "gpu"
        """Where route() picks experts: gpu (on the model's device) or cpu (the router's
        logits to the host first; placements.moe_gate)."""
        self.store: ExpertStore | None = None
        self.cold: tuple[int, ExpertCache, LatencyModel] | None = None
        """Cold-Weights: (this layer's index, the shared device cache, the latency model)."""

    def experts_to_host(self) -> ExpertStore:
        """This block's experts' weights as a native host ExpertStore (the loader converts it
        to the configured format); the expert modules go."""
        if self.store is None:
            gate_up = [e.get_parameter("gate_up_proj.weight").detach().cpu() for e in self.experts]
            down = [e.get_parameter("down_proj.weight").detach().cpu() for e in self.experts]
            self.store = ExpertStore(
                PackedMatrices.pack(torch.stack(gate_up), "native"),
                PackedMatrices.pack(torch.stack(down), "native"),
            )
            self.experts = nn.ModuleList()
        return self.store

    def to_cold_weights(self, layer: int, cache: ExpertCache, latency: LatencyModel) -> None:
        """Run the experts from host memory: on the CPU or through `cache`, per step."""
        assert self.store is not None, "experts_to_host first"
        self.cold = (layer, cache, latency)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, H] -> (expert ids [T, k] int64, weights [T, k] fp32 summing to 1 per token,
        on x's device). With the gate on the CPU the same math runs on the host, and the ids
        stay there: the host groups the tokens by expert from them."""
        logits = self.router_logits(x)
        if self.gate_on == "cpu":
            ids, weights = self.pick(logits.cpu())
            return ids, weights.to(x.device, non_blocking=True)
        return self.pick(logits)

    def router_logits(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, H] -> every expert's score [T, E], in the model dtype as HF."""
        return ops.linear(x, self.gate.weight)

    def logits_dtype(self) -> torch.dtype:
        """The dtype router_logits returns."""
        return self.gate.weight.dtype

    def pick(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Router logits [T, E] -> (expert ids [T, k], weights [T, k]) on their device."""
        return route_top_k(logits, self.top_k, self.norm_topk, self.cast_weights)

    def run_expert(self, expert: int, x: torch.Tensor, on_cpu: bool = False) -> torch.Tensor:
        """x: [N, H], the tokens routed to `expert` -> its MLP output [N, H]; with Cold-Weights
        on the CPU when `on_cpu`, else from the device cache."""
        if self.store is None:
            return self.experts[expert](x)
        if self.cold is None:  # host experts without a device cache: all on the CPU
            return self.store.run_cpu(expert, x)
        layer, cache, latency = self.cold
        if on_cpu:
            cache.stats.cpu_experts += 1
            rows = x.to("cpu")
            start = time.perf_counter()
            y = self.store.run_cpu(expert, rows)
            latency.observe_cpu(1, rows.shape[0], time.perf_counter() - start)
            return y.to(x.device)
        slot = cache.fetch(layer, expert, self.store)
        cache.stats.gpu_experts += 1
        return cache.run(slot, x)

    def shared(self, x: torch.Tensor) -> torch.Tensor | None:
        """The shared expert's output on x [T, H] (on the device), gated if it has a gate, or
        None without one."""
        if self.shared_expert is None:
            return None
        if self.shared_expert_gate is None:
            return self.shared_expert(x)
        gate = torch.sigmoid(ops.linear(x, self.shared_expert_gate.weight))  # [T, 1]
        return gate * self.shared_expert(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return add_shared(self.combine(x, *self.route(x)), self.shared(x))

    def combine(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The routed experts' outputs on x [T, H], weighted and summed -> [T, H]. ids [T, k]
        on the host or x's device (route()'s), weights [T, k] on x's device."""
        if self.cold is not None and ops.grouped_experts_usable(x, self.cold[1].gate_up.fmt):
            ids = ids.cpu()
            if len(x) <= ops.GROUPED_STEP_ROWS or self._any_grouped(ids):
                return self._combine_grouped(x, ids, weights)
        placed = self._place(x, ids, x.device)
        routed = placed.routed
        ys = self._run_placed(x, placed, routed)
        # Ascending expert order fixes each token's summation order (HF's, too); one token
        # adds its experts' outputs up directly, which is the same sum from zero.
        out = torch.zeros_like(x) if x.shape[0] > 1 else None  # [T, H]
        for r in routed:
            y = (ys[r.expert] * weights[r.rows, r.slot, None]).to(x.dtype)
            if out is None:
                out = y
            elif isinstance(r.rows, slice):
                out = out + y
            else:
                out.index_add_(0, r.rows, y)
        assert out is not None
        return out

    def _any_grouped(self, ids: torch.Tensor) -> bool:
        """Whether an expert of a large step (ids [T, k] on the host) runs in a grouped
        launch: its fewest-token expert does if any does. A step whose experts all have more
        rows than the grouped GEMM takes (a mixtral prompt of 1,024 tokens: ~256 an expert)
        would pay the grouped path's host table (0.15 ms a layer for 2,048 pairs since it is
        built with numpy, 0.9-2.6 ms before) for nothing."""
        assert self.cold is not None
        counts = torch.bincount(ids.flatten())
        fewest = int(counts[counts > 0].min())
        return ops.grouped_expert_takes(fewest, self.cold[1].gate_up.fmt) is not None

    def _combine_grouped(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """combine() with the device's experts in grouped launches (experts/grouped.py); ids
        on the host. The CPU's experts go first (to the CPU daemon, if any); then the cache's
        hits take their slots and the misses are copied into slots no other expert of the step
        reads (ExpertCache.fetch_beside), and all of them run in the launches: the grouped
        GEMV for experts of up to MAX_ROWS rows, the grouped GEMM (int4) for more, a prompt's
        step. A miss that finds no such slot (every scratch slot taken) runs on its own after
        the launches, and the CPU daemon's answer is collected last. One expert run at a time
        cost a miss some ten launches and ~0.2 ms of host time (B4c at 4 streams, ~3 misses a
        layer)."""
        assert self.cold is not None and self.store is not None
        layer, cache, _ = self.cold
        fmt = cache.gate_up.fmt
        placed = self._place(x, ids, x.device)  # rows on the device: x[rows] waits for nothing
        launch = {
            r.expert: how
            for r in placed.routed
            if r.expert not in placed.on_cpu
            and (how := ops.grouped_expert_takes(r.tokens, fmt)) is not None
        }
        on_device = [r for r in placed.routed if r.expert in launch]
        # Hits first, so that no miss's copy takes the slot of one of the step's hits.
        on_device.sort(key=lambda r: (layer, r.expert) not in cache)
        misses = sum((layer, r.expert) not in cache for r in on_device)
        side = misses * cache.expert_bytes >= SIDE_COPY_BYTES
        slots: dict[int, int] = {}
        taken: set[int] = set()
        copied: set[int] = set()  # the misses' slots
        for r in on_device:
            hit = (layer, r.expert) in cache
            slot = cache.fetch_beside(layer, r.expert, self.store, taken, side)
            if slot is not None:
                slots[r.expert] = slot
                taken.add(slot)
                if not hit:
                    copied.add(slot)
        cache.stats.gpu_experts += len(slots)
        few = {e: s for e, s in slots.items() if launch[e] == "gemv"}
        many = {e: s for e, s in slots.items() if launch[e] == "gemm"}
        others = [r for r in placed.routed if r.expert not in slots]
        many_rows = sum(r.tokens for r in placed.routed if r.expert in many)
        packed = pack_step(
            ids,
            few,
            [r.expert for r in others],
            many,
            ops.grouped_gemm_block_m(many_rows, len(many)),
        )
        if not side or not copied:
            # graphs only for steps of up to MAX_ROWS rows (decode batches), not each chunk size
            if (
                not others
                and cache.hit_launches is not None
                and ops.grouped_expert_takes(len(x), fmt) == "gemv"
            ):
                return cache.hit_launches.run(x, packed, weights)
            table = step_table(packed, ids.shape[1], x.device)
            y = launch_hits(x, table, cache, GROUP)
            full = launch_many(x, table, cache, GROUP)
            ys = self._run_placed(x, placed, others)
            return finish_step(x, table, y, [ys[r.expert] for r in others], weights, full)
        # The misses are being copied on a side stream: the hits run first, beside the copies.
        packed, early = copied_last(packed, copied)
        table = step_table(packed, ids.shape[1], x.device)
        y_hits = launch_hits(x, table, cache, GROUP, slice(None, early))
        cache.side_copies_done()
        y_copied = launch_hits(x, table, cache, GROUP, slice(early, None))
        parts = [t for t in (y_hits, y_copied) if t is not None]
        y = torch.cat(parts) if parts else None  # none: every expert had many rows
        full = launch_many(x, table, cache, GROUP)
        ys = self._run_placed(x, placed, others)
        other_ys = [ys[r.expert] for r in others]
        return finish_step(x, table, y, other_ys, weights, full, in_order=False)

    def _place(self, x: torch.Tensor, ids: torch.Tensor, device: torch.device) -> Placement:
        """What both combine paths do before computing: the step's experts grouped (their rows
        on `device`) and counted, the CPU's picked, and under the daemons handed to the CPU
        daemon first, so that it computes them while the device runs the others."""
        routed = self._group(ids, device)
        if self.cold is not None:
            self.cold[1].stats.count_routed(self.cold[0], [(r.expert, r.tokens) for r in routed])
        on_cpu = self._cpu_experts(routed)
        return Placement(routed, on_cpu, self._send_cpu_experts(x, routed, on_cpu))

    def _run_placed(
        self, x: torch.Tensor, placed: Placement, experts: list[Routed]
    ) -> dict[int, torch.Tensor]:
        """{expert: its output [N, H]} for `experts` of `placed`: each run here (on the CPU,
        or from the device cache, fetched if missing), except those sent to the CPU daemon,
        whose answer is awaited only after the others were launched."""
        sent = placed.remote[1] if placed.remote is not None else {}
        ys = {
            r.expert: self.run_expert(r.expert, x[r.rows], r.expert in placed.on_cpu)
            for r in experts
            if r.expert not in sent
        }
        if placed.remote is not None:
            ys.update(self._collect_cpu_experts(x, *placed.remote))
        return ys

    @staticmethod
    def _group(ids: torch.Tensor, device: torch.device) -> list[Routed]:
        """The step's experts in ascending order, each with its tokens (rows in ascending
        order). One token (decode at batch 1) reads its k ids back once and gathers nothing;
        more read the ids back once and group them on the host (StepRows), whose rows reach
        `device` in one copy if any expert's are used (a copy per expert waited each time for
        the device's work so far; a slice per expert cost ~5 us of host time each)."""
        if ids.shape[0] == 1:
            experts = ids[0].tolist()
            order = sorted(range(len(experts)), key=experts.__getitem__)
            return [Routed(experts[k], 1, None, k) for k in order]
        step = StepRows(ids.cpu(), device)
        return [Routed(e, n, step) for e, n in zip(step.experts, step.counts, strict=True)]

    def _cpu_experts(self, routed: list[Routed]) -> set[int]:
        """The experts of this step the CPU computes: under Cold-Weights, the latency model's
        pick among those not in the device cache."""
        if self.cold is None:
            return set()
        layer, cache, latency = self.cold
        uncached = [(r.expert, r.tokens) for r in routed if (layer, r.expert) not in cache]
        cached = len(routed) - len(uncached)
        return latency.cpu_experts(cached, uncached, overlap=cache.remote is not None)

    def _send_cpu_experts(
        self,
        x: torch.Tensor,
        routed: list[Routed],
        on_cpu: set[int],
    ) -> Sent | None:
        """EXPERT_RUN for the experts in `on_cpu`, when the CPU daemon computes them:
        (request number, {expert: its rows}, when they were handed over, time.monotonic());
        None to compute them here."""
        if self.cold is None or self.cold[1].remote is None or not on_cpu:
            return None
        layer, cache, _ = self.cold
        jobs = {r.expert: x[r.rows] for r in routed if r.expert in on_cpu}
        start = time.monotonic()
        try:
            return cache.remote.submit(layer, list(jobs.items())), jobs, start  # type: ignore[union-attr]
        except RemoteDown as exc:
            self._drop_remote(exc)
            return None

    def _collect_cpu_experts(
        self, x: torch.Tensor, seq: int, jobs: dict[int, torch.Tensor], start: float
    ) -> dict[int, torch.Tensor]:
        """The CPU daemon's answer to `seq` on x's device (computed here if it fails); its
        compute time and the rest of the time from `start` to the answer's writing (the round
        trip) go to the latency model. Read up to the wait here, the round trip took in the
        device's launches between (700-3,000 us a layer in B4c at 50c05cc, on an H100)."""
        assert self.cold is not None and self.store is not None
        _, cache, latency = self.cold
        try:
            assert cache.remote is not None
            computed = cache.remote.cpu_s
            ys = cache.remote.wait(seq, list(jobs.items()))
            computed = cache.remote.cpu_s - computed
            tokens = sum(rows.shape[0] for rows in jobs.values())
            latency.observe_cpu(len(jobs), tokens, computed)
            latency.observe_remote(cache.remote.answered_at - start - computed)
            cache.stats.cpu_daemon_experts += len(jobs)
        except RemoteDown as exc:
            self._drop_remote(exc)
            ys = [self.store.run_cpu(e, rows) for e, rows in jobs.items()]
        cache.stats.cpu_experts += len(jobs)
        return {e: y.to(x.device) for e, y in zip(jobs, ys, strict=True)}

    def _drop_remote(self, exc: RemoteDown) -> None:
        """The CPU daemon stopped answering: every layer computes its CPU experts here now
        (a dead CPU daemon restarts the pair anyway)."""
        assert self.cold is not None
        log.warning("expert_link_down", reason=str(exc))
        self.cold[1].remote = None


def route_top_k(
    logits: torch.Tensor, k: int, normalize: bool = True, cast: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """A router's pick from its logits [T, E]: softmax in fp32, the top k, renormalised to
    sum to 1 per token when `normalize` (HF's order) -> (expert ids [T, k], weights [T, k],
    fp32, or in the logits' dtype when `cast`)."""
    weights, ids = torch.topk(torch.softmax(logits.float(), dim=-1), k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights.to(logits.dtype) if cast else weights


def add_shared(routed: torch.Tensor, shared: torch.Tensor | None) -> torch.Tensor:
    """The routed experts' sum plus the shared expert's output, if any (HF's order)."""
    return routed if shared is None else routed + shared


def moe_blocks(model: nn.Module) -> list[SparseMoeBlock]:
    """A model's sparse MoE blocks, in layer order."""
    return [m for m in model.modules() if isinstance(m, SparseMoeBlock)]


def enable_cold_weights(
    blocks: list[SparseMoeBlock],
    slots: int,
    cpu_max_tokens: int | None,
    device: torch.device,
    bandwidths_gbps: tuple[float | None, float | None] = (None, None),
    cpu_threads: int | None = None,
) -> tuple[ExpertCache, LatencyModel]:
    """Cold-Weights for a model's MoE blocks (in layer order): experts in host memory (as
    loaded), one `slots`-expert device cache shared by all layers, and the latency model
    timed here (`bandwidths_gbps`: the config's CPU and GPU memory bandwidths, if set; the
    CPU at `cpu_threads`, the CPU daemon's pool, if another process computes its experts)."""
    stores = [block.experts_to_host() for block in blocks]
    # A step's misses each need a slot beside its hits (combine's one launch): a token's top k.
    cache = ExpertCache(slots, stores[0], device, MoeStats(), blocks[0].top_k)
    latency = calibrate(stores[0], cache, device, cpu_max_tokens, *bandwidths_gbps, cpu_threads)
    for layer, block in enumerate(blocks):
        block.to_cold_weights(layer, cache, latency)
    return cache, latency
