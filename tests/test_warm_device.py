"""attn_warm mode (b) in place: the Warm pool's slot area read as paged KV caches by the decode
kernels (the torch reference on the CPU, and the Triton kernel under the interpreter, which is
what CUDA runs over the registered pool), against float64 attention over the decoded blocks;
and the prefill's Warm prefix gathered the same way, against the codec's decode_blocks."""

from __future__ import annotations

import dataclasses
import gc
import math

import pytest
import torch
from torch import Tensor

from hybridgen.kernels import triton_block_gather as t_gather
from hybridgen.kernels import triton_paged_decode as t_decode
from hybridgen.kernels.kv_quant import QuantKvCache
from hybridgen.kvtiers.codec import get_codec
from hybridgen.kvtiers.warm_device import WarmDeviceView, device_view, gather_reference
from hybridgen.kvtiers.warm_pool import WarmPool
from hybridgen.kvtiers.warm_tier import WarmTier
from hybridgen.models.presets import PRESETS

S, HKV, D, L, HQ = 16, 2, 64, 3, 8
SCALE = 1 / math.sqrt(D)
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ROWS = [[5, 0, 9], [2], [7, 8, 1, 3, 4, 6]]  # slot ids per query row, in token order


CODECS = ["lossless", "int8", "int4", "int4_token"]
"""int4_token: int4 with keys grouped per token, an int4 Hot cache's blocks as they are."""


def _pool(instance: str, codec: str, dtype: torch.dtype = torch.float32) -> WarmPool:
    """A pool of 10 slots, every layer of every slot filled with its own random KV."""
    options = {"per_token_keys": True} if codec == "int4_token" else {}
    c = get_codec(codec.removesuffix("_token"), S, HKV, D, dtype, **options)
    pool = WarmPool.create(instance, c, L, 10)
    g = torch.Generator().manual_seed(3)
    for slot in pool.alloc(10):
        k, v = torch.randn(L, S, HKV, D, generator=g), torch.randn(L, S, HKV, D, generator=g)
        k[:, :, :, 7] *= 15  # an outlier channel, as real keys have
        pool.store(slot, k.to(dtype), v.to(dtype))
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


@pytest.mark.parametrize("codec", CODECS)
def test_in_place_attention_matches_decoded_blocks(instance: str, codec: str) -> None:
    """int4 records (KIVI: a key scale and zero per block and channel, values per token and
    group) are read as a cache whose key scales repeat over the block's tokens (stride 0);
    int4_token records as an int4 Hot cache."""
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
    gc.collect()  # the interpreter's reference cycle holds views of the pool
    pool.close()  # the view's tensors no longer alias the mapping


def test_lz4_records_have_no_view(instance: str) -> None:
    """lz4 records vary in size: no paged layout, decoded from copies instead."""
    pool = _pool(instance, "lz4")
    assert device_view(pool, torch.device("cpu")) is None
    pool.close()


def _bits(t: Tensor) -> Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def _decoded(pool: WarmPool, slots: list[int], layer: int, dtype: torch.dtype) -> list[Tensor]:
    """The codec's decode_blocks of the records -> [k, v] [n * S, Hkv, D]."""
    rec = torch.from_numpy(pool.slot_area()[slots, layer].copy())
    return [t.flatten(0, 1) for t in pool.codec.decode_blocks(rec, dtype)]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("stored", "dtype"),
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.bfloat16),
    ],
)
@pytest.mark.parametrize("codec", CODECS)
def test_prefill_gather_equals_decode_blocks(
    instance: str,
    codec: str,
    stored: torch.dtype,
    dtype: torch.dtype,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The prefix gather (Triton, interpreted over the pool's shared memory, and the torch
    reference) gives the codec's decode_blocks bit for bit, for shuffled slots, at the first
    and the last layer, and with blocks split over several tiles."""
    pool = _pool(instance, codec, stored)
    if codec == "lossless":  # a copy keeps every bit pattern; a cast rounds as torch's does
        k = torch.randn(L, S, HKV, D).to(stored)
        k[:, 0, 0, :4] = torch.tensor([-0.0, math.inf, -math.inf, 1e-40])
        if stored == dtype:  # NaN payloads (torch's own casts disagree on a NaN's bits)
            k[:, 0, 0, 4] = math.nan
            k.view(torch.int16 if stored == torch.bfloat16 else torch.int32)[:, 1, 0, 0] = -1
        pool.store(4, k, -k)
    view = device_view(pool, DEVICE)
    assert view is not None
    order = torch.randperm(10, generator=torch.Generator().manual_seed(5)).tolist()
    slots = [s for s in order if s not in (1, 6, 8)]  # shuffled, slot 4 among them
    index = torch.tensor(slots).to(DEVICE)
    for layer in (0, L - 1):
        expected = [_bits(t) for t in _decoded(pool, slots, layer, dtype)]
        cache = view.layers[layer]
        with monkeypatch.context() as m:
            m.setattr(t_gather, "_TILE_ELEMS", 4 * D)  # 4 tiles of 4 tokens per block
            split = t_gather.gather_blocks(cache, index, dtype)
        for got in (
            view.gather(layer, slots, dtype),  # Triton on CUDA, the reference on the CPU
            t_gather.gather_blocks(cache, index, dtype),
            split,
            gather_reference(cache, index, dtype),
        ):
            assert [t.dtype for t in got] == [dtype, dtype]
            assert [t.shape for t in got] == [(len(slots) * S, HKV, D)] * 2
            assert all(torch.equal(_bits(a.cpu()), b) for a, b in zip(got, expected, strict=True))
        del cache
    view.close()
    gc.collect()  # the Triton interpreter keeps its argument storages in a reference cycle
    pool.close()


@pytest.mark.parametrize("codec", ["lossless", "int8", "int4", "lz4"])
def test_prefill_prefix_reads_the_pool_in_place(
    codec: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """WarmContext.prefix in gpu mode: with a paged codec, each layer gathers the prefix from
    the pool itself (no copy of the records; the slot list goes to the device once per step),
    else it decodes a copy; either way the codec's decoding, with the bytes counted."""
    spec = dataclasses.replace(PRESETS["tiny-llama"], dtype=torch.float32)
    tier = WarmTier(spec, S, codec, 1.0, "gpu", None, torch.device("cpu"))
    g = torch.Generator().manual_seed(6)
    shape = (spec.num_layers, S, spec.num_kv_heads, spec.head_dim)
    slots = tier.pool.alloc(5)
    for slot in slots:
        tier.pool.store(slot, torch.randn(shape, generator=g), torch.randn(shape, generator=g))
    prefix = [slots[3], slots[0], slots[4]]
    in_place = tier.view is not None
    assert in_place == (codec != "lz4")
    uploads: list[list[int]] = []
    if in_place:
        assert tier.view is not None
        monkeypatch.setattr(tier, "_records", None)  # a copy of the records would fail
        real = tier.view.slot_index
        monkeypatch.setattr(tier.view, "slot_index", lambda s: uploads.append(s) or real(s))
    ctx = tier.context([[], prefix], [0, 40])
    assert ctx is not None
    for layer in range(spec.num_layers):
        assert ctx.prefix(layer, 0, spec.dtype) is None
        got = ctx.prefix(layer, 1, spec.dtype)
        assert got is not None
        expected = _decoded(tier.pool, prefix, layer, spec.dtype)
        assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    assert uploads == ([prefix] if in_place else [])
    assert tier.stats.h2d_bytes == spec.num_layers * len(prefix) * tier.pool.record_bytes
    assert len(tier.stats.decompress_ms) == spec.num_layers
    tier.close()


@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_quantized_hot_blocks_load_back_in_place(
    codec: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An int8 / int4 Hot cache's blocks, stored to Warm and loaded back into other Hot
    blocks, come back byte for byte, their records read in place (no copy out of shm): on
    CUDA by the Triton row gather over the registered pool, on the CPU by the torch reference
    and by the Triton row gather (interpreted) over the same shared memory."""
    spec = dataclasses.replace(PRESETS["tiny-llama"], dtype=torch.float32)
    tier = WarmTier(spec, S, codec, 1.0, "gpu", None, DEVICE, hot_codec=codec)
    hot = [
        QuantKvCache.empty(codec, 8, S, spec.num_kv_heads, spec.head_dim, DEVICE)
        for _ in range(spec.num_layers)
    ]
    g = torch.Generator().manual_seed(7)

    def fields(kv: QuantKvCache) -> list[Tensor]:
        ts = (kv.k, kv.v, kv.k_scale, kv.v_scale, kv.k_zero, kv.v_zero)
        return [t.view(torch.uint8) for t in ts if t is not None]

    for kv in hot:
        for t in fields(kv):
            t.copy_(torch.randint(0, 256, t.shape, generator=g, dtype=torch.uint8))
    slots = tier.store(hot, [6, 1, 3])
    monkeypatch.setattr(tier, "_records", None)  # a copy of the records would fail
    tier.load(hot, slots, [0, 4, 7])
    for kv in hot:
        assert all(torch.equal(t[[0, 4, 7]], t[[6, 1, 3]]) for t in fields(kv))
    assert tier.view is not None
    index = torch.tensor(slots[::-1])
    for layer in (0, spec.num_layers - 1):
        rows = tier.view._area[:, layer]  # type: ignore[index]
        got = t_gather.gather_rows(rows, index.to(DEVICE))
        assert torch.equal(got.cpu(), rows[index])
        del rows
    gc.collect()  # the interpreter's reference cycle holds views of the pool
    tier.close()
