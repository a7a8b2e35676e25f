"""Paged decode attention of llama3-8b's shape over long contexts, per Hot codec (device
only).

One query token a sequence, Hq 32, Hkv 8, D 128, block 16, blocks in a shuffled order: one
sequence of 32K and of 128K keys, and 16 sequences of 8K (a batch of chat histories). Each
timing replays a CUDA graph of the kernel over 8 layers' caches (so L2 holds none of them)
and reports microseconds per layer and the effective bandwidth over the bytes the codec
stores. Prints a table; writes $OUT/decode_kernel.json.
"""

from __future__ import annotations

import json
import os

import torch

from hybridgen.kernels.kv_quant import QuantKvCache
from hybridgen.kernels.triton_paged_decode import (
    paged_decode_attention,
    paged_decode_attention_quant,
)

HQ, HKV, D, S, LAYERS, REPS = 32, 8, 128, 16, 8, 5


def _caches(codec: str, keys: int, gen: torch.Generator) -> list:
    n = keys // S
    out = []
    for _ in range(LAYERS):
        if codec == "native":
            k = torch.randn(n, S, HKV, D, generator=gen, device="cuda").bfloat16()
            out.append((k, torch.randn(n, S, HKV, D, generator=gen, device="cuda").bfloat16()))
            continue
        # Random codes and scales: the kernel's speed does not depend on the values.
        cache = QuantKvCache.empty(codec, n, S, HKV, D, "cuda")
        for t in (cache.k, cache.v):
            t.view(torch.uint8).random_(0, 256, generator=gen)
        for t in (cache.k_scale, cache.v_scale, cache.k_zero, cache.v_zero):
            if t is not None:
                t.uniform_(0.01, 0.1, generator=gen)
        out.append(cache)
    return out


def _bytes(cache) -> int:
    if isinstance(cache, tuple):
        return sum(t.numel() * t.element_size() for t in cache)
    parts = [cache.k, cache.v, cache.k_scale, cache.v_scale, cache.k_zero, cache.v_zero]
    return sum(t.numel() * t.element_size() for t in parts if t is not None)


def time_codec(codec: str, batch: int, keys: int) -> dict:
    """keys: each sequence's."""
    gen = torch.Generator(device="cuda").manual_seed(keys)
    caches = _caches(codec, batch * keys, gen)
    n = keys // S
    table = torch.randperm(batch * n, device="cuda", generator=gen).int().view(batch, n)
    seq_lens = torch.full((batch,), keys, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, HQ, D, device="cuda", generator=gen).bfloat16()
    out = torch.empty_like(q)

    def run(c) -> None:
        if isinstance(c, tuple):
            paged_decode_attention(q, c[0], c[1], table, seq_lens, D**-0.5, out=out)
        else:
            paged_decode_attention_quant(q, c, table, seq_lens, D**-0.5, out=out)

    for c in caches[:2]:
        run(c)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(REPS):
            for c in caches:
                run(c)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    us = start.elapsed_time(end) * 1e3 / (3 * REPS * LAYERS)
    nbytes = _bytes(caches[0])
    return {
        "codec": codec,
        "batch": batch,
        "keys": keys,
        "us_per_layer": us,
        "mb_per_layer": nbytes / 1e6,
        "gb_s": nbytes / us / 1e3,
    }


def main() -> None:
    shapes = ((1, 32768), (1, 131072), (16, 8192))
    rows = [time_codec(c, b, k) for b, k in shapes for c in ("native", "int8", "int4")]
    path = os.path.join(os.environ.get("OUT", "."), "decode_kernel.json")
    with open(path, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=2)
    print(f"{'codec':7} {'batch':>5} {'keys':>7} {'us/layer':>9} {'MB/layer':>9} {'GB/s':>7}")
    for r in rows:
        print(
            f"{r['codec']:7} {r['batch']:5d} {r['keys']:7d} {r['us_per_layer']:9.1f} "
            f"{r['mb_per_layer']:9.1f} {r['gb_s']:7.0f}"
        )


if __name__ == "__main__":
    main()
