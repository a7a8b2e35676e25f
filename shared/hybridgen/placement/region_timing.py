"""Timing the switchable op-regions both ways at given shapes (DESIGN.md "Op-Regions"): what
hybridgen-profiler records offline (tools/profiler.py) and what the engine measures at start
for the regions nothing else places (engine/startup.py: measure_regions,
measure_moe_gate before the decode graphs are captured, and place_attn_warm over 512
blocks of one layer, before the KV pool is allocated).

    attn_warm  CPU partial over the Warm blocks vs the device's (WarmTier.device_partial), all
               layers; placed by choose_placement (cpu, gpu, or split with a share)
    sample     the device sampler vs top-K candidates to the host and the CPU's pick, plus
               SAMPLE_ROUND_TRIP_MS for the ring round trip per token that the CPU pick costs
               under the daemons
    kv_codec   encode on the device + D2H of the records vs D2H of the raw block + encode on
               the CPU, one block of every layer
    moe_gate   a MoE router's softmax and top-k on the device vs its logits to the host and
               the pick there, with the host sync the step's expert loop needs either way

Each figure is the best of `runs` after a warm-up, host time with the device synchronized
(placement/timing.py's best_of); the bytes each way would move over PCIe per step are
counted too.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hybridgen.engine.moe_graphs import HostPick, Piece
from hybridgen.kvtiers.warm_attention import WarmSpan, warm_decode_attention
from hybridgen.kvtiers.warm_tier import WarmTier
from hybridgen.models.moe import SparseMoeBlock
from hybridgen.placement.timing import best_of
from hybridgen.placement.tuning_profile import RegionProfile
from hybridgen.sampling.candidates import Candidates, sample_candidates
from hybridgen.sampling.params import SamplingParams
from hybridgen.sampling.sampler import Sampler, SamplingBatch

GREEDY = SamplingParams(temperature=0.0)
SAMPLE_ROUND_TRIP_MS = 2.7
"""What picking on the CPU daemon adds per token beyond the pick: the step's candidates go
over the ring and the token comes back on its next 2 ms tick. Measured on the H200 (B5,
bench/results/sample_placement_h200.json): 3.07 ms per token served with sample on the CPU
against 0.37 ms on the GPU."""


def choose_placement(t_cpu: float, t_gpu: float) -> tuple[str, float]:
    """attn_warm from the measured times of the same Warm blocks on the CPU and the device:
    (mode, CPU share of the blocks). One side 4x faster takes everything; otherwise the
    blocks are split in inverse proportion to the times, so both sides finish together."""
    if t_cpu > 4 * t_gpu:
        return "gpu", 0.0
    if t_gpu > 4 * t_cpu:
        return "cpu", 1.0
    return "split", t_gpu / (t_cpu + t_gpu)


class NoWarmRoom(Exception):
    """The Warm pool has no free slot to time attn_warm with."""


def _randn(*shape: int, dtype: torch.dtype, device: torch.device, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(dtype=dtype, device=device)


def profile_attn_warm(
    warm: WarmTier, rows: int, blocks: int, runs: int, layers: int | None = None
) -> RegionProfile:
    """attn_warm over `rows` decoding sequences of `blocks` Warm blocks each, over the first
    `layers` layers (default all)."""
    spec, bs, device = warm.spec, warm.block_size, warm.device
    rows, blocks = max(1, rows), max(1, blocks)
    held = warm.room(rows * blocks)  # rows share slots when the pool holds fewer
    if held == 0:
        raise NoWarmRoom("the Warm pool has no free slot to time attn_warm with")
    slots = warm.index.alloc(held)
    kv = _randn(
        spec.num_layers,
        bs,
        spec.num_kv_heads,
        spec.head_dim,
        dtype=spec.dtype,
        device=device,
        seed=1,
    )
    for slot in slots:
        warm.pool.store(slot, kv, kv)
    table = [[slots[(r * blocks + j) % held] for j in range(blocks)] for r in range(rows)]
    spans = [WarmSpan(t, 0, bs, blocks * bs) for t in table]
    q = _randn(rows, spec.num_heads, spec.head_dim, dtype=spec.dtype, device=device, seed=2)
    scale = spec.head_dim**-0.5

    depth = spec.num_layers if layers is None else layers

    def cpu() -> None:
        for layer in range(depth):
            out, lse = warm_decode_attention(warm.pool, layer, q, spans, scale)
            out.to(device), lse.to(device)

    def gpu() -> None:
        for layer in range(depth):
            warm.device_partial(layer, q, table, scale)

    try:
        cpu_ms, gpu_ms = (best_of(runs, f, device) * 1e3 for f in (cpu, gpu))
    finally:
        warm.pool.free(slots)
    placement, share = choose_placement(cpu_ms, gpu_ms)
    # cpu: q out and the fp32 (out, lse) partial back, per layer; gpu: the records in.
    heads = rows * spec.num_heads
    per_layer = heads * spec.head_dim * (spec.dtype.itemsize + 4) + heads * 4
    measured = {
        "cpu_ms": cpu_ms,
        "gpu_ms": gpu_ms,
        "pcie_bytes_cpu": depth * per_layer,
        "pcie_bytes_gpu": rows * blocks * warm.pool.slot_bytes * depth // spec.num_layers,
        "rows": rows,
        "blocks": blocks,
        "layers": depth,
    }
    return RegionProfile(placement, share if placement == "split" else None, measured)


def profile_sample(
    vocab: int, num_candidates: int, device: torch.device, batch: int, runs: int
) -> RegionProfile:
    """Greedy picks for [batch, vocab] fp32 logits: the device sampler vs the CPU's pick from
    the top num_candidates logits per row (their D2H included), as model_runner does them."""
    batch = max(1, batch)
    k = min(num_candidates, vocab)
    logits = _randn(batch, vocab, dtype=torch.float32, device=device, seed=3)
    sampler, params = Sampler(), [GREEDY] * batch

    def gpu() -> None:
        sb = SamplingBatch.build(params, [0] * batch, [0] * batch, None, None, vocab, device)
        sampler(logits, sb).token_ids.cpu()

    def cpu() -> None:
        t = torch.tensor([1.0] * batch, device=device)[:, None]  # greedy rows: temperature 1
        vals, ids = logits.topk(k, dim=-1)
        lse = torch.logsumexp(logits, -1, keepdim=True)
        lse_t = torch.logsumexp(logits / t, -1, keepdim=True)
        floats = torch.cat([vals, lse, lse_t], dim=-1).cpu().numpy()
        ids_host = ids.to(torch.int32).cpu().numpy()
        for i in range(batch):
            c = Candidates(ids_host[i], floats[i, :k], float(floats[i, k]), float(floats[i, k + 1]))
            sample_candidates(c, GREEDY, 0, 0)

    cpu_ms, gpu_ms = (best_of(runs, f, device) * 1e3 for f in (cpu, gpu))
    measured = {
        "cpu_ms": cpu_ms,
        "gpu_ms": gpu_ms,
        "pcie_bytes_cpu": batch * (4 + k * 8 + 8),  # temperatures in; k ids, k logits, 2 lse out
        "pcie_bytes_gpu": batch * (6 * 4 + 4 * 8 + 8),  # SamplingBatch in; the token ids out
        "batch": batch,
        "candidates": k,
    }
    measured["round_trip_ms"] = SAMPLE_ROUND_TRIP_MS
    on_cpu = cpu_ms + SAMPLE_ROUND_TRIP_MS < gpu_ms
    return RegionProfile("cpu" if on_cpu else "gpu", None, measured)


def profile_kv_codec(warm: WarmTier, runs: int) -> RegionProfile:
    """Encoding one Hot block of every layer for the Warm pool, on either side of PCIe."""
    spec, device, codec = warm.spec, warm.device, warm.pool.codec
    shape = (spec.num_layers, warm.block_size, spec.num_kv_heads, spec.head_dim)
    k = _randn(*shape, dtype=spec.dtype, device=device, seed=4)
    v = _randn(*shape, dtype=spec.dtype, device=device, seed=5)

    def gpu() -> None:
        codec.encode_blocks(k, v).cpu()

    def cpu() -> None:
        codec.encode_blocks(k.cpu(), v.cpu())

    cpu_ms, gpu_ms = (best_of(runs, f, device) * 1e3 for f in (cpu, gpu))
    measured = {
        "cpu_ms": cpu_ms,
        "gpu_ms": gpu_ms,
        "pcie_bytes_cpu": 2 * k.numel() * k.element_size(),
        "pcie_bytes_gpu": warm.pool.slot_bytes,
        "blocks": 1,
    }
    return RegionProfile("cpu" if cpu_ms < gpu_ms else "gpu", None, measured)


def profile_moe_gate(
    block: SparseMoeBlock, tokens: int, runs: int, graphed: bool = False
) -> RegionProfile:
    """One router's pick for `tokens` tokens, both ways, up to the expert ids on the host
    (SparseMoeBlock.combine needs them there to loop over the experts). `graphed`: the decode
    runs from CUDA graphs (moe_graphs.py), so the device part is timed as a replayed graph."""
    weight = block.gate.weight
    x = _randn(max(1, tokens), weight.shape[1], dtype=weight.dtype, device=weight.device, seed=6)
    saved, figures = block.gate_on, {}
    try:
        for side in ("cpu", "gpu"):
            block.gate_on = side
            pick = _graphed_pick(block, x) if graphed else lambda: block.route(x)[0].tolist()
            figures[f"{side}_ms"] = best_of(runs, pick, x.device)
    finally:
        block.gate_on = saved
    cpu_ms, gpu_ms = figures["cpu_ms"] * 1e3, figures["gpu_ms"] * 1e3
    measured = {"cpu_ms": cpu_ms, "gpu_ms": gpu_ms, "tokens": max(1, tokens)}
    measured["graphed"] = float(graphed)
    return RegionProfile("cpu" if cpu_ms < gpu_ms else "gpu", None, measured)


def _graphed_pick(block: SparseMoeBlock, x: torch.Tensor) -> Callable[[], list[list[int]]]:
    """The router's pick on x as a graphed decode makes it at block.gate_on: a replayed
    graph up to HostPick.send, a sync, HostPick.read."""
    pick = HostPick(block, x.shape[0], x.device)
    piece = Piece(lambda: (pick.send(block.router_logits(x)),), torch.cuda.graph_pool_handle())

    def run() -> list[list[int]]:
        (weights,) = piece.run()
        torch.cuda.current_stream(x.device).synchronize()
        return pick.read(x.shape[0], weights)[0].tolist()

    return run
