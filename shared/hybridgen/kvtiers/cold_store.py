"""The Cold KV tier: Warm records that nobody used for a while, lz4-compressed in host memory.

The Warm tier (gpu_daemon.warm_tier) moves a cached prefix block here after
kv_cache.cold_threshold_ms unused, which frees its Warm slot, and brings it back on a prefix
hit. Records are the warm codec's bytes, so Cold is lz4 on top of the warm codec.
"""

from __future__ import annotations

from collections import OrderedDict

import lz4.frame


class ColdStore:
    """Cold tier: lz4 over Warm records (the warm codec's bytes), in host memory, keyed by
    prefix hash; at most `capacity` compressed bytes, least recently stored dropped first."""

    def __init__(self, capacity: int, threshold_s: float) -> None:
        self.capacity, self.threshold_s = capacity, threshold_s
        self._blocks: OrderedDict[bytes, bytes] = OrderedDict()
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def put(self, key: bytes, record: bytes) -> None:
        data = lz4.frame.compress(record)
        self._drop(key)  # the same prefix may age again after a recompute
        self._blocks[key] = data
        self.nbytes += len(data)
        while self.nbytes > self.capacity and self._blocks:
            _, old = self._blocks.popitem(last=False)
            self.nbytes -= len(old)

    def take(self, key: bytes) -> bytes | None:
        """The record stored under `key` (decompressed), removed from Cold; None if absent."""
        data = self._drop(key)
        return None if data is None else bytes(lz4.frame.decompress(data))

    def _drop(self, key: bytes) -> bytes | None:
        data = self._blocks.pop(key, None)
        if data is not None:
            self.nbytes -= len(data)
        return data
