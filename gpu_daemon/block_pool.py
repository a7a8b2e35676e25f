"""The pool of fixed-size KV blocks, with reference counts.

Invariants:
- a block id is either on the free list (refcount 0) or held (refcount >= 1), never both;
- a block is returned to the free list exactly when its last holder frees it;
- the free list never holds duplicates, so two live sequences never get the same fresh block.
Reference counts are the hook for prefix sharing: a shared block is held by several
sequences and freed when the last one lets go.
"""

from __future__ import annotations

from collections import Counter, deque


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

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    def allocate(self, n: int) -> list[int]:
        """Take `n` fresh blocks, each with refcount 1; all or nothing."""
        if n > len(self._free):
            raise OutOfBlocks(f"asked for {n} blocks, {len(self._free)} free")
        ids = [self._free.popleft() for _ in range(n)]
        for b in ids:
            self._refs[b] = 1
        return ids

    def share(self, block_ids: list[int]) -> None:
        """Add a holder to blocks that are already held (prefix sharing)."""
        for b in block_ids:
            if self._refs[b] < 1:
                raise ValueError(f"block {b} is free and cannot be shared")
        for b in block_ids:
            self._refs[b] += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one holder from each block; blocks with no holder left become free."""
        for b, n in Counter(block_ids).items():
            if self._refs[b] < n:
                raise ValueError(f"block {b} freed more often than it is held")
        for b in block_ids:
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free.append(b)

    def refcount(self, block_id: int) -> int:
        return self._refs[block_id]
