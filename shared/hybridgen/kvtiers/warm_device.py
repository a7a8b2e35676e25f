"""attn_warm mode (b) in place: the Warm pool read by the device's paged decode kernel.

Where a Warm codec stores each block as the fields of a Hot-KV block, the pool's slot area is
a paged KV cache with a long stride between blocks::

    slot area (host shm):  | slot 0: layer 0 .. layer L-1 | slot 1: ... |
    layer l of slot s:     record at HEADER + s * slot_bytes + l * record_bytes
    lossless record:       k [S, Hkv, D] (model dtype), v [S, Hkv, D]       -> (k, v) cache
    int8 record:           k_codes, v_codes [S, Hkv, D], k_scale, v_scale  -> QuantKvCache
    int4 record (KIVI):    k_codes, v_codes [S, Hkv, D/2], v_scale, v_zero [S, Hkv, D/g],
                           k_scale, k_zero [Hkv, D] (one per block and channel)
                                                   -> QuantKvCache, key scales [S, Hkv, D]
                                                      with stride 0 along S: a key group of 1
    int4, keys per token:  k_scale, k_zero [S, Hkv, D/g] (an int4 Hot block as it was)
                                                   -> QuantKvCache, as a Hot cache

so layer l of the whole pool is an [capacity, S, Hkv, D] strided view, and a block table of
Warm slots addresses it exactly as one of Hot blocks. On CUDA the slot area is registered
with cudaHostRegister (page-locked, mapped into the device's address space), so the Triton
kernel reads the compressed bytes over PCIe as it attends them: no staging copy, no decoded
copy, and the host thread is free for the CPU share meanwhile. The prefill reads the same way:
`gather` copies a sequence's Warm prefix of one layer in one pass into the dense K, V its
attention takes, int8 and int4 dequantized on the fly (triton_block_gather; the torch
reference on a CPU engine). lz4 records vary in size and have no paged layout; they are
copied to the device and decoded there instead (WarmTier.dense).
"""

from __future__ import annotations

import os
import time

import structlog
import torch
from torch import Tensor

from hybridgen.ipc.host_pin import MAPPED, PORTABLE, populate, register_host
from hybridgen.kernels import ops
from hybridgen.kernels.kv_quant import QuantKvCache, dequantize_blocks
from hybridgen.kvtiers.warm_pool import WarmPool

if ops.HAS_TRITON:
    from hybridgen.kernels.triton_block_gather import gather_blocks, gather_rows

log = structlog.get_logger()

_FIELDS = {
    "lossless": ("k", "v"),
    "int8": ("k_codes", "v_codes", "k_scale", "v_scale"),
    "int4": ("k_codes", "v_codes", "k_scale", "v_scale", "k_zero", "v_zero"),
}


class WarmDeviceView:
    """The pool's slot area as one paged KV cache per layer, readable by the device kernels.

    Invariant: while it lives, its tensors alias the pool's shared memory, so `close` must run
    before the pool unmaps (WarmTier.close does both, in that order).
    """

    def __init__(self, pool: WarmPool, device: torch.device) -> None:
        self.device = device
        self._area: Tensor | None = torch.from_numpy(pool.slot_area())  # [capacity, L, record]
        self._registered = False
        if device.type == "cuda" and self._area.numel():
            self._register()
        names = _FIELDS[pool.codec.name]
        self.layers: list[ops.KvCache] = [
            _layer_cache(pool, self._area[:, layer], names) for layer in range(pool.num_layers)
        ]

    def _register(self) -> None:
        assert self._area is not None
        nbytes = self._area.numel()
        start = time.perf_counter()
        try:
            populated = populate(self._area.data_ptr(), nbytes, os.cpu_count() or 1)
        except OSError as exc:
            raise RuntimeError(
                f"the Warm pool ({nbytes / 2**20:.0f} MiB) does not fit host memory ({exc}); "
                "lower kv_cache.warm_region_mb"
            ) from exc
        faulted = time.perf_counter()
        register_host(
            self._area.data_ptr(),
            nbytes,
            PORTABLE | MAPPED,
            "the Warm pool",
            "lower kv_cache.warm_region_mb or raise the memlock limit",
        )
        self._registered = True
        log.info(
            "warm_pool_pinned",
            mib=round(nbytes / 2**20),
            populate_s=round(faulted - start, 2) if populated else None,
            pin_s=round(time.perf_counter() - faulted, 2),
        )

    def block_table(self, slots: list[list[int]]) -> tuple[Tensor, Tensor]:
        """Each row's Warm `slots` (whole blocks, token order, at least one each) as the block
        table [n, max blocks] and key counts [n] the decode kernel takes, on the device (build
        it once per step: every layer reads the same slots)."""
        width = max(len(s) for s in slots)
        table = torch.zeros(len(slots), width, dtype=torch.int32)
        for i, row in enumerate(slots):
            table[i, : len(row)] = torch.tensor(row, dtype=torch.int32)
        block = self.layers[0]
        size = block.block_size if isinstance(block, QuantKvCache) else block[0].shape[1]
        lens = torch.tensor([len(s) * size for s in slots], dtype=torch.int32)
        return table.to(self.device, non_blocking=True), lens.to(self.device, non_blocking=True)

    def attend(
        self, layer: int, q: Tensor, slots: list[list[int]] | tuple[Tensor, Tensor], scale: float
    ) -> tuple[Tensor, Tensor]:
        """Decode attention of q [n, Hq, D] over each row's Warm `slots` (or their
        block_table) at `layer` -> out [n, Hq, D] fp32, lse [n, Hq] fp32."""
        table, lens = slots if isinstance(slots, tuple) else self.block_table(slots)
        out, lse = ops.decode_attention(q, self.layers[layer], table, lens, scale, return_lse=True)
        return out.float(), lse

    def slot_index(self, slots: list[int]) -> Tensor:
        """`slots` as the int64 index `gather` takes, on the device (build it once per step)."""
        return torch.tensor(slots, dtype=torch.int64).to(self.device, non_blocking=True)

    def gather(
        self, layer: int, slots: list[int] | Tensor, dtype: torch.dtype
    ) -> tuple[Tensor, Tensor]:
        """Warm `slots` (token order) at `layer`, decoded on the device -> k, v [n * S, Hkv, D]
        in `dtype`: exactly the codec's decode_blocks of their records, read in place."""
        index = slots if isinstance(slots, Tensor) else self.slot_index(slots)
        cache = self.layers[layer]
        if self.device.type == "cuda" and ops.HAS_TRITON:
            return gather_blocks(cache, index, dtype)
        return gather_reference(cache, index, dtype)

    def records(self, layer: int, slots: list[int] | Tensor) -> Tensor:
        """Warm `slots` at `layer` as they are -> [n, record_bytes] uint8 on the device, read
        in place (an int8 / int4 Hot cache's blocks going back into Hot)."""
        assert self._area is not None
        index = slots if isinstance(slots, Tensor) else self.slot_index(slots)
        rows = self._area[:, layer]
        if self.device.type == "cuda" and ops.HAS_TRITON:
            return gather_rows(rows, index)
        return rows.index_select(0, index.cpu()).to(self.device)

    def close(self) -> None:
        self.layers = []
        if self._registered and self._area is not None:
            torch.cuda.synchronize(self.device)  # no kernel may still read the pages
            torch.cuda.cudart().cudaHostUnregister(self._area.data_ptr())
        self._area, self._registered = None, False


def device_view(pool: WarmPool, device: torch.device) -> WarmDeviceView | None:
    """The in-place view of `pool`, or None for lz4, which has no paged layout."""
    return WarmDeviceView(pool, device) if pool.codec.name in _FIELDS else None


def gather_reference(
    cache: ops.KvCache, slots: Tensor, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """Torch twin of triton_block_gather.gather_blocks: cache [N, S, Hkv, D], slots [n] ->
    k, v [n * S, Hkv, D] in `dtype` on slots' device."""
    if isinstance(cache, QuantKvCache):
        k, v = dequantize_blocks(cache, slots, dtype)
    else:
        idx = slots.to(cache[0].device, torch.int64)
        k, v = cache[0][idx], cache[1][idx]
    return k.flatten(0, 1).to(slots.device, dtype), v.flatten(0, 1).to(slots.device, dtype)


def _layer_cache(pool: WarmPool, records: Tensor, names: tuple[str, ...]) -> ops.KvCache:
    # records: [capacity, record_bytes] uint8, rows slot_bytes apart -> each field as a
    # strided [capacity, *field.shape] view of its dtype.
    layout = pool.codec.layout  # type: ignore[attr-defined]
    by_name = {f.name: (f, at) for f, at in zip(layout.fields, layout.offsets, strict=True)}
    views = []
    for name in names:
        f, at = by_name[name]
        views.append(records[:, at : at + f.nbytes].view(f.dtype).unflatten(1, f.shape))
    if len(views) == 2:
        return views[0], views[1]
    if len(views) == 4:
        return QuantKvCache(k=views[0], v=views[1], k_scale=views[2], v_scale=views[3])
    k, v, k_scale, v_scale, k_zero, v_zero = views
    if k_scale.dim() == 4:  # keys grouped per token: an int4 Hot cache's blocks as they were
        return QuantKvCache(k, v, k_scale, v_scale, k_zero, v_zero)
    block = (-1, k.shape[1], -1, -1)  # one key scale per block and channel, for every token
    return QuantKvCache(
        k, v, k_scale.unsqueeze(1).expand(block), v_scale, k_zero.unsqueeze(1).expand(block), v_zero
    )
