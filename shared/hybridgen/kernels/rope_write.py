"""RopeWrite: what a fused qkv projection does after its matmul when its epilogue takes the
attention's first step (triton_dense_quant's one-row int4 kernels; the others and the CPU
run it as kernels after): rotate q and k (NeoX RoPE at each token's position), write k and v
to the layer's native cache at each token's slot, and return q."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor

RopeAndCache = Callable[..., None]
"""rope_and_cache(q, k, v, positions, cos, sin, k_cache, v_cache, slot_mapping): q and k
rotated in place, k and v written to the cache (triton_rope_cache's or reference's)."""


@dataclass(frozen=True)
class RopeWrite:
    positions: Tensor
    """[T] int64 positions (the rows of cos and sin)."""
    cos: Tensor
    """[positions, head_dim] (HF layout: cat(freqs, freqs))."""
    sin: Tensor
    k_cache: Tensor
    """[blocks, block size, num_kv_heads, head_dim] in the model dtype."""
    v_cache: Tensor
    slot_mapping: Tensor
    """[T] int64 cache slots (block * block size + offset); -1 writes nothing."""
    num_heads: int
    num_kv_heads: int

    def head_dim(self, width: int) -> int:
        """The head size of a fused qkv projection `width` outputs wide."""
        return width // (self.num_heads + 2 * self.num_kv_heads)

    def after(self, qkv: Tensor, rope_and_cache: RopeAndCache) -> Tensor:
        """What the epilogue does, by `rope_and_cache` (the Triton kernel or the torch
        reference) over a projection's output [T, width]: q [T, Hq, D], a view of it."""
        t, d = qkv.shape[0], self.head_dim(qkv.shape[-1])
        sizes = [self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d]
        q, k, v = (part.view(t, -1, d) for part in qkv.split(sizes, dim=-1))
        rope_and_cache(
            q,
            k,
            v,
            self.positions,
            self.cos,
            self.sin,
            self.k_cache,
            self.v_cache,
            self.slot_mapping,
        )
        return q

    def fusable(self, head_dim: int) -> bool:
        """Whether a kernel's epilogue takes these operands: contiguous caches and tables,
        RoPE over the whole head."""
        tensors = (self.cos, self.sin, self.k_cache, self.v_cache)
        return all(x.is_contiguous() for x in tensors) and self.cos.shape[-1] == head_dim
