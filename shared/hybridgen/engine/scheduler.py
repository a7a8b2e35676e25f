"""Continuous batching with a per-step token budget.

There is no prefill or decode phase: each step, every running sequence asks for the tokens
it still has to compute (one while decoding, a chunk of its prompt while prefilling), in
this order:
1. running sequences that decode (one token each), oldest first;
2. running sequences part-way through their prompt, oldest first;
3. waiting sequences, strictly first come first served: if the oldest cannot be admitted,
   nobody behind it is.
When a running sequence needs a block and none is free, the newest running sequence is
preempted: its blocks are freed and it goes back to the front of the queue, to be
recomputed from its prompt plus what it has generated so far.

With a Warm tier (an Offload), a preempted sequence keeps its computed prefix there (swap
out) and gets it back into Hot when it is readmitted with room (load). When the first waiting
sequence cannot fit Hot beside the running ones, spill_policy.py decides what it does: wait
(first come, first served), have newer running sequences swap out for it, take turns with
them (with `turn_tokens`: the running one that has generated that many tokens in its turn
swaps out to the back of the queue, its loaded Warm copy kept, so only its new blocks move),
or run now with the oldest full blocks of the sequences holding the most moved to Warm
(spill), which every decode step then reads over PCIe. A sequence too long to fit Hot alone
can only spill. By default (`auto`) the choice is the one whose predicted completion times
of the affected requests, from measured costs, are the shortest.

Prefix reuse: every full, computed block is registered in the pool under the chained hash
of its tokens, and stays cached after its sequence lets go until the space is needed; with
a Warm tier a finished sequence's blocks are also written back there (while that pays:
prefix_cache.py), so they outlive Hot. A sequence being admitted first takes the cached
blocks of its longest cached prefix (never its last token, whose logits it needs): Hot's,
then what Warm or Cold holds beyond it, copied into Hot. So a shared system prompt, the
previous turn of a chat or a preempted sequence's own prefix is not computed again.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Protocol

from hybridgen.engine.block_pool import BlockPool
from hybridgen.engine.sequence import Sequence, Status
from hybridgen.engine.spill_policy import SpillCosts, SpillPolicy
from hybridgen.engine.step_budget import MIN_TOKENS, StepBudget
from hybridgen.kvtiers.prefix_cache import PrefixHits


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one step."""

    max_num_seqs: int = 64
    """Sequences running at once."""
    max_num_batched_tokens: int = 2048
    """Tokens computed in one step; longer prompts are prefilled in chunks of this size."""
    max_model_len: int = 4096
    """Longest sequence, prompt plus output."""
    prefix_reuse: bool = True
    """Register computed blocks by prefix hash and reuse them at admission."""
    turn_tokens: int = 0
    """Time slicing (with an Offload): tokens a sequence generates in one turn in Hot before
    it makes room for a waiting sequence that fits Hot; 0: none (first come, first served)."""
    spill_policy: str = "auto"
    """With an Offload, what a waiting sequence does when Hot has no room for it: auto
    (measured costs decide), always (spill only what cannot fit Hot alone) or never
    (spill_policy.py)."""


@dataclass
class ScheduledBatch:
    """What one step computes. Invariant: decode sequences (1 token) come first."""

    seqs: list[Sequence] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    """Tokens computed for each sequence in this step."""
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_decode(self) -> int:
        return sum(1 for n in self.num_tokens if n == 1)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)

    def __len__(self) -> int:
        return len(self.seqs)


class Offload(Protocol):
    """Somewhere to move Hot blocks (gpu_daemon.warm_offload.WarmOffload)."""

    def spill(self, running: Seq[Sequence], need: int) -> int: ...

    def swap_out(self, seq: Sequence) -> bool: ...

    def load(self, seq: Sequence) -> bool: ...

    def release(self, seq: Sequence) -> None: ...

    def keep(self, seq: Sequence, recompute_s: float | None) -> int: ...

    def lookup(self, keys: Seq[bytes]) -> list[int]: ...

    @property
    def promoted(self) -> int: ...

    def unlookup(self, slots: Seq[int]) -> None: ...

    def bring_back(self, slots: Seq[int]) -> list[int]: ...

    def returned(self, blocks: int) -> None: ...

    def missed(self, keys: Seq[bytes]) -> None: ...


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        pool: BlockPool,
        offload: Offload | None = None,
        step_budget: StepBudget | None = None,
        spill_costs: SpillCosts | None = None,
    ) -> None:
        self.config = config
        self.pool = pool
        self.offload = offload
        self.spill_costs = spill_costs
        self.policy: SpillPolicy | None = None
        """With an Offload: the spill/wait decision (spill_policy.py), from `spill_costs`."""
        if offload is not None:
            self.policy = SpillPolicy(
                config.spill_policy,
                config.turn_tokens,
                spill_costs,
                pool.block_size,
                config.max_model_len,
            )
        self.step_budget = step_budget
        """Decode-first steps: the prefill a step with decodes may carry (step_budget.py)."""
        self._allowance: float | None = None
        self._prefill_placed = False
        self.waiting: deque[Sequence] = deque()
        self.kv_short = False
        """The last step could not admit the first waiting sequence for lack of Hot blocks
        (what the GPU daemon reports as BACKPRESSURE NO_KV_BLOCKS)."""
        self.running: list[Sequence] = []  # in arrival order
        self.prefix_hit_tokens = 0
        """Prompt tokens whose KV came from the prefix cache (first admissions only)."""
        self.prefix_hits = PrefixHits()
        """The same, by tier, and the requests that took blocks from each."""
        self.resumed_tokens = 0
        """Tokens of preempted sequences taken back from the cache at readmission."""
        self.turns_ended = 0
        """Sequences swapped out at the end of their turn (time slicing)."""

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        """Whether a step may do anything: false when every sequence waits for more prompt."""
        seqs = (*self.waiting, *self.running)
        return any(not s.waits_for_prompt for s in seqs)

    def finish(self, seq: Sequence, keep: bool = True) -> None:
        """Remove a sequence that finished or was aborted, and free its blocks; `keep`: its
        prefix may be written back to Warm (not for a failed step's, whose KV is suspect and
        whose failure may have been the device running out of memory)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if keep:
            self.cache_blocks(seq)
        if keep and self.offload is not None and self.config.prefix_reuse:
            self.offload.keep(seq, self._recompute_block_s(seq))
        self.pool.free(seq.block_ids)
        seq.block_ids = []
        if self.offload is not None:
            self.offload.release(seq)
        seq.status = Status.FINISHED

    def _recompute_block_s(self, seq: Sequence) -> float | None:
        """Seconds to compute one of `seq`'s computed blocks again, on average, from the
        measured prefill cost; None until measured."""
        st = self.spill_costs.step_times if self.spill_costs is not None else None
        if st is None or st.per_unit is None or seq.num_computed_tokens == 0:
            return None
        blocks = -(-seq.num_computed_tokens // self.pool.block_size)
        return st.per_unit * st.units(seq.num_computed_tokens, 0) / blocks

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        self.kv_short = False
        budget = self.config.max_num_batched_tokens
        ready = [s for s in self.running if not s.awaiting_token]
        decoding = [s for s in ready if s.num_tokens - s.num_computed_tokens == 1]
        prefilling = [s for s in ready if s.num_tokens - s.num_computed_tokens > 1]
        sb = self.step_budget
        self._allowance = sb.allowance(len(decoding)) if sb is not None else None
        self._prefill_placed = False
        for seq in decoding + prefilling:
            if budget == 0:
                break
            if seq.status is not Status.RUNNING:  # preempted earlier in this loop
                continue
            computable = seq.num_computable
            if computable <= 0:  # an open prompt waiting for more of it
                continue
            n = self._prefill_tokens(seq, min(computable, budget))
            if n == 0:
                break  # the step's prefill allowance is spent
            if not self._reserve(seq, n, batch):
                continue
            batch.seqs.append(seq)
            batch.num_tokens.append(n)
            budget -= n
        if not batch.preempted:
            self._admit(batch, budget)
        order = sorted(range(len(batch.seqs)), key=lambda i: batch.num_tokens[i] != 1)
        batch.seqs = [batch.seqs[i] for i in order]
        batch.num_tokens = [batch.num_tokens[i] for i in order]
        return batch

    def extend_prompt(self, seq: Sequence, keep: int, token_ids: Seq[int], last: bool) -> None:
        """Streaming input: the open prompt becomes its first `keep` tokens then `token_ids`
        (a chunk, with the tail it re-tokenized); `last` closes it, so decoding follows."""
        assert seq.prompt_open and 0 <= keep <= seq.num_tokens
        if keep < seq.num_computed_tokens:
            self._rewind(seq, keep)
        del seq.block_hashes[keep // self.pool.block_size :]  # hashes of whole blocks only
        del seq.token_ids[keep:]
        seq.token_ids += token_ids
        seq.prompt_len = seq.num_tokens
        seq.prompt_open = not last

    def _rewind(self, seq: Sequence, keep: int) -> None:
        """Drop the KV of a sequence's tokens from `keep` on (a re-tokenized chunk changed a
        token already computed; rare): back to a block boundary, so that no block registered
        in the prefix cache is written again, or from the start when Warm holds a part."""
        full = keep // self.pool.block_size
        if seq.warm_slots or seq.warm_copy:
            full = 0
            if self.offload is not None:
                self.offload.release(seq)
        self.pool.free(seq.block_ids[full:])
        del seq.block_ids[full:]
        seq.num_computed_tokens = full * self.pool.block_size
        seq.num_registered_blocks = min(seq.num_registered_blocks, full)

    def reserve_lookahead(self, batch: ScheduledBatch, steps: int, spill: bool = False) -> bool:
        """Give every sequence of a decode batch the blocks for `steps` tokens instead of one;
        all or nothing, and never by preempting (False when the pool is short). `spill`: the
        batch reads Warm anyway, so where a sequence of it could not fit Hot alone, blocks
        may move to Warm for it, as for its next token."""
        needs = [self._blocks_needed(s, steps) for s in batch.seqs]
        short = sum(needs) - self.pool.num_free
        grows = [s for s, n in zip(batch.seqs, needs, strict=True) if n > 0]
        if short > 0 and spill and self.offload and any(not self._fits_hot(s) for s in grows):
            self.offload.spill(self.running, short)
        if sum(needs) > self.pool.num_free:
            return False
        for seq, need in zip(batch.seqs, needs, strict=True):
            if need > 0:
                seq.block_ids += self.pool.allocate(need)
        return True

    def _reserve(self, seq: Sequence, n: int, batch: ScheduledBatch) -> bool:
        """Give `seq` the blocks for `n` more tokens, preempting newer sequences if needed."""
        need = self._blocks_needed(seq, n)
        while need > self.pool.num_free:
            short = need - self.pool.num_free
            if self.offload and self._spills(seq) and self.offload.spill(self.running, short):
                continue
            victim = max(self.running, key=lambda s: s.arrival)
            self._preempt(victim, batch)
            if victim is seq:
                return False
        seq.block_ids += self.pool.allocate(max(need, 0))
        return True

    def _blocks_needed(self, seq: Sequence, n: int) -> int:
        """Hot blocks `seq` must gain to compute `n` more tokens (its Warm prefix counts)."""
        held = len(seq.warm_slots) + len(seq.block_ids)
        return self.pool.blocks_for(seq.num_computed_tokens + n) - held

    def cache_blocks(self, seq: Sequence) -> None:
        """Register the sequence's full, computed blocks for reuse (those not yet registered)."""
        if not self.config.prefix_reuse:
            return
        warm = len(seq.warm_slots)  # block i is Hot block_ids[i - warm]
        full = min(seq.num_computed_tokens // self.pool.block_size, warm + len(seq.block_ids))
        done = max(seq.num_registered_blocks, warm)
        if full > done:
            keys = seq.hashes(full, self.pool.block_size)
            for i in range(done, full):
                self.pool.register(seq.block_ids[i - warm], keys[i])
            seq.num_registered_blocks = full

    def _take_cached_prefix(self, seq: Sequence) -> None:
        """Start a sequence with nothing computed from its longest cached prefix: Hot's,
        then what Warm (or Cold) holds beyond it (_from_warm)."""
        if not self.config.prefix_reuse or seq.num_computed_tokens:
            return
        size = self.pool.block_size
        reusable = (seq.num_tokens - 1) // size  # the last token is computed
        keys = seq.hashes(reusable, size)
        seq.block_ids = self.pool.lookup(keys)
        warm = cold = 0
        if self.offload is not None and len(seq.block_ids) < reusable:
            warm, cold = self._from_warm(seq, keys)
        blocks = len(seq.warm_slots) + len(seq.block_ids)
        if self.offload is not None and blocks < reusable:
            self.offload.missed(keys[blocks:])
        seq.num_computed_tokens = blocks * size
        seq.num_registered_blocks = blocks
        seq.prefix_from = (blocks - warm - cold, warm, cold)

    def _from_warm(self, seq: Sequence, keys: list[bytes]) -> tuple[int, int]:
        """The part of `seq`'s cached prefix beyond its Hot blocks that Warm (or Cold) holds:
        copied into fresh Hot blocks after them when `seq` fits Hot alone and Hot has room
        (registered there, so a wait keeps them cached); else, when Warm holds a longer
        prefix from the start, that one, read where it lives (Hot may continue it). Returns
        how many of its blocks came from Warm and from Cold."""
        offload, hot = self.offload, len(seq.block_ids)
        assert offload is not None
        more = offload.lookup(keys[hot:])
        cold = offload.promoted
        if more and self._fits_hot(seq) and len(more) <= self.pool.num_free:
            blocks = offload.bring_back(more)
            for block, key in zip(blocks, keys[hot:], strict=False):
                self.pool.register(block, key)
            seq.block_ids += blocks
            offload.unlookup(more)
            return len(more) - cold, cold
        offload.unlookup(more)
        warm = offload.lookup(keys)
        cold += offload.promoted
        if len(warm) <= hot:
            offload.unlookup(warm)
            return 0, 0
        self.pool.free(seq.block_ids)
        seq.warm_slots, seq.block_ids = warm, self.pool.lookup(keys[len(warm) :])
        return len(warm) - min(cold, len(warm)), min(cold, len(warm))

    def _spills(self, seq: Sequence) -> bool:
        """Whether making room for running `seq` may move running sequences' blocks to Warm
        (else the newest running sequence is preempted): never with spill_policy never;
        else when `seq` at its full length could not fit Hot even alone (so it lives partly
        in Warm anyway), while a sequence admitted by a spill decision runs (the batch reads
        Warm anyway, as the decision predicted), or when nothing else runs. Warm blocks
        cross PCIe at every step, and a batch holding any runs without CUDA graphs
        (bench/NOTES.md, B6)."""
        if self.policy is None or self.policy.policy == "never":
            return False
        idle = seq.status is not Status.RUNNING and not self.running
        spilled = seq.spilled or any(s.spilled for s in self.running)
        return idle or spilled or not self._fits_hot(seq)

    def _fits_hot(self, seq: Sequence) -> bool:
        """Whether `seq` at its full length fits the Hot pool on its own."""
        final = min(seq.prompt_len + seq.params.max_tokens, self.config.max_model_len)
        return self.pool.blocks_for(final) <= self.pool.num_blocks

    def _stop_running(self, seq: Sequence, batch: ScheduledBatch) -> None:
        """Take `seq` out of the running set and this step's batch; it waits again."""
        self.running.remove(seq)
        if seq in batch.seqs:
            i = batch.seqs.index(seq)
            del batch.seqs[i], batch.num_tokens[i]
        seq.num_preemptions += 1
        seq.status = Status.WAITING
        seq.spilled = False  # readmitted, it is decided again

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        self._stop_running(seq, batch)
        self.cache_blocks(seq)
        if self.offload is not None and self.offload.swap_out(seq):
            seq.num_registered_blocks = len(seq.warm_slots)
        else:
            if self.offload is not None:
                self.offload.release(seq)
            self.pool.free(seq.block_ids)
            seq.block_ids = []
            seq.num_computed_tokens = seq.num_registered_blocks = 0
        # Victims are the newest running sequences but older than anything waiting.
        self.waiting.appendleft(seq)
        batch.preempted.append(seq)

    def _end_turn(self, batch: ScheduledBatch) -> bool:
        """Time slicing: swap out the decoding sequence with the longest turn, if one has
        generated turn_tokens since it came in, to the back of the queue. At a block boundary
        (all its computed tokens in full blocks: coming back costs a load and no recompute)
        unless the turn ran a block past its end without one (multi-step decode can step over
        them); never by dropping its KV: False, changing nothing, when Warm cannot take it."""
        turn, size = self.config.turn_tokens, self.pool.block_size

        def over(s: Sequence) -> bool:
            ran = s.num_output_tokens - s.turn_start
            return ran >= turn + size or (ran >= turn and s.num_computed_tokens % size == 0)

        if not turn or self.offload is None:
            return False
        done = [
            s
            for s in self.running
            if not s.awaiting_token and s.num_tokens - s.num_computed_tokens == 1 and over(s)
        ]
        if not done:
            return False
        seq = max(done, key=lambda s: s.num_output_tokens - s.turn_start)
        self.cache_blocks(seq)
        if not self.offload.swap_out(seq):
            return False
        seq.num_registered_blocks = len(seq.warm_slots)
        self._stop_running(seq, batch)
        self.waiting.append(seq)
        self.turns_ended += 1
        return True

    def _put_back(self, seq: Sequence) -> None:
        """`seq` was not admitted after all: the Hot blocks of its cached prefix go back to
        the pool (still cached); a Warm prefix (swapped out, or a hit there) waits with it."""
        if seq.warm_slots:
            return
        self.pool.free(seq.block_ids)
        seq.block_ids, seq.num_computed_tokens, seq.num_registered_blocks = [], 0, 0

    def _prefill_tokens(self, seq: Sequence, n: int) -> int:
        """Of `n` tokens `seq` could compute now, those within the step's prefill allowance
        (all of them for a decode, or with no allowance); takes their cost from it."""
        if n <= 1 or self._allowance is None or self.step_budget is None:
            return n
        context = seq.num_computed_tokens
        allowed = min(n, self.step_budget.tokens_for(self._allowance, context))
        if not self._prefill_placed:
            allowed = max(allowed, min(n, MIN_TOKENS))
        self._allowance -= self.step_budget.units(allowed, context)
        self._prefill_placed = self._prefill_placed or allowed > 0
        return allowed

    def _admit(self, batch: ScheduledBatch, budget: int) -> None:
        i = 0  # the first waiting sequence not skipped
        while i < len(self.waiting) and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[i]
            if seq.waits_for_prompt:  # streaming input with nothing to compute yet
                i += 1
                continue
            self._take_cached_prefix(seq)
            computable = min(seq.num_computable, budget)  # 0: an open prompt, all cached
            n = self._prefill_tokens(seq, computable)
            if n == 0 and computable:  # the step's prefill allowance is spent: it waits
                self._put_back(seq)
                break
            need = self._blocks_needed(seq, n)
            load = self._room_for(seq, i, need, batch)
            if load is None:
                self.kv_short = True
                self._put_back(seq)
                break
            if seq.num_preemptions:
                self.resumed_tokens += seq.num_computed_tokens
            else:
                self._count_prefix(seq)
            seq.block_ids += self.pool.allocate(need)
            if load and self.offload is not None and self.offload.load(seq):
                seq.num_registered_blocks = 0  # its Warm prefix is back in Hot: register it
            del self.waiting[i]
            seq.status = Status.RUNNING
            seq.turn_start = seq.num_output_tokens
            self.running.append(seq)
            if n > 0:  # an open prompt may have all it can compute from the prefix cache
                batch.seqs.append(seq)
                batch.num_tokens.append(n)
                budget -= n

    def _count_prefix(self, seq: Sequence) -> None:
        """A first admission's cached prefix, in the counters (and in the Warm tier's
        measure of how many kept blocks come back)."""
        self.prefix_hit_tokens += seq.num_computed_tokens
        hot, warm, cold = seq.prefix_from
        self.prefix_hits.add(hot, warm, cold, self.pool.block_size)
        if self.offload is not None:
            self.offload.returned(warm + cold)

    def _room_for(self, seq: Sequence, at: int, need: int, batch: ScheduledBatch) -> bool | None:
        """Make Hot room for the waiting sequence `seq` (waiting[at], the first that can
        compute) to compute its next chunk (`need` new blocks), as spill_policy decides when
        there is none: True when it fits Hot alone and its Warm prefix (swapped out, or a
        prefix hit) is to come back into Hot too (rather than be read over PCIe at every
        step), False when it runs with that prefix in Warm (spilled), None when it waits."""
        fits = self.offload is not None and self._fits_hot(seq)
        need_all = need + (len(seq.warm_slots) if fits else 0)
        if need_all <= self.pool.num_free:
            return fits
        if self.offload is None or self.policy is None:
            return None
        decision = self.policy.decide(seq, self.running, self.pool.num_free, fits)
        if decision.choice == "spill":
            # Its own cached prefix may be what fills Hot: it can move to Warm too.
            self.offload.spill([*self.running, seq], need - self.pool.num_free)
            if need > self.pool.num_free:
                return None
            seq.spilled = True
            return False
        if decision.choice == "swap":
            victims = [self.running[i] for i in decision.victims]
            self._swap_out_for(victims, at, need_all, batch)
        while decision.choice == "turns" and need_all > self.pool.num_free:
            if not self._end_turn(batch):
                break
        return fits if need_all <= self.pool.num_free else None

    def _swap_out_for(
        self, victims: list[Sequence], at: int, need: int, batch: ScheduledBatch
    ) -> None:
        """Preempt `victims` by swap, in order, until `need` Hot blocks are free: each keeps
        its computed prefix in Warm and queues right behind waiting[at] (the one they make
        room for); never by dropping KV (a victim Warm cannot take stays)."""
        assert self.offload is not None
        for victim in victims:
            if need <= self.pool.num_free:
                break
            self.cache_blocks(victim)
            if not self.offload.swap_out(victim):
                break
            victim.num_registered_blocks = len(victim.warm_slots)
            self._stop_running(victim, batch)
            self.waiting.insert(at + 1, victim)
            batch.preempted.append(victim)
