"""The Warm pool's prefix index: chained block hashes -> Warm slots, LRU, for prefix reuse."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence

from hybridgen.block_hash import block_hashes
from hybridgen.kvcodec.warm_pool import WarmPool


class PrefixIndex:
    """Maps chains of full-block token hashes to Warm slots, for prefix reuse.

    Invariants:

    * Each entry holds exactly one pool reference to its slot (taken by `insert`, dropped by
      eviction), so a cached slot is never handed out while it is cached.
    * Entries are kept in LRU order, and every touch refreshes a chain from its tail back to
      its head, so a block is always at least as recent as any block that extends it.
      Evicting least-recent first therefore drops tails before heads and never leaves an
      entry unreachable behind an evicted parent.
    """

    def __init__(self, pool: WarmPool) -> None:
        pool._owner_only("PrefixIndex")
        self.pool = pool
        self.block_size: int = pool.codec.spec.block_size
        self._entries: OrderedDict[bytes, int] = OrderedDict()  # chain hash -> slot, LRU first
        self._touched: dict[bytes, float] = {}  # chain hash -> time.monotonic() of last use

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
        del self._touched[key]
        self.pool.free([slot])

    def lookup(self, token_ids: Sequence[int]) -> list[int]:
        """Slots of the longest cached prefix of whole blocks of `token_ids`.

        The caller gets one pool reference per returned slot (free them when done), so an
        eviction cannot recycle a slot it is reading.
        """
        return self.lookup_keys(block_hashes(token_ids, self.block_size))

    def lookup_keys(self, keys: Sequence[bytes]) -> list[int]:
        """`lookup` by the chain's block hashes (`hybridgen.block_hash`), in order."""
        found: list[bytes] = []
        for key in keys:
            if key not in self._entries:
                break
            found.append(key)
        self._touch(found)
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
        self._touch(keys)
        return len(new)

    def evict(self, need_free: int) -> int:
        """Drop LRU entries until the pool has `need_free` free slots or nothing is cached.

        A dropped entry frees its slot only if no sequence still holds it. Returns how many
        entries were dropped.
        """
        dropped = 0
        while self.pool.num_free < need_free and self._entries:
            self.drop(next(iter(self._entries)))
            dropped += 1
        return dropped

    def evictable(self) -> int:
        """Entries whose slot only the index holds: what `evict` could free."""
        return sum(1 for slot in self._entries.values() if self.pool.refcount(slot) == 1)

    def alloc(self, n: int) -> list[int]:
        """`pool.alloc(n)`, evicting cached prefixes first when the pool is short."""
        self.evict(n)
        return self.pool.alloc(n)
