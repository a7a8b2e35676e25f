"""One rank's shard of a CausalLM, with its collectives (sharding.py says what splits).

The decoder layers are llama.py's own, built from the rank's local spec (its heads and MLP
widths); an all-reduce after each layer's attention and MLP (forward hooks) sums the
row-parallel partial outputs, the embedding all-reduces its vocab rows, and compute_logits
gathers the ranks' vocab slices. On rank 0 (`driver` set) each forward and compute_logits
first sends its inputs to the workers (step.py), which then run the same call.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from hybridgen.kernels import ops
from hybridgen.models.llama import AttentionBatch, CausalLM, DecoderLayer
from hybridgen.models.spec import ModelSpec
from hybridgen.parallel import step
from hybridgen.parallel.sharding import local_spec


class RankLost(RuntimeError):
    """A tensor-parallel rank died or its collective failed: the engine cannot go on."""


EXIT_WAIT_S = 2.0
"""After a failed step, how long rank 0 waits for a worker's exit to show: a killed worker's
sockets close (and the collective fails) a moment before the process can be reaped."""


class Driver(Protocol):
    """Rank 0's view of the worker ranks."""

    def check(self, wait_s: float = 0.0) -> None:
        """Raise RankLost when a worker has exited, or exits within `wait_s`."""


class VocabShardEmbedding(nn.Embedding):
    """Rows [start, start + num_embeddings) of the embedding; other ids give zeros, and the
    all-reduce over the ranks adds each id's one real row."""

    def __init__(self, rows: int, width: int, start: int) -> None:
        super().__init__(rows, width)
        self.start = start

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        local = input - self.start
        outside = (local < 0) | (local >= self.num_embeddings)
        x = nn.functional.embedding(local.clamp(0, self.num_embeddings - 1), self.weight)
        x = x.masked_fill(outside[:, None], 0)
        dist.all_reduce(x)
        return x


def _all_reduce_output(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
    """Forward hook of a row-parallel block: its partial output summed over the ranks."""
    dist.all_reduce(output)
    return output


class ShardedCausalLM(CausalLM):
    """CausalLM over `ranks` ranks: `spec` is the rank's local shape (sharding.local_spec),
    `full` the whole model's."""

    def __init__(self, full: ModelSpec, rank: int, ranks: int) -> None:
        spec = local_spec(full, ranks)
        super().__init__(spec)
        self.full, self.rank, self.ranks = full, rank, ranks
        rows = spec.vocab_size
        self.embed_tokens = VocabShardEmbedding(rows, spec.hidden_size, rank * rows)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        for layer in self.layers:
            assert isinstance(layer, DecoderLayer)
            layer.self_attn.register_forward_hook(_all_reduce_output)
            layer.mlp.register_forward_hook(_all_reduce_output)
        self.driver: Driver | None = None
        """Rank 0's workers; None on a worker."""
        self._kv_key: tuple[int, int] | None = None

    def forward(
        self,
        input_ids: torch.Tensor,
        batch: AttentionBatch,
        kv_caches: list[ops.KvCache],
        rope: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        with self._guard():
            if self.driver is not None:
                self._send_step(input_ids, batch, kv_caches, rope)
            return super().forward(input_ids, batch, kv_caches, rope)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> the full vocabulary's logits [N, V] fp32, gathered."""
        with self._guard():
            if self.driver is not None:
                step.send("logits", (), [hidden])
            local = super().compute_logits(hidden)  # [N, V / ranks], padded
            parts = [torch.empty_like(local) for _ in range(self.ranks)]
            dist.all_gather(parts, local)
            return torch.cat(parts, dim=-1)[:, : self.full.vocab_size]

    def _send_step(
        self,
        input_ids: torch.Tensor,
        batch: AttentionBatch,
        kv_caches: list[ops.KvCache],
        rope: tuple[torch.Tensor, torch.Tensor],
    ) -> None:
        """Rank 0: a KV pool the workers have not allocated yet (a new runner's), then the
        step's inputs."""
        first = kv_caches[0]
        assert isinstance(first, tuple), "tensor parallel keeps a native Hot cache"
        k = first[0]
        key = (k.data_ptr(), k.shape[0])
        if key != self._kv_key:
            step.send("kv", (k.shape[0], k.shape[1]), list(rope))
            self._kv_key = key
        step.send_forward(input_ids, batch)

    @contextmanager
    def _guard(self) -> Iterator[None]:
        """Rank 0: fail with RankLost when a worker has died, before or during the block.
        Any failure inside the block is RankLost: the workers were sent the step and wait in
        its collectives, so the ranks are out of step for good. The workers: nothing."""
        if self.driver is None:
            yield
            return
        self.driver.check()
        try:
            yield
        except Exception as exc:
            self.driver.check(wait_s=EXIT_WAIT_S)  # a dead worker explains the failure
            raise RankLost(
                f"a tensor-parallel step failed on rank 0 ({exc}); the ranks are out of step, "
                "the engine stops (its supervisor restarts the daemon)"
            ) from exc
