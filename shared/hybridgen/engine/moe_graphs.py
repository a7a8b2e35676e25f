"""Decode steps of a MoE model from CUDA graphs captured piecewise, between the layers'
expert ids read back to the host.

A MoE layer's experts are placed on the host at every step (cache hit, fetch, or the CPU:
SparseMoeBlock.combine), so one graph cannot hold a whole step. Everything else can: per
padded batch size, one graph per layer runs from that layer's input to its router's pick,
and a last one from the last layer's output to the logits:

    graph 0      embed, layer 0 up to its MLP, router -> ids (or logits) to pinned host memory
    host         sync; layer 0's experts, eagerly (SparseMoeBlock.combine) -> x
    graph l      layer l on x up to its MLP, router -> ids to the host
    host         layer l's experts -> x
    graph L      final norm, LM head -> logits

A layer with a dense MLP (Qwen-MoE's mlp_only_layers) runs whole in its graph, and the host
only copies its output on; a shared expert (Qwen2-MoE) runs in the graph beside the router,
and the host adds its output to the routed experts'.

Eagerly, a decode step costs the host some 50 torch launches per layer, more than the device
takes to run them at batch 1 (B4, bench/NOTES.md); here a layer costs the host one replay, one
sync and its experts' launches. Each graph reads the previous one's outputs in place (all
share one memory pool and every output stays referenced, so no capture reuses another's
live output), and x, which the host's expert step writes, is a static buffer. Where the
router picks (moe_gate) is fixed at capture: on the device the ids come back, on the host
the logits do and the host picks, as route() does eagerly.

A layer whose experts all hit the device cache runs them from a graph too (HitLaunches: one
per step shape, shared by the layers, captured at first use), so the host copies the step's
table in and replays where it launched the grouped kernels one by one.

Without CUDA (`graphed=False`) the same pieces run eagerly in the same order through the
same buffers; the CPU tests check that path against the model's own forward.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import Tensor

from hybridgen.engine.cuda_graphs import DecodeInputs
from hybridgen.experts.grouped import HitLaunches
from hybridgen.kernels import ops
from hybridgen.models.llama import AttentionBatch, CausalLM, DecoderLayer
from hybridgen.models.moe import SparseMoeBlock, add_shared
from hybridgen.runtime.log import Progress

Outputs = tuple[Tensor, ...]


class Piece:
    """One captured stretch of a step: a CUDA graph over `fn`'s launches (its outputs then
    static), or, without a pool, `fn` itself called at each run."""

    def __init__(self, fn: Callable[[], Outputs], pool: Any) -> None:
        self.fn, self.graph = fn, None
        self.out: Outputs = ()
        if pool is None:
            return
        # Warm up outside the capture: Triton compiles and cuBLAS picks its kernels.
        fn()
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.out = fn()

    def run(self) -> Outputs:
        if self.graph is None:
            self.out = self.fn()
        else:
            self.graph.replay()
        return self.out


class HostPick:
    """A router's pick brought to the host from inside a graph, as moe_gate places it: on the
    device ("gpu") the top-k runs in the graph and its ids come back; on the host ("cpu") the
    logits come back and the host picks, as SparseMoeBlock.route does eagerly."""

    def __init__(self, block: SparseMoeBlock, rows: int, device: torch.device) -> None:
        self.on, self.k, self.device = block.gate_on, block.top_k, device
        self.pick = block.pick
        pinned = device.type == "cuda"
        e, dtype = block.num_experts, block.logits_dtype()
        self.ids = torch.zeros(rows, self.k, dtype=torch.int64, pin_memory=pinned)
        self.logits = torch.zeros(rows, e, dtype=dtype, pin_memory=pinned)

    def send(self, logits: Tensor) -> Tensor:
        """The device part, captured: router logits [b, E] -> the weights [b, k] (an empty
        tensor when the host picks); the ids or the logits start for the host."""
        b = logits.shape[0]
        if self.on == "cpu":
            self.logits[:b].copy_(logits, non_blocking=True)
            return logits.new_empty(0)
        ids, weights = self.pick(logits)
        self.ids[:b].copy_(ids, non_blocking=True)
        return weights

    def read(self, n: int, weights: Tensor) -> tuple[Tensor, Tensor]:
        """The host part, after the device synchronized: (ids [n, k] on the host, weights
        [n, k] on the device) for the first n rows."""
        if self.on == "cpu":
            ids, picked = self.pick(self.logits[:n])
            return ids, picked.to(self.device, non_blocking=True)
        return self.ids[:n], weights[:n]


class MoeDecodeGraphs:
    """Decode of up to `max_batch` sequences of a MoE model, one piece per layer and a last
    for the logits (module doc); `run` has DecodeGraphs' interface."""

    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[ops.KvCache],
        rope: tuple[Tensor, Tensor],
        max_batch: int,
        max_blocks: int,
        device: torch.device,
        graphed: bool = True,
    ) -> None:
        spec = model.spec
        self.model, self.kv_caches, self.rope = model, kv_caches, rope
        self.max_batch, self.device = max_batch, device
        self.blocks: list[SparseMoeBlock | None] = [
            layer.mlp if isinstance(layer.mlp, SparseMoeBlock) else None for layer in model.layers
        ]
        """Each layer's MoE block; None where the layer's MLP is dense."""
        self.picks = [None if b is None else HostPick(b, max_batch, device) for b in self.blocks]
        self.inputs = DecodeInputs(max_batch, max_blocks, device)
        self.x = torch.zeros(max_batch, spec.hidden_size, dtype=spec.dtype, device=device)
        """A layer's experts' output, the next piece's input."""
        pool = torch.cuda.graph_pool_handle() if graphed else None
        sizes = list(reversed(self.inputs.sizes))
        progress = Progress("capturing_graphs", len(sizes), unit="graphs", label="warming up")
        self.pieces: dict[int, list[Piece]] = {}
        for i, b in enumerate(sizes):
            self.pieces[b] = self._pieces(b, pool)
            progress.update(i + 1, batch=b)
        for cache in {id(b.cold[1]): b.cold[1] for b in self.blocks if b and b.cold}.values():
            cache.hit_launches = HitLaunches(cache, pool)

    def _pieces(self, b: int, pool: Any) -> list[Piece]:
        batch = self.inputs.batch(b)
        pieces: list[Piece] = []
        for layer in range(len(self.blocks)):
            prev = pieces[-1] if pieces else None
            pieces.append(Piece(partial(self._layer, layer, prev, b, batch), pool))
        last = pieces[-1]
        pieces.append(Piece(lambda: (self._logits(last, b),), pool))
        return pieces

    def _layer(self, layer: int, prev: Piece | None, b: int, batch: AttentionBatch) -> Outputs:
        """Layer `layer` up to its router's pick -> (MLP input, residual, HostPick.send's
        weights, the shared expert's output or an empty tensor); a dense layer whole ->
        (its output, residual)."""
        if prev is None:
            x, residual = self.model.embed_tokens(self.inputs.input_ids[:b]), None
        else:
            x, residual = self.x[:b], prev.out[1]
        layer_net = self.model.layers[layer]
        assert isinstance(layer_net, DecoderLayer)
        h, residual = layer_net.attend(x, residual, batch, self.kv_caches[layer], self.rope)
        block, pick = self.blocks[layer], self.picks[layer]
        if block is None or pick is None:
            return layer_net.mlp(h), residual
        shared = block.shared(h)
        weights = pick.send(block.router_logits(h))
        return h, residual, weights, h.new_empty(0) if shared is None else shared

    def _logits(self, last: Piece, b: int) -> Tensor:
        return self.model.compute_logits(self.model.final_norm(self.x[:b], last.out[1]))

    def run(self, input_ids: Tensor, batch: AttentionBatch) -> Tensor:
        """Replay for len(input_ids) sequences, the experts placed between the pieces; returns
        logits [n, V] (a view, valid until the next replay)."""
        n, b = self.inputs.load(input_ids, batch)
        pieces = self.pieces[b]
        for layer, (block, pick) in enumerate(zip(self.blocks, self.picks, strict=True)):
            out = pieces[layer].run()
            if block is None or pick is None:  # a dense layer: its output, on the device
                self.x[:n].copy_(out[0][:n])
                continue
            h, _, weights, shared = out
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()  # the pick is on the host
            routed = block.combine(h[:n], *pick.read(n, weights))
            self.x[:n].copy_(add_shared(routed, shared[:n] if shared.numel() else None))
        return pieces[-1].run()[0][:n]
