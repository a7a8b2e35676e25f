"""attn_warm mode (a) on the CPU: warm_decode_attention over llama3-8b's per-layer shape.

A Warm pool of 512 slots (8192 tokens; block 16, Hkv 8, D 128, bf16, 2 layers) per codec,
read by Hq = 32 query heads: one sequence over all 512 blocks, 4 sequences of 128 each, and
64 of 8 each; slots in shuffled order, as in a pool that has been in use. Each case is timed
best of 5 after a warm-up and checked against float64 attention over the keys the codec
decodes. GB/s counts the record bytes read from the pool (one layer), the figure to compare
with the GPU's PCIe read of the same records. Prints a table and writes
$OUT/warm_attention.json (or ./warm_attention.json without $OUT).

    python bench/warm_attention_bench.py [--slots 512] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
import uuid

import torch
from torch import Tensor

from hybridgen.kvtiers.codec import get_codec
from hybridgen.kvtiers.warm_attention import WarmAttnStats, WarmSpan, warm_decode_attention
from hybridgen.kvtiers.warm_pool import WarmPool

S, HKV, D, HQ, LAYERS = 16, 8, 128, 32, 2
LAYER = 1
SCALE = 1 / math.sqrt(D)
DTYPE = torch.bfloat16


def fill(pool: WarmPool, g: torch.Generator) -> list[int]:
    """Every slot of `pool` holding random K/V (keys with outlier channels, as real ones),
    in shuffled order."""
    slots = pool.alloc(pool.capacity)
    slots = [slots[i] for i in torch.randperm(len(slots), generator=g).tolist()]
    for slot in slots:
        k = torch.randn(LAYERS, S, HKV, D, generator=g)
        k[..., :4] *= 15
        v = torch.randn(LAYERS, S, HKV, D, generator=g)
        pool.store(slot, k.to(DTYPE), v.to(DTYPE))
    return slots


def reference(pool: WarmPool, q: Tensor, spans: list[WarmSpan]) -> tuple[Tensor, Tensor]:
    """float64 attention of q [B, Hq, D] over each span's decoded keys (whole blocks)."""
    outs, lses = [], []
    for b, span in enumerate(spans):
        kv = [pool.load(s, torch.float64) for s in span.slots]
        k = torch.cat([k[LAYER] for k, _ in kv]).repeat_interleave(HQ // HKV, 1)  # [n, Hq, D]
        v = torch.cat([v[LAYER] for _, v in kv]).repeat_interleave(HQ // HKV, 1)
        scores = torch.einsum("hd,nhd->hn", q[b].double(), k) * SCALE
        lse = torch.logsumexp(scores, -1)
        outs.append(torch.einsum("hn,nhd->hd", torch.exp(scores - lse[:, None]), v))
        lses.append(lse)
    return torch.stack(outs), torch.stack(lses)


def run_case(pool: WarmPool, slots: list[int], seqs: int, g: torch.Generator) -> dict[str, float]:
    """Time warm_decode_attention with `slots` split evenly over `seqs` sequences."""
    per = len(slots) // seqs
    spans = [WarmSpan(slots[i * per : (i + 1) * per], 0, S, per * S) for i in range(seqs)]
    q = torch.randn(seqs, HQ, D, generator=g).to(DTYPE)
    warm_decode_attention(pool, LAYER, q, spans, SCALE)  # warm-up: pages, threads, allocator
    best, stats = math.inf, WarmAttnStats()
    for _ in range(5):
        run = WarmAttnStats()
        t0 = time.perf_counter()
        out, lse = warm_decode_attention(pool, LAYER, q, spans, SCALE, stats=run)
        elapsed = time.perf_counter() - t0
        if elapsed < best:
            best, stats = elapsed, run
    ex_out, ex_lse = reference(pool, q, spans)
    read = seqs * per * pool.record_bytes
    return {
        "seqs": seqs,
        "blocks": seqs * per,
        "mib_read": read / 2**20,
        "ms": best * 1e3,
        "gb_s": read / best / 1e9,
        "decode_ms": stats.decode_s * 1e3,
        "attn_ms": stats.attn_s * 1e3,
        "max_err_out": (out.double() - ex_out).abs().max().item(),
        "max_err_lse": (lse.double() - ex_lse).abs().max().item(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slots", type=int, default=512, help="Warm slots (blocks) per pool")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    cases: list[dict[str, object]] = []
    print(f"torch threads {torch.get_num_threads()}, cpus {os.cpu_count()}")
    print(
        f"{'codec':<9}{'seqs':>5}{'blocks':>7}{'MiB':>7}{'ms':>9}{'GB/s':>7}"
        f"{'dec ms':>8}{'attn ms':>8}{'err out':>9}{'err lse':>9}"
    )
    for name in ("lossless", "int8"):
        instance = "bench" + uuid.uuid4().hex[:12]
        pool = WarmPool.create(instance, get_codec(name, S, HKV, D, DTYPE), LAYERS, args.slots)
        try:
            slots = fill(pool, g)
            for seqs in (1, 4, 64):
                r = run_case(pool, slots, seqs, g)
                cases.append({"codec": name, **r})
                print(
                    f"{name:<9}{seqs:>5}{r['blocks']:>7.0f}{r['mib_read']:>7.1f}{r['ms']:>9.2f}"
                    f"{r['gb_s']:>7.2f}{r['decode_ms']:>8.2f}{r['attn_ms']:>8.2f}"
                    f"{r['max_err_out']:>9.1e}{r['max_err_lse']:>9.1e}"
                )
        finally:
            pool.close()
            pool.unlink()
    path = os.path.join(os.environ.get("OUT", "."), "warm_attention.json")
    with open(path, "w") as f:
        json.dump({"torch_threads": torch.get_num_threads(), "cases": cases}, f, indent=2)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
