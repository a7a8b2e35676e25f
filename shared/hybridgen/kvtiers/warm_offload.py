"""The scheduler's Offload hook for the Warm tier: frees Hot blocks by moving their KV there.

Spill (Hot runs short), swap out (preemption keeps the computed prefix), load (a Warm prefix
back into Hot), keep (a finished sequence's prefix written back, for the next turn of its
conversation), release (a sequence ends) and the Warm side of prefix lookups; the tier
itself is gpu_daemon.warm_tier.
"""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq

import structlog
import torch

from hybridgen.engine.block_pool import BlockPool
from hybridgen.engine.sequence import Sequence
from hybridgen.engine.spill_policy import SpillCosts
from hybridgen.kernels import ops
from hybridgen.kvtiers.prefix_cache import KeepGate
from hybridgen.kvtiers.warm_tier import WarmTier

log = structlog.get_logger()


class WarmOffload:
    """The scheduler's hook into the Warm tier: frees Hot blocks by moving KV to Warm."""

    def __init__(
        self,
        tier: WarmTier,
        pool: BlockPool,
        kv_caches: Seq[ops.KvCache],
        prefix_reuse: bool = True,
        costs: SpillCosts | None = None,
    ) -> None:
        self.tier, self.pool, self.kv_caches = tier, pool, kv_caches
        self.prefix_reuse = prefix_reuse
        self.costs = costs
        """The spill decision's measured costs: every store to Warm times a block's move."""
        self.keep_gate = KeepGate()
        """Whether writing a finished sequence's blocks back pays (prefix_cache.py)."""
        self.kept_blocks = 0
        """Hot blocks written back to Warm when their sequence finished."""
        self.keep_failed = 0
        """Write-backs that raised (a device allocation that failed): skipped, nothing kept."""
        self._copies: dict[int, Sequence] = {}
        """Sequences keeping Warm copies of Hot blocks (warm_copy), by id."""

    def _room(self, n: int, keep: Sequence) -> int:
        """Warm slots for up to n blocks: free or evictable ones, then those that other
        sequences' copies hold (dropped: a copy only saves a later store)."""
        room = self.tier.room(n)
        for other in list(self._copies.values()):
            if room >= n:
                break
            if other is not keep:
                self._drop_copy(other)
                room = self.tier.room(n)
        return room

    def _drop_copy(self, seq: Sequence) -> None:
        self.tier.free(seq.warm_copy)
        seq.warm_copy = []
        self._copies.pop(id(seq), None)

    def _hot_full(self, seq: Sequence) -> int:
        """Hot blocks of `seq` that are full and computed (movable)."""
        return seq.num_computed_tokens // self.pool.block_size - len(seq.warm_slots)

    def _move(self, seq: Sequence, n: int) -> None:
        """Move its first n Hot blocks to Warm: those with a Warm copy take no copy."""
        blocks, kept = seq.block_ids[:n], min(n, len(seq.warm_copy))
        reused, seq.warm_copy = seq.warm_copy[:kept], seq.warm_copy[kept:]
        seq.warm_slots += reused + self.store(blocks[kept:])
        seq.block_ids = seq.block_ids[n:]
        self.pool.free(blocks)
        if self.prefix_reuse:  # the whole chain, head included: LRU eviction takes tails first
            keys = seq.hashes(len(seq.warm_slots), self.pool.block_size)
            self.tier.index.insert_keys(keys, seq.warm_slots)

    def store(self, blocks: Seq[int]) -> list[int]:
        """Copy Hot `blocks` into fresh Warm slots (tier.store), timed for the spill costs:
        the copy lands in host memory, so its time is the move's."""
        t0 = time.perf_counter()
        slots = self.tier.store(self.kv_caches, blocks)
        if self.costs is not None and blocks:
            self.costs.observe_move(len(blocks), time.perf_counter() - t0)
        return slots

    def lookup(self, keys: Seq[bytes]) -> list[int]:
        """Warm slots of the longest cached prefix of this key chain (one reference each);
        `promoted` of them came back from Cold."""
        return self.tier.lookup(keys)

    @property
    def promoted(self) -> int:
        """Cold blocks the last lookup brought back to Warm."""
        return self.tier.last_promoted

    def bring_back(self, slots: Seq[int]) -> list[int]:
        """Copy Warm `slots` into fresh Hot blocks, in order (Hot must have room); the caller
        registers the blocks and gives back its references to the slots."""
        blocks = self.pool.allocate(len(slots))
        self.tier.load(self.kv_caches, slots, blocks)
        return blocks

    def returned(self, blocks: int) -> None:
        """`blocks` Warm blocks of a prefix hit were taken at a first admission."""
        self.keep_gate.returned_blocks(blocks)

    def missed(self, keys: Seq[bytes]) -> None:
        """A first admission's prefix hashes beyond what every tier held: those that a
        write-back declined would have come back (KeepGate.missed)."""
        self.keep_gate.missed(keys)

    def keep(self, seq: Sequence, recompute_s: float | None) -> int:
        """A finished sequence's full computed Hot blocks that Warm does not hold yet are
        written back there, head first, so that its prefix outlives Hot (the next turn of a
        conversation); the whole chain is refreshed in the index. Only while that pays
        (`recompute_s`: seconds to compute one of its blocks again; KeepGate) and as far as
        Warm has room. Returns how many were written."""
        size, warm = self.pool.block_size, len(seq.warm_slots)
        full = min(seq.num_computed_tokens // size, warm + len(seq.block_ids))
        keys = seq.hashes(full, size)
        index = self.tier.index
        missing = [i for i in range(warm, full) if index.get(keys[i]) is None]
        if not missing:
            return 0
        if not self.keep_gate.pays(recompute_s):
            self.keep_gate.declined([keys[i] for i in missing])
            return 0
        missing = missing[: self.tier.room(len(missing))]
        if missing:
            start = time.perf_counter()
            try:
                stored = self.store([seq.block_ids[i - warm] for i in missing])
            except Exception as exc:  # a write-back is a cache fill: no request waits on it
                self.keep_failed += 1
                log.warning("warm_keep_failed", blocks=len(missing), error=repr(exc))
                if isinstance(exc, torch.OutOfMemoryError) and torch.cuda.is_available():
                    torch.cuda.empty_cache()
                return 0
            self.keep_gate.kept_blocks(len(missing), time.perf_counter() - start)
            new = dict(zip(missing, stored, strict=True))
            chain: list[int] = []  # the chain's slots from its head, as far as Warm holds it
            for i in range(full):
                slot = new.get(i, index.get(keys[i]))
                if slot is None:
                    break
                chain.append(slot)
            index.insert_keys(keys[: len(chain)], chain)
            self.tier.free(stored)  # the index holds them now (or they go back to the pool)
            self.kept_blocks += len(missing)
        return len(missing)

    def unlookup(self, slots: Seq[int]) -> None:
        """Give back the references a lookup took."""
        self.tier.free(slots)

    def spill(self, running: Seq[Sequence], need: int) -> int:
        """Move the oldest full Hot blocks of the sequences holding the most Hot blocks to
        Warm until `need` Hot blocks are free (or nothing movable is left); returns how many
        were freed (a block another sequence shares stays held)."""
        before = self.pool.num_free
        for seq in sorted(running, key=lambda s: -len(s.block_ids)):
            short = need - (self.pool.num_free - before)
            if short <= 0:
                break
            want = min(self._hot_full(seq), short)
            copies = min(want, len(seq.warm_copy))  # these need no room
            n = copies + self._room(want - copies, keep=seq)
            if n > 0:
                self._move(seq, n)
                self.tier.stats.spilled_blocks += n
        return self.pool.num_free - before

    def swap_out(self, seq: Sequence) -> bool:
        """Preemption: keep the computed prefix in Warm and free every Hot block (the tail
        of a partial block is recomputed). False, changing nothing, when Warm is short."""
        n = self._hot_full(seq)
        copies = min(n, len(seq.warm_copy))
        if self._room(n - copies, keep=seq) < n - copies:
            return False
        self._move(seq, n)
        self._drop_copy(seq)  # copies of blocks past the full ones: stale
        self.pool.free(seq.block_ids)
        seq.block_ids = []
        seq.num_computed_tokens = len(seq.warm_slots) * self.pool.block_size
        self.tier.stats.swapped_blocks += n
        return True

    def load(self, seq: Sequence) -> bool:
        """Copy `seq`'s Warm prefix back into fresh Hot blocks ahead of its Hot ones, if Hot
        has room for it; it keeps the slots as copies of those blocks (warm_copy), so that a
        later swap out, as time slicing does at every turn, moves only what is new."""
        n = len(seq.warm_slots)
        if n == 0 or n > self.pool.num_free:
            return False
        blocks = self.pool.allocate(n)
        self.tier.load(self.kv_caches, seq.warm_slots, blocks)
        self._drop_copy(seq)  # a Hot prefix's copies, now covered by warm_slots
        seq.warm_copy, seq.warm_slots = seq.warm_slots, []
        seq.block_ids = blocks + seq.block_ids
        self._copies[id(seq)] = seq
        return True

    def release(self, seq: Sequence) -> None:
        """Drop a finished (or recomputed) sequence's Warm slots and copies."""
        self.tier.free(seq.warm_slots)
        seq.warm_slots = []
        self._drop_copy(seq)
