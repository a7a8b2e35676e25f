"""The pool of fixed-size KV blocks, with reference counts and a prefix cache.

A block is in exactly one of three states:
- free: on the free list, refcount 0, content meaningless;
- held: refcount >= 1 (several holders share a prefix block);
- idle: refcount 0 but cached: its full, computed KV is registered under the chained hash of
  its tokens (`hybridgen.engine.block_hash`), so a later sequence with the same prefix can take it
  back (`lookup`) instead of recomputing it. Idle blocks count as free: `allocate` takes
  truly free blocks first, then evicts idle ones, least recently released first.

Invariants:
- a block is returned to the free (or idle) set exactly when its last holder frees it;
- no block is both free and idle, and neither set holds duplicates, so two live sequences
  never get the same fresh block;
- a registered block's content is never rewritten while it stays registered: only full,
  computed blocks are registered, and sequences write only past their computed tokens.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Sequence


class OutOfBlocks(RuntimeError):
    """Raised when an allocation asks for more blocks than are free."""


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks} must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._refs = [0] * num_blocks
        self._by_hash: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self._idle: OrderedDict[int, None] = OrderedDict()  # least recently released first

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take: free plus idle (cached, unheld)."""
        return len(self._free) + len(self._idle)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        """Blocks registered under a prefix hash (held or idle)."""
        return len(self._by_hash)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    def allocate(self, n: int) -> list[int]:
        """Take `n` fresh blocks, each with refcount 1; all or nothing."""
        if n > self.num_free:
            raise OutOfBlocks(f"asked for {n} blocks, {self.num_free} free")
        ids = []
        for _ in range(n):
            if self._free:
                b = self._free.popleft()
            else:
                b, _ = self._idle.popitem(last=False)
                del self._by_hash[self._hash_of.pop(b)]
            self._refs[b] = 1
            ids.append(b)
        return ids

    def share(self, block_ids: list[int]) -> None:
        """Add a holder to blocks that are already held (prefix sharing)."""
        for b in block_ids:
            if self._refs[b] < 1:
                raise ValueError(f"block {b} is free and cannot be shared")
        for b in block_ids:
            self._refs[b] += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one holder from each block; a block with no holder left becomes idle if it is
        cached, else free. Blocks go idle last to first, so that a released sequence's tail
        is evicted before its head: a cached prefix stays usable while it shrinks."""
        for b, n in Counter(block_ids).items():
            if self._refs[b] < n:
                raise ValueError(f"block {b} freed more often than it is held")
        for b in reversed(block_ids):
            self._refs[b] -= 1
            if self._refs[b] == 0:
                if b in self._hash_of:
                    self._idle[b] = None
                else:
                    self._free.append(b)

    def refcount(self, block_id: int) -> int:
        return self._refs[block_id]

    def register(self, block_id: int, key: bytes) -> None:
        """Cache a held block whose KV is full and computed under its chained hash `key`. A
        key that is cached already keeps its block; a block is cached under one key only."""
        if self._refs[block_id] < 1:
            raise ValueError(f"block {block_id} is not held and cannot be registered")
        if key not in self._by_hash and block_id not in self._hash_of:
            self._by_hash[key] = block_id
            self._hash_of[block_id] = key

    def lookup(self, keys: Sequence[bytes]) -> list[int]:
        """Hold the cached blocks of the longest prefix of `keys` (one chain, in order) and
        return them; the caller frees them like any other block."""
        found = []
        for key in keys:
            b = self._by_hash.get(key)
            if b is None:
                break
            found.append(b)
        for b in found:
            if self._refs[b] == 0:
                del self._idle[b]
            self._refs[b] += 1
        return found
