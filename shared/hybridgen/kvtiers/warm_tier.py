"""The Warm tier inside the engine: Hot blocks spilled to compressed host memory, and the
attention over them.

A sequence's KV is a prefix in Warm and the rest in Hot::

    tokens:  [0 ........ W*S) [W*S ........... num_computed)
    where:    seq.warm_slots    seq.block_ids (Hot blocks)      S = block_size, W = warm blocks

Blocks move Hot -> Warm when the Hot pool runs short (`WarmOffload.spill` in warm_offload.py,
oldest blocks of the sequence holding the most Hot blocks first), when a sequence is
preempted (`swap_out`: it keeps its computed prefix instead of recomputing it) and when a
sequence finishes (`keep`: its prefix outlives Hot, for the next turn of its conversation).
When Warm needs room, cached blocks nobody uses go on to Cold (cold_store.py), as long as
keeping them pays (kvtiers/prefix_cache.py). A sequence admitted with a Warm prefix (swapped
out, or a prefix hit) has it copied back into Hot when Hot has room for it (`load`);
otherwise its keys are read where they live, and Warm attention is part of every decode step
of that sequence:

    decode:  out = merge_lse(hot partial (GPU paged kernel), warm partial)
    prefill: keys = [Warm prefix decoded on the device] + [gathered Hot keys]

The warm partial runs in one of three modes (`attn_warm`): `cpu`, mode (a), the CPU decodes
and attends (cpu_daemon.warm_attention); `gpu`, mode (b), the compressed records cross PCIe and
the device decodes and attends; `split`, mode (c), the first `warm_split` of each sequence's
Warm blocks go to the CPU and the rest to the device (a share measured at start unless pinned),
three partials merged by log-sum-exp.
Every partial is fp32, so exact codecs give exact attention.

The engine owns the pool. Under the daemons the CPU share is computed by the CPU daemon, which
maps the pool (cpu_daemon.warm_link); in one process, here. Not for sliding-window models
(their old blocks are never read again).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence as Seq
from typing import Any

import numpy as np
import structlog
import torch
from torch import Tensor

from hybridgen.config.engine import EngineConfig
from hybridgen.engine.step_budget import StepBudget
from hybridgen.kernels import ops
from hybridgen.kernels.kv_quant import QuantKvCache
from hybridgen.kvtiers.codec import get_codec
from hybridgen.kvtiers.codec_base import Codec, RecordLayout
from hybridgen.kvtiers.cold_store import ColdStore
from hybridgen.kvtiers.prefix_cache import KeepGate
from hybridgen.kvtiers.prefix_index import PrefixIndex
from hybridgen.kvtiers.warm_attention import (
    WarmSpan,
    dense_partial,
    warm_decode_attention,
)
from hybridgen.kvtiers.warm_context import WarmContext
from hybridgen.kvtiers.warm_device import WarmDeviceView, device_view
from hybridgen.kvtiers.warm_link import WarmLinkClient, WarmLinkDown
from hybridgen.kvtiers.warm_pool import WarmPool, capacity_for, slot_bytes_for
from hybridgen.kvtiers.warm_stats import WarmStats
from hybridgen.models.spec import ModelSpec
from hybridgen.placement.tuner import Tuner
from hybridgen.runtime.upload import upload

log = structlog.get_logger()

LOW_WATER_SHARE = 0.25
"""`age` moves idle cached blocks to Cold only while fewer than this share of Warm's slots is
free: Warm keeps what it has room for, and keeps room for spills and swaps."""
STORE_CHUNK = 16
"""Hot blocks encoded and copied to Warm at once: 32 MiB of K and V for llama3-8b, and the
encode's fp32 temporaries some 3x that, within the step workspace (store runs between steps).
One block at a time took ~2 ms each on the H200 (a swap of 3,452 blocks cost seconds, more
than recomputing them); 64 at once asked ~0.5 GiB, and a finished turn's write-back ran the
GPU daemon out of its 24 GB budget on the H200 (B6 (i) at 08336d0)."""


class WarmTier:
    """The Warm pool of one engine and the Hot <-> Warm moves."""

    @classmethod
    def from_config(cls, config: EngineConfig, spec: ModelSpec, device: torch.device) -> WarmTier:
        """The tier `config` asks for (kv_cache.warm_region_mb > 0; attn_warm, its codec and
        kv_codec placement, the cold threshold, the shared-memory instance)."""
        return cls(
            spec,
            config.block_size,
            config.warm_codec,
            config.warm_pool_mb,
            config.attn_warm,
            config.warm_split,
            device,
            config.shm_instance,
            config.cold_threshold_ms,
            config.kv_codec_placement,
            config.hot_codec,
        )

    def __init__(
        self,
        spec: ModelSpec,
        block_size: int,
        codec: str,
        pool_mb: float,
        mode: str,
        split: float | None,
        device: torch.device,
        instance: str | None = None,
        cold_threshold_ms: float = 150.0,
        codec_on: str = "gpu",
        hot_codec: str = "native",
    ) -> None:
        if spec.sliding_window:
            raise ValueError(
                f"kv_cache.warm_region_mb: the Warm tier does not serve sliding-window models "
                f"({spec.name} has a {spec.sliding_window}-token window); set it to 0"
            )
        self.spec, self.block_size, self.device = spec, block_size, device
        self.codec_on = codec_on
        """The kv_codec region's placement. gpu: Hot blocks are encoded on the device and
        cross PCIe compressed, and copied records are decoded there (or read in place); cpu:
        blocks cross raw and the CPU encodes them, and decodes records before they cross."""
        self.mode = mode
        self.split: float = split if split is not None else float(mode == "cpu")
        self.hot_quantized = hot_codec != "native"
        """An int8 / int4 Hot cache: its blocks move as they are, their fields being the Warm
        codec's records (warm_codec_for)."""
        c = warm_codec_for(spec, codec, block_size, hot_codec)
        capacity = capacity_for(pool_mb, c, spec.num_layers)
        name = instance or f"engine{uuid.uuid4().hex[:10]}"
        self.pool = WarmPool.create(name, c, spec.num_layers, capacity)
        if instance is None:  # private: no other process attaches, so nothing can leak
            self.pool.unlink()
        self.index = PrefixIndex(self.pool)
        """Warm blocks by prefix hash: they outlive their sequence until the space is needed."""
        self.index.demote = self._to_cold
        self.cold_gate = KeepGate()
        """Whether an evicted or aged block is worth lz4 into Cold (prefix_cache.py)."""
        self.step_times: StepBudget | None = None
        """Set by the engine: its measured prefill cost prices a block's recompute."""
        self.last_promoted = 0
        """Cold blocks the last lookup brought back."""
        self.stats = WarmStats()
        self.remote: WarmLinkClient | None = None
        """Set under the daemons: the CPU daemon computes the CPU share (else this process)."""
        self.cold = ColdStore(self.pool.slot_bytes * capacity, cold_threshold_ms / 1e3)
        self.view: WarmDeviceView | None = device_view(self.pool, device)
        """The pool as paged caches the device kernels read in place (mode b, and every
        prefill's Warm prefix; warm_device)."""
        self.tuner: Tuner | None = None
        """Set by the engine with dynamic_tuning: re-balances `split` from live timings."""
        if mode == "auto":  # until the engine measures both sides (on CUDA): the CPU
            self.mode, self.split = "cpu", 1.0
        elif mode == "split" and split is None:  # ... and here, an even share until then
            self.split = 0.5

    def age(self) -> int:
        """While fewer than LOW_WATER_SHARE of Warm's slots are free, move cached blocks
        nobody used for cold_threshold_ms to Cold (lz4 of their records, in host memory),
        least recently used first and as long as that pays, freeing their Warm slots;
        returns how many moved. Blocks of sequences in flight are held by them, so only
        cached prefixes age."""
        low = self.pool.capacity * LOW_WATER_SHARE
        if self.pool.num_free >= low:
            return 0
        moved = 0
        for key, slot in self.index.idle_since(time.monotonic() - self.cold.threshold_s):
            if self.pool.num_free >= low or not self._to_cold(key, slot):
                break
            self.index.drop(key)
            moved += 1
        return moved

    def _to_cold(self, key: bytes, slot: int) -> bool:
        """Copy a cached block's records into Cold if keeping it there pays (its recompute,
        priced from the measured prefill cost, against the measured lz4 time); whether it
        did. The caller drops the Warm entry."""
        if not self.cold_gate.pays(self._recompute_block_s()):
            return False
        start = time.perf_counter()
        self.cold.put(key, self.pool.record_view(slot).tobytes())
        self.cold_gate.kept_blocks(1, time.perf_counter() - start)
        self.stats.cold_blocks += 1
        return True

    def _recompute_block_s(self) -> float | None:
        """Seconds to compute one block's tokens again (at no context: the least it costs);
        None until prefill was measured."""
        st = self.step_times
        if st is None or st.per_unit is None:
            return None
        return st.per_unit * st.units(self.block_size, 0)

    def lookup(self, keys: Seq[bytes]) -> list[int]:
        """Warm slots of the longest cached prefix of this key chain (one reference each),
        promoting Cold blocks that continue it back into Warm (`last_promoted` of them)."""
        slots = self.index.lookup_keys(keys)
        start, warm = time.perf_counter(), len(slots)
        for key in keys[len(slots) :]:
            data = self.cold.take(key) if self.room(1) else None
            if data is None:
                break
            slot = self.index.alloc(1)[0]
            self.pool.store_raw(slot, data)
            slots.append(slot)
            self.index.insert_keys(keys[: len(slots)], slots)
            self.stats.promoted_blocks += 1
        self.last_promoted = len(slots) - warm
        self.cold_gate.returned_blocks(self.last_promoted, time.perf_counter() - start)
        return slots

    def cpu_partial(
        self, layer: int, q: Tensor, spans: list[WarmSpan], scale: float
    ) -> tuple[Tensor, Tensor]:
        """warm_decode_attention, by the CPU daemon when linked; here when not, or when it
        does not answer (the link is then dropped: a dead CPU daemon restarts the pair)."""
        if self.remote is not None:
            try:
                return self.remote.partial(layer, q, spans, scale, stats=self.stats.cpu)
            except WarmLinkDown as exc:
                log.warning("attn_warm_link_down", reason=str(exc))
                self.remote = None
        return warm_decode_attention(self.pool, layer, q, spans, scale, stats=self.stats.cpu)

    def cpu_blocks(self, n: int) -> int:
        """Of a sequence's n Warm blocks, how many the CPU attends (the first ones)."""
        if self.mode == "cpu":
            return n
        return 0 if self.mode == "gpu" else round(self.split * n)

    def room(self, n: int) -> int:
        """How many of `n` slots a store can take now: free ones, then those only the prefix
        index holds (counted only when the free ones fall short: that is a scan)."""
        free = self.pool.num_free
        return n if free >= n else min(n, free + self.index.evictable())

    def info(self) -> dict[str, float | int]:
        """The tier's figures, keyed by GetModelInfo field names."""
        st = self.stats
        return {
            "warm_blocks_total": self.pool.capacity,
            "warm_blocks_used": self.pool.capacity - self.pool.num_free,
            "hot_hit_rate": st.hot_hit_rate,
            "warm_decompress_p50_ms": st.decompress_percentile(50),
            "warm_decompress_p95_ms": st.decompress_percentile(95),
            "cpu_attention_ms": st.cpu.attn_s * 1e3,
            "pcie_h2d_bytes": st.h2d_bytes,
            "pcie_d2h_bytes": st.d2h_bytes,
            "cold_blocks": len(self.cold),
        }

    def store(self, kv_caches: Seq[ops.KvCache], blocks: Seq[int]) -> list[int]:
        """Copy Hot blocks (every layer) into fresh Warm slots, STORE_CHUNK blocks per encode
        and copy (a quantized Hot cache's blocks as they are); the caller frees the blocks."""
        slots = self.index.alloc(len(blocks))
        try:
            self._store_into(kv_caches, blocks, slots)
        except BaseException:
            self.pool.free(slots)  # a failed copy (a device allocation) leaks no Warm slot
            raise
        return slots

    def _store_into(self, kv_caches: Seq[ops.KvCache], blocks: Seq[int], slots: Seq[int]) -> None:
        for lo in range(0, len(blocks), STORE_CHUNK):
            index = torch.tensor(blocks[lo : lo + STORE_CHUNK], device=self.device)
            if self.hot_quantized:
                records = torch.stack([self._hot_records(kv, index) for kv in kv_caches], 1)
                self.pool.store_records(slots[lo : lo + STORE_CHUNK], records)
                self.stats.d2h_bytes += records.numel()
                continue
            k = torch.stack([_native(kv)[0][index] for kv in kv_caches], 1)  # [n, L, S, H, D]
            v = torch.stack([_native(kv)[1][index] for kv in kv_caches], 1)
            crossed = self.pool.slot_bytes * len(index)
            if self.codec_on == "cpu":
                k, v = k.cpu(), v.cpu()
                crossed = 2 * k.numel() * k.element_size()
            self.pool.store_many(slots[lo : lo + STORE_CHUNK], k, v)
            self.stats.d2h_bytes += crossed

    def load(self, kv_caches: Seq[ops.KvCache], slots: Seq[int], blocks: Seq[int]) -> None:
        """Decode Warm `slots` (every layer) into the Hot `blocks`, in order, read in place
        where the pool has a device view; the caller frees the slots. Lossless codecs, and a
        quantized Hot cache's records, give back the very bytes that were stored."""
        index = torch.tensor(list(blocks), dtype=torch.long, device=self.device)
        view = self.view
        slot_index = None if view is None else view.slot_index(list(slots))
        for layer, kv in enumerate(kv_caches):
            if self.hot_quantized:  # int8 / int4 records: always a paged layout, so a view
                assert view is not None and slot_index is not None
                records = view.records(layer, slot_index)  # in place, over PCIe on CUDA
                self.stats.h2d_bytes += records.numel()
                for field, part in zip(
                    _hot_fields(kv, self._layout), self._layout.unpack(records), strict=True
                ):
                    field[index] = part
                continue
            k_cache, v_cache = _native(kv)
            k, v = self.dense(slots, layer, k_cache.dtype, slot_index)
            k_cache[index] = k.view(len(blocks), *k_cache.shape[1:])
            v_cache[index] = v.view(len(blocks), *v_cache.shape[1:])
        self.stats.loaded_blocks += len(blocks)

    def free(self, slots: Seq[int]) -> None:
        self.pool.free(slots)

    def close(self) -> None:
        if self.view is not None:
            self.view.close()
            self.view = None
        self.pool.close()
        self.pool.unlink()

    @property
    def _layout(self) -> RecordLayout:
        return self.pool.codec.layout  # type: ignore[attr-defined, no-any-return]

    def _hot_records(self, kv: ops.KvCache, index: Tensor) -> Tensor:
        """Blocks `index` of one layer of a quantized Hot cache -> records [n, record_bytes]."""
        return self._layout.pack([field[index] for field in _hot_fields(kv, self._layout)])

    def _records(self, slots: Seq[int], layer: int) -> Tensor:
        """The compressed records of `slots` at `layer`, copied out of shm (to the device when
        the codec runs there)."""
        rows = torch.from_numpy(np.stack([self.pool.record_view(s)[layer] for s in slots]))
        if self.codec_on == "cpu":
            return rows
        self.stats.h2d_bytes += rows.numel()
        return upload(rows, self.device)

    def device_partial(
        self,
        layer: int,
        q: Tensor,
        slots: list[list[int]],
        scale: float,
        table: tuple[Tensor, Tensor] | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Mode (b): q [n, Hq, D] over each row's Warm `slots` (at least one each), on the
        device -> out [n, Hq, D], lse [n, Hq] fp32. In place over PCIe where the codec allows
        (warm_device; `table`: the view's block_table of `slots`, if at hand), else decoded
        on the device from a copy of the records."""
        if self.view is not None:
            self.stats.h2d_bytes += sum(map(len, slots)) * self.pool.record_bytes
            return self.view.attend(layer, q, slots if table is None else table, scale)
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
        for i, row in enumerate(slots):
            k, v = self.dense(row, layer, torch.float32)
            qs = q[i].float().mul(scale).view(k.shape[1], -1, k.shape[2])
            o, s = dense_partial(qs, k, v)
            out[i], lse[i] = o.reshape(out.shape[1:]), s.reshape(lse.shape[1:])
        return out, lse

    def dense(
        self, slots: Seq[int], layer: int, dtype: torch.dtype, index: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """`slots` at `layer` decoded on the device -> k, v [len(slots) * S, Hkv, D] in `dtype`:
        read in place from the pool where the codec has a paged layout (warm_device; `index`:
        its slot_index of `slots`, if at hand), else decoded from a copy of the records."""
        t0 = time.perf_counter()
        if self.view is not None and self.codec_on == "gpu":
            self.stats.h2d_bytes += len(slots) * self.pool.record_bytes  # read over PCIe
            k, v = self.view.gather(layer, list(slots) if index is None else index, dtype)
            if self.device.type != "cuda":  # on CUDA the decoding is the device's, not timed
                self.stats.record_decompress(time.perf_counter() - t0)
            return k, v
        k, v = self.pool.codec.decode_blocks(self._records(slots, layer), dtype)
        self.stats.record_decompress(time.perf_counter() - t0)
        if self.codec_on == "cpu":  # decoded here: the dense keys cross
            self.stats.h2d_bytes += 2 * k.numel() * k.element_size()
            k, v = upload(k, self.device), upload(v, self.device)
        return k.flatten(0, 1), v.flatten(0, 1)

    def context(
        self, warm_slots: list[list[int]], positions: list[int], rows: int = 1
    ) -> WarmContext | None:
        """What the model needs this step (each sequence's Warm slots and last query
        position; `rows` decode rows per sequence); None when no sequence has Warm blocks."""
        if not any(warm_slots):
            return None
        return WarmContext(self, warm_slots, positions, rows)


def _hot_fields(kv: ops.KvCache, layout: RecordLayout) -> list[Tensor]:
    """A quantized Hot cache's tensors in the order of the Warm records' fields."""
    if not isinstance(kv, QuantKvCache):
        raise ValueError("a native Hot cache has no record fields")
    by_name = {
        "k_codes": kv.k,
        "v_codes": kv.v,
        "k_scale": kv.k_scale,
        "v_scale": kv.v_scale,
        "k_zero": kv.k_zero,
        "v_zero": kv.v_zero,
    }
    return [t for t in (by_name[f.name] for f in layout.fields) if t is not None]


def _native(kv: ops.KvCache) -> tuple[Tensor, Tensor]:
    if not isinstance(kv, tuple):
        raise ValueError("the Warm tier needs kv_cache.hot_codec: native")
    return kv


def warm_codec_for(spec: ModelSpec, codec: str, block_size: int, hot_codec: str) -> Codec:
    """The Warm records' codec. Beside an int8 / int4 Hot cache it must be the Hot codec, whose
    blocks then move as they are (int4 with its keys grouped per token, as Hot groups them)
    instead of being quantized a second time."""
    if hot_codec != "native" and codec != hot_codec:
        raise ValueError(
            f"kv_cache.warm_codec={codec!r}: an {hot_codec} Hot cache moves its blocks to "
            f"Warm as they are; use warm_codec: {hot_codec}"
        )
    options: dict[str, Any] = {"per_token_keys": True} if hot_codec == "int4" else {}
    return get_codec(codec, block_size, spec.num_kv_heads, spec.head_dim, spec.dtype, **options)


def warm_mb_for(
    spec: ModelSpec, codec: str, block_size: int, tokens: int, hot_codec: str = "native"
) -> float:
    """MiB of Warm pool that holds `tokens` tokens of every layer in `codec` (beside a
    `hot_codec` Hot cache), plus headroom."""
    c = warm_codec_for(spec, codec, block_size, hot_codec)
    slots = -(-tokens // block_size) + 2
    return slots * slot_bytes_for(c, spec.num_layers) / 2**20 + 1.0
