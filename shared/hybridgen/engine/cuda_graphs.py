"""CUDA graphs for decode steps, captured once per padded batch size.

A decode step of B sequences replays the graph of the smallest captured size >= B. Inputs
are copied into static buffers; padding rows get slot -1 (no cache write) and seq_len 0
(attention writes zeros), so they never touch another sequence's KV. All graphs share one
memory pool, captured largest first so the smaller ones reuse its blocks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from hybridgen.models.llama import AttentionBatch
from hybridgen.runtime.log import Progress

DecodeFn = Callable[[torch.Tensor, AttentionBatch], torch.Tensor]


def graph_sizes(max_batch: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b <= max_batch]
    sizes += list(range(16, max_batch + 1, 8))
    if sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


class DecodeInputs:
    """Static device buffers for a decode step of up to `max_batch` sequences, which captured
    graphs read: the step's inputs are copied in before each replay."""

    def __init__(self, max_batch: int, max_blocks: int, device: torch.device) -> None:
        self.sizes = graph_sizes(max_batch)
        self.input_ids = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.slots = torch.full((max_batch,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(max_batch, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros((max_batch, max_blocks), dtype=torch.int32, device=device)

    def batch(self, b: int) -> AttentionBatch:
        """The first `b` rows as the AttentionBatch a capture of size b reads."""
        return AttentionBatch(
            positions=self.positions[:b],
            slot_mapping=self.slots[:b],
            block_tables=self.block_tables[:b],
            seq_lens=self.seq_lens[:b],
            num_decode=b,
            query_start_loc=list(range(b + 1)),
            seq_lens_host=[0] * b,
        )

    def load(self, input_ids: torch.Tensor, batch: AttentionBatch) -> tuple[int, int]:
        """Copy a step of n sequences in -> (n, b): b the smallest captured size >= n."""
        n = input_ids.shape[0]
        b = next(s for s in self.sizes if s >= n)
        width = batch.block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(batch.positions)
        self.slots[:n].copy_(batch.slot_mapping)
        self.seq_lens[:n].copy_(batch.seq_lens)
        self.block_tables[:n, :width].copy_(batch.block_tables)
        if n < b:
            self.slots[n:b].fill_(-1)
            self.seq_lens[n:b].fill_(0)
        return n, b


class DecodeGraphs:
    def __init__(self, fn: DecodeFn, max_batch: int, max_blocks: int, device: torch.device) -> None:
        self.fn, self.max_batch = fn, max_batch
        self.inputs = DecodeInputs(max_batch, max_blocks, device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        pool = torch.cuda.graph_pool_handle()
        sizes = list(reversed(self.inputs.sizes))
        progress = Progress("capturing_graphs", len(sizes), unit="graphs", label="warming up")
        for i, b in enumerate(sizes):
            self._capture(b, pool)
            progress.update(i + 1, batch=b)

    def _capture(self, b: int, pool: Any) -> None:  # torch's private _POOL_HANDLE
        batch, input_ids = self.inputs.batch(b), self.inputs.input_ids[:b]
        # Warm up on the current stream (a fresh side stream would pin a cuBLAS workspace for
        # the life of the process): Triton compiles and cuBLAS picks kernels outside capture.
        self.fn(input_ids, batch)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            self.outputs[b] = self.fn(input_ids, batch)
        self.graphs[b] = graph

    def run(self, input_ids: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        """Replay for len(input_ids) sequences; returns logits [B, V] (a view, valid until the
        next replay)."""
        n, b = self.inputs.load(input_ids, batch)
        self.graphs[b].replay()
        return self.outputs[b][:n]
