"""The Warm pool's prefix index: chained block hashes -> Warm slots, for prefix reuse, evicted
by recency and reuse."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from hybridgen.engine.block_hash import block_hashes
from hybridgen.kvtiers.warm_pool import WarmPool

REUSE_BONUS_S = 30.0
"""In eviction order, each earlier hit of an entry counts as this many seconds of recency: a
shared system prompt that every conversation hits outlives the turns of one conversation."""
MAX_BONUS_HITS = 8
"""Hits beyond this many add no more bonus, so that a prefix once popular still ages out."""
EVICT_WINDOW = 64
"""Least recently used entries an eviction weighs (the one to go is among them)."""


class PrefixIndex:
    """Maps chains of full-block token hashes to Warm slots, for prefix reuse.

    Invariants:

    * Each entry holds exactly one pool reference to its slot (taken by `insert`, dropped by
      eviction), so a cached slot is never handed out while it is cached.
    * Entries are kept in LRU order, and every touch refreshes a chain from its tail back to
      its head, so a block is always at least as recent as any block that extends it, and
      comes later in LRU order. A lookup counts a hit on every block it found, so a block
      has at least as many hits as any block that extends it.
    * Eviction drops the entry whose last use plus REUSE_BONUS_S per hit is oldest, among
      the EVICT_WINDOW least recently used that only the index holds (an entry a sequence
      holds frees nothing), the first in LRU order on a tie. By the two invariants above a
      tail always goes before its head, so no entry is left unreachable behind an evicted
      parent.
    """

    def __init__(self, pool: WarmPool) -> None:
        pool._owner_only("PrefixIndex")
        self.pool = pool
        self.block_size: int = pool.codec.spec.block_size
        self._entries: OrderedDict[bytes, int] = OrderedDict()  # chain hash -> slot, LRU first
        self._touched: dict[bytes, float] = {}  # chain hash -> time.monotonic() of last use
        self._hits: dict[bytes, int] = {}  # chain hash -> lookups that found it
        self.demote: Callable[[bytes, int], object] | None = None
        """Called with (key, slot) of an entry about to be evicted, while its slot is still
        readable (the Warm tier moves it to Cold)."""

    def __len__(self) -> int:
        return len(self._entries)

    def _touch(self, keys: Sequence[bytes]) -> None:
        now = time.monotonic()
        for key in reversed(keys):  # tail first, so the head ends up most recent
            self._entries.move_to_end(key)
            self._touched[key] = now

    def idle_since(self, cutoff: float) -> list[tuple[bytes, int]]:
        """(key, slot) of entries untouched since `cutoff` (time.monotonic()) whose slot only
        the index holds, least recently used first."""
        out = []
        for key, slot in self._entries.items():
            if self._touched[key] >= cutoff:
                break  # LRU order: everything after is more recent
            if self.pool.refcount(slot) == 1:
                out.append((key, slot))
        return out

    def drop(self, key: bytes) -> None:
        """Forget one entry and release the index's reference to its slot."""
        slot = self._entries.pop(key)
        del self._touched[key], self._hits[key]
        self.pool.free([slot])

    def lookup(self, token_ids: Sequence[int]) -> list[int]:
        """Slots of the longest cached prefix of whole blocks of `token_ids`.

        The caller gets one pool reference per returned slot (free them when done), so an
        eviction cannot recycle a slot it is reading.
        """
        return self.lookup_keys(block_hashes(token_ids, self.block_size))

    def lookup_keys(self, keys: Sequence[bytes]) -> list[int]:
        """`lookup` by the chain's block hashes (`hybridgen.engine.block_hash`), in order."""
        found: list[bytes] = []
        for key in keys:
            if key not in self._entries:
                break
            found.append(key)
        self._touch(found)
        for key in found:
            self._hits[key] += 1
        slots = [self._entries[k] for k in found]
        self.pool.share(slots)
        return slots

    def insert(self, token_ids: Sequence[int], slots: Sequence[int]) -> int:
        """Cache the full blocks of `token_ids`, whose KV is in `slots` (one per block; a
        partial tail block or extra slots are ignored). A block already cached keeps its
        slot, and the caller's duplicate is not referenced. All or nothing: a free slot
        raises before anything changes. Returns how many entries were added."""
        return self.insert_keys(block_hashes(token_ids, self.block_size)[: len(slots)], slots)

    def insert_keys(self, keys: Sequence[bytes], slots: Sequence[int]) -> int:
        """`insert` by the chain's block hashes, one per slot, from the chain's head."""
        new = {k: s for k, s in zip(keys, slots, strict=False) if k not in self._entries}
        self.pool.share(new.values())
        self._entries.update(new)
        self._hits.update(dict.fromkeys(new, 0))
        self._touch(keys)
        return len(new)

    def get(self, key: bytes) -> int | None:
        """The slot cached under `key`, or None; takes no reference and touches nothing."""
        return self._entries.get(key)

    def evict(self, need_free: int) -> int:
        """Drop entries (class doc) until the pool has `need_free` free slots or no entry only
        the index holds is left; each goes through `demote` first. Returns how many were
        dropped."""
        dropped = 0
        while self.pool.num_free < need_free:
            key = self._victim()
            if key is None:
                break
            if self.demote is not None:
                self.demote(key, self._entries[key])
            self.drop(key)
            dropped += 1
        return dropped

    def _victim(self) -> bytes | None:
        """The entry eviction drops next (class doc), or None when every entry is held."""
        best, best_score = None, float("inf")
        for seen, (key, slot) in enumerate(self._entries.items()):
            if seen >= EVICT_WINDOW and best is not None:
                break
            if self.pool.refcount(slot) != 1:
                continue
            score = self._touched[key] + REUSE_BONUS_S * min(self._hits[key], MAX_BONUS_HITS)
            if score < best_score:
                best, best_score = key, score
        return best

    def evictable(self) -> int:
        """Entries whose slot only the index holds: what `evict` could free."""
        return sum(1 for slot in self._entries.values() if self.pool.refcount(slot) == 1)

    def alloc(self, n: int) -> list[int]:
        """`pool.alloc(n)`, evicting cached prefixes first when the pool is short."""
        self.evict(n)
        return self.pool.alloc(n)
