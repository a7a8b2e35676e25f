"""Self-speculative decoding over the Warm tier (kv_cache.warm_draft_tokens).

A sequence whose keys are partly in Warm reads all of them over PCIe (or on the CPU) at every
decode step, and that read, not the model, sets its speed. So the same model drafts k tokens
attending Hot alone (fast steps with CUDA graphs, no Warm read), and one check step computes
the pending token and the k drafts as k + 1 decode rows over Hot and Warm, reading Warm once
for all of them (warm_context stacks the rows' queries onto their kv heads)::

    drafts:  t -> d0 -> d1 -> ... -> d(k-1)          Hot keys only, k steps
    check:   rows [t, d0, ..., d(k-1)] -> e0 .. ek   Hot + Warm, one step
    keep:    e0 .. ej, j = the first draft with dj != ej (or k): j + 1 tokens

Row j samples with the same (seed, step) noise as the j-th plain decode step, so e0 .. ej are
the very tokens plain decoding picks, greedy or sampled: a draft only decides how many come
from one Warm read. The check writes the exact K/V of every row, over the drafts' own; the
K/V past the kept tokens is never read, and the next round writes over it.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridgen.engine.model_runner import ModelRunner, Sampled, has_penalty
from hybridgen.engine.scheduler import ScheduledBatch, Scheduler


@dataclass
class DraftStats:
    """Counters since start."""

    rounds: int = 0
    """Check steps run."""
    drafted: int = 0
    """Tokens drafted (k per sequence and round)."""
    accepted: int = 0
    """Drafts the check step confirmed (each saved a Warm read)."""

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def info(self) -> dict[str, int]:
        """The counters, keyed by GetModelInfo field names."""
        return {"warm_drafted_tokens": self.drafted, "warm_accepted_drafts": self.accepted}


STACKED_HEADS = 128
"""Most query rows the check step stacks onto one kv head ((k + 1) x the model's query heads
per kv head). The decode kernel's head tile is the next power of two of it, and a tile of
128 (llama3-8b, k = 16) is the largest that has run on the H200 (b3b_drafts16)."""


class WarmDrafts:
    """Drafts attending Hot, checked over Hot and Warm in one step."""

    def __init__(
        self, tokens: int, runner: ModelRunner, scheduler: Scheduler, max_model_len: int
    ) -> None:
        group = runner.spec.num_heads // runner.spec.num_kv_heads
        self.tokens = max(0, min(tokens, STACKED_HEADS // group - 1))
        """Drafts a round: kv_cache.warm_draft_tokens, within STACKED_HEADS."""
        self.runner, self.scheduler = runner, scheduler
        self.max_model_len = max_model_len
        self.stats = DraftStats()

    def length(self, batch: ScheduledBatch) -> int:
        """Tokens to draft for this batch, with the blocks for them reserved; 0 (nothing
        reserved) unless every sequence decodes without penalties and one has Warm keys."""
        k = self.tokens
        if not k or not any(s.warm_slots for s in batch.seqs):
            return 0
        for seq in batch.seqs:
            room = seq.decode_room(self.max_model_len)
            if not room or has_penalty(seq.params):
                return 0
            k = min(k, room - 1)  # the check step yields up to k + 1 tokens
        if k < 1 or not self.scheduler.reserve_lookahead(batch, k + 1, spill=True):
            return 0
        return k

    def run(self, batch: ScheduledBatch, k: int) -> list[list[Sampled]]:
        """One round: k drafts, the check, and the kept tokens as Engine.step takes
        multi-step output (step j: the sequences with a j-th token)."""
        steps = self.runner.execute_decode(batch, k, hot_only=True)
        drafts = [[step[i].token_id for step in steps] for i in range(len(batch))]
        checked = self.runner.execute_check(batch, drafts)
        per_step: list[list[Sampled]] = [[] for _ in range(k + 1)]
        for draft, rows in zip(drafts, checked, strict=True):
            for j, row in enumerate(rows):
                per_step[j].append(row)
                if j == k or row.token_id != draft[j]:
                    self.stats.accepted += j
                    break
        self.stats.rounds += 1
        self.stats.drafted += k * len(batch)
        return [step for step in per_step if step]
