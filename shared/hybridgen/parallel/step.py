"""What rank 0 sends the worker ranks, over the default process group, so that they run the
same forward pass: one small header (broadcast_object_list), then its tensors (broadcast).

    kv       a new KV pool: (num_blocks, block_size), then the rope tables cos and sin
    forward  a step's AttentionBatch: num_decode and the host lists, then input_ids,
             positions, slot_mapping, block_tables and seq_lens
    logits   hidden rows [N, H] whose vocab-parallel logits all ranks compute and gather
    stop     the workers leave their loop
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from hybridgen.models.llama import AttentionBatch

_BATCH_TENSORS = ("positions", "slot_mapping", "block_tables", "seq_lens")


@dataclass
class Message:
    """One header from rank 0 and the tensors that followed it."""

    kind: str
    """kv, forward, logits or stop."""
    args: tuple[Any, ...]
    tensors: list[torch.Tensor]


def send(kind: str, args: tuple[Any, ...], tensors: list[torch.Tensor]) -> None:
    """Rank 0: the header, then each tensor (made contiguous) to every rank."""
    shapes = [(tuple(t.shape), t.dtype) for t in tensors]
    dist.broadcast_object_list([(kind, args, shapes)], src=0)
    for t in tensors:
        dist.broadcast(t.contiguous(), src=0)


def receive(device: torch.device) -> Message:
    """A worker rank: the next header and its tensors, on `device`."""
    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=0)  # NCCL: on the rank's current CUDA device
    kind, args, shapes = box[0]
    tensors = []
    for shape, dtype in shapes:
        t = torch.empty(shape, dtype=dtype, device=device)
        dist.broadcast(t, src=0)
        tensors.append(t)
    return Message(kind, args, tensors)


def send_forward(input_ids: torch.Tensor, batch: AttentionBatch) -> None:
    """Rank 0: a step's inputs (Warm keys excluded: tensor parallel has no Warm tier)."""
    args = (batch.num_decode, batch.query_start_loc, batch.seq_lens_host)
    send("forward", args, [input_ids, *(getattr(batch, n) for n in _BATCH_TENSORS)])


def forward_inputs(message: Message) -> tuple[torch.Tensor, AttentionBatch]:
    """A worker rank: a forward message back as (input_ids, AttentionBatch)."""
    num_decode, query_start_loc, seq_lens_host = message.args
    input_ids, positions, slot_mapping, block_tables, seq_lens = message.tensors
    batch = AttentionBatch(
        positions=positions,
        slot_mapping=slot_mapping,
        block_tables=block_tables,
        seq_lens=seq_lens,
        num_decode=num_decode,
        query_start_loc=query_start_loc,
        seq_lens_host=seq_lens_host,
    )
    return input_ids, batch
