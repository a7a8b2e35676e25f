"""One step's attention over the paged KV cache: the decode rows by the paged decode kernel
(with the Warm tier's partial merged in by log-sum-exp), the prefill chunks by the paged
prefill kernel. Shared by the ordinary attention (llama.py) and MLA (mla.py), which both
hand it queries [T, Hq, D] against a cache of [N, S, Hkv, D]."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from hybridgen.kernels import ops

if TYPE_CHECKING:
    from hybridgen.models.llama import AttentionBatch


def paged_attention(
    q: torch.Tensor,
    batch: AttentionBatch,
    kv: ops.KvCache,
    layer: int,
    scale: float,
    sliding_window: int = 0,
) -> torch.Tensor:
    """q: [T, Hq, D] (rotated; its K and V already in `kv`) -> out [T, Hq, D]."""
    out = torch.empty_like(q)  # [T, Hq, D]
    nd = batch.num_decode
    warm = batch.warm
    if nd and warm is None:
        ops.decode_attention(
            q[:nd],
            kv,
            batch.block_tables[:nd],
            batch.seq_lens[:nd],
            scale,
            sliding_window,
            out=out[:nd],
        )
    elif nd and warm is not None:  # Hot and Warm partials, merged by log-sum-exp
        hot = ops.decode_attention(
            q[:nd],
            kv,
            batch.block_tables[:nd],
            batch.seq_lens[:nd],
            scale,
            return_lse=True,
        )
        w_out, w_lse = warm.decode_partial(layer, q[:nd], scale)
        out[:nd] = ops.merge_attention_partials(hot[0], hot[1], w_out, w_lse)[0]
    if nd < len(batch.seq_lens_host):
        first = batch.query_start_loc[nd]
        out[first:] = ops.prefill_attention(
            q[first:],
            kv,
            batch.block_tables[nd:],
            [i - first for i in batch.query_start_loc[nd:]],
            batch.seq_lens_host[nd:],
            scale,
            sliding_window,
            None
            if warm is None
            else [warm.prefix(layer, i, q.dtype) for i in range(nd, len(batch.seq_lens_host))],
        )
    return out
