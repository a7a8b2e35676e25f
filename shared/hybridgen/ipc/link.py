"""A request/answer link between the daemons beside the main rings: one ring and one arena
each way (attn_warm's w2c/c2w in cpu_daemon.warm_link, Cold-Weights' x2c/c2x in
cpu_daemon.expert_link). The GPU daemon creates it, the CPU daemon attaches."""

from __future__ import annotations

from dataclasses import dataclass

from hybridgen.ipc.meta_buffer import MetaBuffer
from hybridgen.ipc.ring import Ring

RING_SLOTS = 16
"""Requests in flight are few: one per layer at a time."""


@dataclass
class LinkShm:
    ask: Ring
    """GPU -> CPU requests."""
    answer: Ring
    """CPU -> GPU answers."""
    ask_meta: MetaBuffer
    answer_meta: MetaBuffer

    @classmethod
    def create(cls, instance: str, ask: str, answer: str, arena_bytes: int) -> LinkShm:
        return cls(
            Ring.create(instance, ask, RING_SLOTS),
            Ring.create(instance, answer, RING_SLOTS),
            MetaBuffer.create(instance, f"{ask}_meta", arena_bytes),
            MetaBuffer.create(instance, f"{answer}_meta", arena_bytes),
        )

    @classmethod
    def attach(cls, instance: str, ask: str, answer: str, wait: float) -> LinkShm:
        return cls(
            Ring.attach(instance, ask, wait),
            Ring.attach(instance, answer, wait),
            MetaBuffer.attach(instance, f"{ask}_meta", wait),
            MetaBuffer.attach(instance, f"{answer}_meta", wait),
        )

    def close(self) -> None:
        for obj in (self.ask, self.answer, self.ask_meta, self.answer_meta):
            obj.close()
