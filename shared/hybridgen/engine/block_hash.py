"""Chained digests of full token blocks: the key under which a block's KV is reused.

h_i = blake2b(h_{i-1} || tokens of block i), with h_{-1} = b"". Equal prefixes give equal
chains, and a block's digest covers every token before it, so the same tokens after a
different prefix get a different key. 128-bit digests make a collision (which would serve
wrong KV) negligible. Both KV tiers key on these: the GPU's block pool (Hot) and the Warm
pool's prefix index.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np


def chain_hash(prev: bytes, block: Sequence[int]) -> bytes:
    """The digest of one full block that follows the block whose digest is `prev`."""
    data = np.asarray(block, dtype=np.int64).tobytes()
    return hashlib.blake2b(prev + data, digest_size=16).digest()


def block_hashes(token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """One digest per full block of `token_ids`; the partial tail block is skipped."""
    out: list[bytes] = []
    prev = b""
    for i in range(len(token_ids) // block_size):
        prev = chain_hash(prev, token_ids[i * block_size : (i + 1) * block_size])
        out.append(prev)
    return out
