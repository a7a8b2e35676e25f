"""Cold-Weights: MoE expert weights in host memory and a cache of them on the device;
the latency model that decides, per step and routed expert, where that expert runs is
expert_latency.py.

DESIGN.md "Shared memory" (Cold-Weights) and "Op-Regions" (moe_experts). Attention, norms,
embeddings and the router stay on the device; only the experts move:

    host  ExpertStore (one per layer)   gate_up [E, 2I, H], down [E, H, I]   (pinned on CUDA),
                                        native, int8 or int4 (expert_format.py)
            |                    \\
            | fetch (H2D, LFU)     \\ x -> CPU, SwiGLU on the host, result -> device
            v                      v
    device ExpertCache (shared)      slots: gate_up [N, 2I, H], down [N, H, I], as stored

An uncached expert runs on the CPU when the latency model says the CPU's time for its
routed tokens beats a fetch plus a device call; a cached expert always runs on the device.
Both paths compute the same SwiGLU in the model dtype from the same stored weights
(`swiglu_packed`), so exact mode stays exact.
"""

from __future__ import annotations

import heapq
from collections.abc import Set
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch
from torch import Tensor

from hybridgen.experts.format import Alloc, Format, PackedMatrices, swiglu_packed

if TYPE_CHECKING:
    from hybridgen.experts.grouped import HitLaunches


SCRATCH_SHARE = 1 / 16
"""Most of an ExpertCache's slots kept as scratch slots (beyond one)."""


class RemoteDown(RuntimeError):
    """The CPU daemon did not take or answer an EXPERT_RUN request; compute locally."""


class RemoteExperts(Protocol):
    """The CPU daemon computing experts (cpu_daemon.expert_link.ExpertLinkClient)."""

    cpu_s: float
    """The CPU daemon's compute time over every answer."""
    answered_at: float
    """When the last answer was written (time.monotonic())."""

    def submit(self, layer: int, jobs: list[tuple[int, Tensor]]) -> int: ...

    def wait(self, seq: int, jobs: list[tuple[int, Tensor]]) -> list[Tensor]: ...


@dataclass
class MoeStats:
    """Cold-Weights counters since start, over every layer."""

    cache_hits: int = 0
    """Device computations whose expert was already in the cache."""
    cache_misses: int = 0
    """Fetches: an expert copied host -> device into a cache slot."""
    cpu_experts: int = 0
    """(layer, expert) computations on the CPU with the host weights."""
    cpu_daemon_experts: int = 0
    """Of those, the ones the CPU daemon computed (EXPERT_RUN) while the device worked."""
    gpu_experts: int = 0
    """(layer, expert) computations on the device from the cache (hits + misses)."""
    bytes_h2d: int = 0
    """Expert bytes copied host -> device."""
    routed: dict[tuple[int, int], int] = field(default_factory=dict)
    """Tokens routed to each (layer, expert)."""

    def count_routed(self, layer: int, experts: list[tuple[int, int]]) -> None:
        """One step of one layer: (expert, tokens routed to it)."""
        for expert, tokens in experts:
            key = (layer, expert)
            self.routed[key] = self.routed.get(key, 0) + tokens

    def top2_share(self) -> float:
        """Share of the routed tokens that went to each layer's two busiest experts, averaged
        over the layers (2 / num_experts when routing is even; 1.0 when two take all)."""
        layers: dict[int, list[int]] = {}
        for (layer, _), tokens in self.routed.items():
            layers.setdefault(layer, []).append(tokens)
        shares = [sum(sorted(c)[-2:]) / sum(c) for c in layers.values()]
        return sum(shares) / len(shares) if shares else 0.0

    def figures(self, steps: int) -> dict[str, float]:
        """The counters, the cache hit rate, experts per engine step on each device, and the
        busiest two experts' share of the routed tokens."""
        out: dict[str, float] = {k: v for k, v in vars(self).items() if k != "routed"}
        out["top2_share"] = self.top2_share()
        fetches = self.cache_hits + self.cache_misses
        out["cache_hit_rate"] = self.cache_hits / fetches if fetches else 0.0
        out["cpu_experts_per_step"] = self.cpu_experts / max(steps, 1)
        out["gpu_experts_per_step"] = self.gpu_experts / max(steps, 1)
        return out


class ExpertStore:
    """Every expert of one layer in host memory, in its stored format (expert_format.py).

    Invariant: the tensors never move to the device; the cache copies from them.
    """

    def __init__(self, gate_up: PackedMatrices, down: PackedMatrices) -> None:
        self.gate_up, self.down = gate_up, down  # [E, 2I, H], [E, H, I] as stored

    @classmethod
    def from_dense(cls, gate_up: Tensor, down: Tensor, fmt: Format, alloc: Alloc) -> ExpertStore:
        """gate_up [E, 2I, H], down [E, H, I] in the model dtype -> `fmt`, in tensors from
        `alloc` (pinned host memory, the shared expert arena)."""
        return cls(*(PackedMatrices.pack(w, fmt).moved(alloc) for w in (gate_up, down)))

    @property
    def fmt(self) -> Format:
        return self.gate_up.fmt

    @property
    def hidden_size(self) -> int:
        return int(next(iter(self.down.parts.values())).shape[1])

    @property
    def expert_bytes(self) -> int:
        """One expert's gate_up and down as stored: what a fetch copies."""
        return self.gate_up.matrix_bytes + self.down.matrix_bytes

    def convert(self, fmt: Format, alloc: Alloc) -> ExpertStore:
        """This native store in `fmt`, in tensors from `alloc`."""
        assert self.fmt == "native", "only native experts convert"
        return ExpertStore.from_dense(self.gate_up.parts["w"], self.down.parts["w"], fmt, alloc)

    def run_cpu(self, expert: int, x: Tensor) -> Tensor:
        """x: [N, H] on any device -> the expert's output [N, H] on x's device, computed on
        the CPU."""
        return swiglu_packed(x.to("cpu"), self.gate_up, self.down, expert).to(x.device)


class ExpertCache:
    """`slots` device slots shared by all layers, each holding one expert in the store's
    format. The experts routed to most often stay: a miss evicts the least often routed
    cached expert (the least recently used among equals) only when it is itself routed to
    more often; otherwise it is copied into a scratch slot, used once and displaces nothing.
    A step's misses go into one grouped launch with its hits (models/moe.py), each needing a
    slot of its own: `scratch_slots` of them (the model's top k, set by enable_cold_weights).
    LRU alone keeps nothing useful once a token's experts outnumber the slots: the layers come
    round in a cycle, so each layer's experts are evicted before the next token returns to
    them (B4 mixtral-8x22b, 64 slots and 112 experts a token: hit rate 0.2 %).

    Invariant: `_slots` maps (layer, expert) -> slot index, and slot s holds exactly that
    expert's weights; with 2 slots or more the last (up to `scratch_slots` and SCRATCH_SHARE
    of them) are the scratch slots, `scratch`, in no entry.
    `_used` holds each cached expert's last use (a clock that counts uses); `_victims` is a
    heap of (times routed, last use, key), possibly stale, with an entry for every cached key.
    """

    def __init__(
        self,
        slots: int,
        store: ExpertStore,
        device: torch.device,
        stats: MoeStats,
        scratch_slots: int = 1,
    ) -> None:
        if slots < 1:
            raise ValueError(f"expert_cache_slots={slots}; expected >= 1 (or None: no cache)")
        self.scratch_wanted = scratch_slots
        self.gate_up = store.gate_up.empty(slots, device)
        self.down = store.down.empty(slots, device)
        self.device = device
        self.capacity, self.stats = slots, stats
        self.scratch = self._scratch(slots)
        self.expert_bytes = store.expert_bytes
        self._slots: dict[tuple[int, int], int] = {}
        self._used: dict[tuple[int, int], int] = {}
        self._victims: list[tuple[int, int, tuple[int, int]]] = []
        self._clock = 0
        self.remote: RemoteExperts | None = None
        """Under the daemons: the CPU daemon computes the CPU's experts (set by the GPU
        daemon; dropped when it stops answering)."""
        self.hit_launches: HitLaunches | None = None
        """Steps whose pairs all hit, from static buffers (set by MoeDecodeGraphs)."""
        self._side = torch.cuda.Stream(device) if device.type == "cuda" else None
        """The stream of fetch_beside's side copies (CUDA)."""

    @property
    def nbytes(self) -> int:
        return self.capacity * self.expert_bytes

    def resize(self, slots: int) -> None:
        """Reallocate with `slots` empty slots (cold_weights.expert_cache_slots: auto, once the
        budget's split is known); what was cached is dropped."""
        self.side_copies_done()  # none may still write the old slots
        device = self.device
        self.gate_up = self.gate_up.empty(0, device)  # free the old slots first
        self.down = self.down.empty(0, device)
        self.gate_up, self.down = self.gate_up.empty(slots, device), self.down.empty(slots, device)
        self.capacity = slots
        self.scratch = self._scratch(slots)
        self._slots.clear()
        self.hit_launches = None  # they read the old slots
        self._used.clear()
        self._victims.clear()

    def _scratch(self, slots: int) -> tuple[int, ...]:
        """The last slots, up to `scratch_wanted` of them and SCRATCH_SHARE of the cache (at
        least one: none when the cache has a single slot)."""
        n = min(self.scratch_wanted, max(int(slots * SCRATCH_SHARE), 1)) if slots >= 2 else 0
        return tuple(range(slots - n, slots))

    def __contains__(self, key: tuple[int, int]) -> bool:
        return key in self._slots

    def fetch(self, layer: int, expert: int, store: ExpertStore) -> int:
        """The slot holding `expert` of `layer`, copied in from `store` on a miss (into the
        first scratch slot when it is routed to no more often than every cached expert)."""
        slot = self.fetch_beside(layer, expert, store, frozenset())
        assert slot is not None  # nothing kept: every slot may be taken
        return slot

    def fetch_beside(
        self, layer: int, expert: int, store: ExpertStore, keep: Set[int], side: bool = False
    ) -> int | None:
        """fetch() for a step that reads the slots in `keep` in one launch still to come: a miss
        takes no slot of `keep` (neither the least routed expert's nor the scratch slot), and
        gets None when it would need one; the caller then runs it after that launch. With
        `side`, a miss is copied on a side stream (CUDA), after the work queued so far, so that
        the device computes what is cached meanwhile: the caller calls side_copies_done()
        before anything reads the slot."""
        key = (layer, expert)
        slot = self._slots.get(key)
        if slot is not None:
            self._use(key)
            self.stats.cache_hits += 1
            return slot
        admit = True
        if len(self._slots) < self.capacity - len(self.scratch):
            slot = len(self._slots)
        else:
            uses = self.stats.routed.get
            least = self._pop_least_used(keep)
            victim = least[2] if least is not None else None
            if victim is not None and (not self.scratch or uses(key, 0) > uses(victim, 0)):
                slot = self._slots.pop(victim)
                del self._used[victim]
            else:
                if least is not None:
                    heapq.heappush(self._victims, least)
                free = [s for s in self.scratch if s not in keep]
                if not free:
                    return None
                slot, admit = free[0], False
        # After the work queued so far (a slot is overwritten only after the work that read it
        # was queued), so the copy may be asynchronous.
        if side and self._side is not None:
            self._side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._side):
                self._copy_in(slot, store, expert)
        else:
            self._copy_in(slot, store, expert)
        if admit:
            self._slots[key] = slot
            self._use(key)
            heapq.heappush(self._victims, (self.stats.routed.get(key, 0), self._clock, key))
        self.stats.cache_misses += 1
        self.stats.bytes_h2d += self.expert_bytes
        return slot

    def _copy_in(self, slot: int, store: ExpertStore, expert: int) -> None:
        non_blocking = self.device.type == "cuda"
        self.gate_up.copy_(slot, store.gate_up, expert, non_blocking)
        self.down.copy_(slot, store.down, expert, non_blocking)

    def side_copies_done(self) -> None:
        """The work queued from here on waits for fetch_beside's side copies."""
        if self._side is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._side)

    def _use(self, key: tuple[int, int]) -> None:
        self._clock += 1
        self._used[key] = self._clock

    def _pop_least_used(self, keep: Set[int]) -> tuple[int, int, tuple[int, int]] | None:
        """The heap entry of the cached expert routed to least often, the least recently used
        among equals, whose slot is not in `keep`, taken off `_victims` (None: every cached
        slot is kept); the caller evicts it or pushes it back. An entry's figures only grow
        after it was pushed, so a top whose figures are stale is pushed again with the current
        ones until the top is current: O(log slots) a miss where a scan of every slot took
        ~0.75 ms at 3,380 slots (B4c). Kept entries are set aside and pushed back."""
        uses = self.stats.routed.get
        aside: list[tuple[int, int, tuple[int, int]]] = []
        found: tuple[int, int, tuple[int, int]] | None = None
        while self._victims:
            _, _, key = top = self._victims[0]
            current = (uses(key, 0), self._used[key], key)
            if top != current:
                heapq.heapreplace(self._victims, current)
            elif self._slots[key] in keep:
                aside.append(heapq.heappop(self._victims))
            else:
                found = heapq.heappop(self._victims)
                break
        for entry in aside:
            heapq.heappush(self._victims, entry)
        return found

    def run(self, slot: int, x: Tensor) -> Tensor:
        """The expert in `slot` on x [N, H] (on the device)."""
        return swiglu_packed(x, self.gate_up, self.down, slot)
