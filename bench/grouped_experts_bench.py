"""One MoE layer's device-cached int4 / int8 experts at decode: the grouped launch
(experts/grouped.py, kernels/triton_grouped_experts.py) against one call per expert
(ops.GROUPED_EXPERTS False), on qwen3-30b-a3b's shape (8 of 128 experts, T=1) and
mixtral-8x7b's (2 of 8, T=1 and 4). Device only.

Two figures per case, both with every routed expert a cache hit:
  block us    wall time of SparseMoeBlock.combine (host bookkeeping, the routing read-back,
              the launches), averaged over back-to-back calls ended by one synchronize: what a
              decode step pays per layer when the host cannot run ahead of the device.
  graph us    block us with a step's all-hit experts replayed from a CUDA graph (HitLaunches,
              as MoeDecodeGraphs sets them), and whether its output equals the grouped one.
  kernels us  the device work alone, replayed in a CUDA graph: the grouped launches with
              their table built beforehand, against cache.run per expert plus the weighted
              sum in torch.
Each call routes a fresh random set of experts, so qwen3's 2.6 MB experts come from HBM, not
L2. Then a prompt's step (PREFILL: qwen3 at T=256, ~16 rows an expert; mixtral at T=1024, four
256-token prompts, ~256 rows an expert), int4: block us of the grouped GEMM
(kernels/triton_grouped_gemm.py) against each expert dequantized and multiplied on its own.
Prints a table; writes $OUT/grouped_experts.json.
"""

from __future__ import annotations

import argparse
import itertools
import time

import torch
from torch import nn

from hybridgen.benchmarks.report import machine_info, write_out
from hybridgen.experts.format import GROUP, PackedMatrices
from hybridgen.experts.grouped import HitLaunches, finish_step, launch_hits, pack_step, step_table
from hybridgen.experts.latency import LatencyModel
from hybridgen.experts.store import ExpertCache, ExpertStore, MoeStats
from hybridgen.kernels import ops
from hybridgen.models.moe import SparseMoeBlock
from hybridgen.models.presets import preset_spec

CASES = (("qwen3-30b-a3b", 1), ("mixtral-8x7b", 1), ("mixtral-8x7b", 4))
PREFILL = (("qwen3-30b-a3b", 256), ("mixtral-8x7b", 1024))
PREFILL_CALLS = 10
ROUTES = 64
"""Random routings cycled through (each call a fresh one)."""
CALLS = 200
DEVICE = torch.device("cuda")


def make_block(model: str, fmt: str) -> tuple[SparseMoeBlock, ExpertCache]:
    """The model's MoE block (random bf16 weights, packed on the device) with every expert
    of layer 0 in a device cache that holds them all, and misses never on the CPU."""
    spec = preset_spec(model)
    h, i, e = spec.hidden_size, spec.expert_size, spec.num_local_experts
    block = SparseMoeBlock(spec, lambda _s, _w: nn.Identity())
    block.experts = nn.ModuleList()
    block.gate.to(DEVICE, torch.bfloat16)
    stacks = []
    for out, in_ in ((2 * i, h), (h, i)):
        w = torch.randn(e, out, in_, device=DEVICE, dtype=torch.bfloat16) * in_**-0.5
        stacks.append(PackedMatrices.pack(w, fmt).moved(lambda s, d: torch.empty(s, dtype=d)))  # type: ignore[arg-type]
        del w
    block.store = ExpertStore(*stacks)
    cache = ExpertCache(e + 1, block.store, DEVICE, MoeStats())
    for expert in range(e):
        cache.fetch(0, expert, block.store)
    latency = LatencyModel(1.0, 1.0, 25e9, block.store.expert_bytes, 1e-4, 0)
    block.to_cold_weights(0, cache, latency)
    return block, cache


def routings(e: int, k: int, t: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """ROUTES random (ids [t, k] on the device, weights [t, k] fp32 summing to 1)."""
    out = []
    for _ in range(ROUTES):
        ids = torch.stack([torch.randperm(e)[:k] for _ in range(t)]).to(DEVICE)
        w = torch.rand(t, k, device=DEVICE)
        out.append((ids, w / w.sum(-1, keepdim=True)))
    return out


def block_us(
    block: SparseMoeBlock, x: torch.Tensor, routes: list, grouped: bool, calls: int = CALLS
) -> float:
    ops.GROUPED_EXPERTS = grouped
    for ids, w in routes[:4]:
        block.combine(x, ids, w)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for n in range(calls):
        block.combine(x, *routes[n % len(routes)])
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def prefill_rows(results: dict[str, dict[str, float]]) -> None:
    """PREFILL's int4 cases: block us per expert (dequantized) against the grouped GEMM."""
    head = f"{'prompt step, int4':28} {'block us: per-expert':>21} {'grouped':>8} {'x':>5}"
    print(head + " | rel err")
    for model, t in PREFILL:
        block, _cache = make_block(model, "int4")
        x = torch.randn(t, preset_spec(model).hidden_size, device=DEVICE, dtype=torch.bfloat16)
        routes = routings(block.num_experts, block.top_k, t)[:PREFILL_CALLS]
        ops.GROUPED_EXPERTS = False
        ref = block.combine(x, *routes[0]).float()
        ops.GROUPED_EXPERTS = True
        err = float((block.combine(x, *routes[0]).float() - ref).norm() / ref.norm())
        row = {
            "per_expert_block_us": block_us(block, x, routes, False, PREFILL_CALLS),
            "grouped_block_us": block_us(block, x, routes, True, PREFILL_CALLS),
            "rel_err": err,
        }
        label = f"{model} int4 T={t} top-{block.top_k}"
        results[label] = row
        print(
            f"{label:28} {row['per_expert_block_us']:21.1f} {row['grouped_block_us']:8.1f} "
            f"{row['per_expert_block_us'] / row['grouped_block_us']:5.1f} | {err:.1e}",
            flush=True,
        )
        del block, _cache
        torch.cuda.empty_cache()


def kernels_us(block: SparseMoeBlock, cache: ExpertCache, x: torch.Tensor, routes: list) -> dict:
    """CUDA-graph replays of both paths' device work over every routing."""
    slots = {e: cache.fetch(0, e, block.store) for e in range(block.num_experts)}  # type: ignore[arg-type]
    host = [(ids.cpu(), w) for ids, w in routes]
    tables = [
        step_table(
            pack_step(ids, {e: slots[e] for e in set(ids.flatten().tolist())}, []),
            ids.shape[1],
            DEVICE,
        )
        for ids, _ in host
    ]

    def grouped() -> None:
        for (_, w), table in zip(host, tables, strict=True):
            finish_step(x, table, launch_hits(x, table, cache, GROUP), [], w)

    # Today's path per routing: each expert once on its rows, ascending, weighted and added.
    plans: list[list[tuple[int, torch.Tensor, torch.Tensor]]] = []
    for ids, _ in host:
        plan = []
        for e in sorted(set(ids.flatten().tolist())):
            rows, pos = torch.where(ids == e)
            plan.append((slots[e], rows.to(DEVICE), pos.to(DEVICE)))
        plans.append(plan)

    def per_expert() -> None:
        for plan, (_, w) in zip(plans, host, strict=True):
            out = torch.zeros_like(x)
            for slot, rows, pos in plan:
                y = (cache.run(slot, x[rows]) * w[rows, pos, None]).to(x.dtype)
                out.index_add_(0, rows, y)

    return {"grouped": replay_us(grouped), "per_expert": replay_us(per_expert)}


def replay_us(fn) -> float:  # type: ignore[no-untyped-def]
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / ROUTES


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefill-only", action="store_true", help="only the prompt steps")
    args = parser.parse_args()
    results: dict[str, dict[str, float]] = {}
    if args.prefill_only:
        prefill_rows(results)
        write_out("grouped_experts_prefill.json", {"us": results, "machine": machine_info()})
        return
    print(
        f"{'case':28} {'block us: per-expert':>21} {'grouped':>8} {'x':>5} | "
        f"{'kernels us: per-expert':>22} {'grouped':>8} | rel err | graph us, equal"
    )
    for fmt, (model, t) in itertools.product(("int4", "int8"), CASES):
        block, cache = make_block(model, fmt)
        spec = preset_spec(model)
        x = torch.randn(t, spec.hidden_size, device=DEVICE, dtype=torch.bfloat16)
        routes = routings(block.num_experts, block.top_k, t)
        ops.GROUPED_EXPERTS = False
        ref = block.combine(x, *routes[0]).float()
        ops.GROUPED_EXPERTS = True
        err = float((block.combine(x, *routes[0]).float() - ref).norm() / ref.norm())
        grouped_out = block.combine(x, *routes[0])
        row = {
            "per_expert_block_us": block_us(block, x, routes, False),
            "grouped_block_us": block_us(block, x, routes, True),
            "rel_err": err,
        }
        # The same all-hit steps from a captured graph (HitLaunches, as under MoeDecodeGraphs).
        cache.hit_launches = HitLaunches(cache, torch.cuda.graph_pool_handle())
        row["graph_block_us"] = block_us(block, x, routes, True)
        row["graph_equal"] = bool(torch.equal(block.combine(x, *routes[0]), grouped_out))
        cache.hit_launches = None
        kern = kernels_us(block, cache, x, routes)
        row |= {"per_expert_kernels_us": kern["per_expert"], "grouped_kernels_us": kern["grouped"]}
        label = f"{model} {fmt} T={t} top-{block.top_k}"
        results[label] = row
        print(
            f"{label:28} {row['per_expert_block_us']:21.1f} {row['grouped_block_us']:8.1f} "
            f"{row['per_expert_block_us'] / row['grouped_block_us']:5.1f} | "
            f"{row['per_expert_kernels_us']:22.1f} {row['grouped_kernels_us']:8.1f} | "
            f"{err:.1e} | {row['graph_block_us']:8.1f} {row['graph_equal']}",
            flush=True,
        )
        del block, cache
        torch.cuda.empty_cache()
    prefill_rows(results)
    ops.GROUPED_EXPERTS = True
    write_out("grouped_experts.json", {"us": results, "machine": machine_info()})


if __name__ == "__main__":
    main()
