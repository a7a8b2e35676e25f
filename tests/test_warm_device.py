"""attn_warm mode (b) in place: the Warm pool's slot area read as paged KV caches by the decode
kernels (the torch reference on the CPU, and the Triton kernel under the interpreter, which is
what CUDA runs over the registered pool), against float64 attention over the decoded blocks."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from hybridgen.gpu_daemon.warm_device import WarmDeviceView, device_view
from hybridgen.kernels import triton_paged_decode as t_decode
from hybridgen.kernels.kv_quant import QuantKvCache
from hybridgen.kvcodec import get_codec
from hybridgen.kvcodec.warm_pool import WarmPool

S, HKV, D, L, HQ = 16, 2, 64, 3, 8
SCALE = 1 / math.sqrt(D)
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ROWS = [[5, 0, 9], [2], [7, 8, 1, 3, 4, 6]]  # slot ids per query row, in token order


def _pool(instance: str, codec: str) -> WarmPool:
    """A pool of 10 slots, every layer of every slot filled with its own random KV."""
    pool = WarmPool.create(instance, get_codec(codec, S, HKV, D, torch.float32), L, 10)
    g = torch.Generator().manual_seed(3)
    for slot in pool.alloc(10):
        k, v = torch.randn(L, S, HKV, D, generator=g), torch.randn(L, S, HKV, D, generator=g)
        k[:, :, :, 7] *= 15  # an outlier channel, as real keys have
        pool.store(slot, k, v)
    return pool


def _exact(pool: WarmPool, layer: int, q: Tensor) -> tuple[Tensor, Tensor]:
    """float64 attention of each row over its slots, decoded by the codec."""
    outs, lses = [], []
    for i, slots in enumerate(ROWS):
        rec = torch.from_numpy(pool.slot_area()[slots, layer].copy())
        k, v = (t.flatten(0, 1).double() for t in pool.codec.decode_blocks(rec, torch.float32))
        kh = k.repeat_interleave(HQ // HKV, dim=1)  # [n, Hq, D]
        vh = v.repeat_interleave(HQ // HKV, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[i].double(), kh) * SCALE
        lse = torch.logsumexp(scores, -1)
        outs.append(torch.einsum("hn,nhd->hd", torch.exp(scores - lse[:, None]), vh))
        lses.append(lse)
    return torch.stack(outs), torch.stack(lses)


@pytest.mark.parametrize("codec", ["lossless", "int8"])
def test_in_place_attention_matches_decoded_blocks(instance: str, codec: str) -> None:
    pool = _pool(instance, codec)
    view = device_view(pool, DEVICE)  # on CUDA: the pool registered, read over PCIe
    assert isinstance(view, WarmDeviceView)
    q = torch.randn(len(ROWS), HQ, D, generator=torch.Generator().manual_seed(4))
    for layer in (1, 2):  # a wrong layer stride shows
        ex_out, ex_lse = _exact(pool, layer, q)
        out, lse = view.attend(layer, q.to(DEVICE), ROWS, SCALE)
        assert out.dtype == lse.dtype == torch.float32 and out.device.type == DEVICE.type
        assert torch.allclose(out.double().cpu(), ex_out, atol=1e-5, rtol=0)
        assert torch.allclose(lse.double().cpu(), ex_lse, atol=1e-5, rtol=0)
        if DEVICE.type == "cuda":
            continue  # attend ran the Triton kernel itself
        # On the CPU, attend ran the torch reference: the Triton kernel (interpreted) over
        # the same strided views of shared memory.
        table = torch.tensor([r + [0] * (6 - len(r)) for r in ROWS], dtype=torch.int32)
        lens = torch.tensor([len(r) * S for r in ROWS], dtype=torch.int32)
        cache = view.layers[layer]
        if isinstance(cache, QuantKvCache):
            res = t_decode.paged_decode_attention_quant(
                q, cache, table, lens, SCALE, return_lse=True, num_splits=2
            )
        else:
            res = t_decode.paged_decode_attention(
                q, cache[0], cache[1], table, lens, SCALE, return_lse=True, num_splits=2
            )
        assert isinstance(res, tuple)
        assert torch.allclose(res[0].double(), ex_out, atol=1e-5, rtol=0)
        assert torch.allclose(res[1].double(), ex_lse, atol=1e-5, rtol=0)
        del cache
    view.close()
    pool.close()  # the view's tensors no longer alias the mapping


@pytest.mark.parametrize("codec", ["lz4", "int4"])
def test_codecs_without_a_paged_layout_have_no_view(instance: str, codec: str) -> None:
    """lz4 records vary in size and int4 keys have per-channel scales: decoded instead."""
    pool = _pool(instance, codec)
    assert device_view(pool, torch.device("cpu")) is None
    pool.close()
