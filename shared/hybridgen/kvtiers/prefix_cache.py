"""Host memory as a prefix cache across conversations: when keeping a block in a lower tier
pays, and what the prefix cache served from each tier.

A finished sequence's full Hot blocks are written back to Warm (WarmOffload.keep), and Warm
blocks evicted for room go on to Cold (lz4, WarmTier), so the next turn of any conversation,
and a shared system prompt, is loaded instead of computed again beyond what Hot holds. Each
of those copies costs time in the step loop (a device -> host copy, an lz4 pass), which pays
only when enough of the kept blocks come back. `KeepGate` decides from measurements: the
time a block's copy took, the time a block takes to compute (the step budget's prefill cost),
and the share of candidate blocks that a later request took back, or would have taken back
had they been kept. A workload of distinct prompts thus stops paying for copies nobody reads,
and a chat workload keeps them.

The second half of that share matters when a load grows: while Hot holds every history, no
kept block comes back from Warm and the gate shuts; when the histories outgrow Hot, only
blocks it declined to keep are missing. Those it remembers (by prefix hash, DECLINED_KEYS of
them), and a later request whose prefix runs on into them counts them as blocks that would
have come back: they are computed again, and they reopen the gate.
"""

from __future__ import annotations

import statistics
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

PRIOR_BLOCKS = 64.0
"""The gate starts as if this many blocks had been kept and all of them had come back: it
keeps until measurements say otherwise (where a copy costs 2 % of a recompute, it stops
after some 3,200 kept blocks that nobody took back: a few long prompts)."""
HALF_LIFE_BLOCKS = 8192.0
"""Kept and returned counts halve every this many kept blocks, so the share follows a
workload that changes."""
EXPLORE_EVERY = 8
"""While the gate is shut, every this-many-th candidate is kept anyway, so that a workload
that starts reusing is seen."""
COST_SAMPLES = 9
"""The gate's costs are the median of this many latest timings: a copy slowed by a page
fault or a preemption (the first writes into fresh pool memory, a loaded host) must not shut
the gate, as one such timing did when the costs were running averages."""
MIN_SAMPLES = 3
"""Until this many copies are timed, the gate keeps (one timing has no median)."""
DECLINED_KEYS = 1 << 16
"""Prefix hashes of declined blocks remembered (the latest; ~6 MB): a million tokens at
16-token blocks, more than a Warm tier of 32 GB holds of llama3-8b."""


class KeepGate:
    """Whether copying blocks into a lower tier pays (module doc): it does while

        returned / offered * (recompute - back) > keep

    per block, `keep` and `back` being the measured seconds to copy a block in and back out,
    `recompute` the seconds to compute it again, and returned / offered the decayed share of
    candidate blocks (kept or declined) that were taken back or would have been."""

    def __init__(self) -> None:
        self.offered = PRIOR_BLOCKS
        """Candidate blocks, kept or declined (decayed)."""
        self.returned = PRIOR_BLOCKS
        """Blocks taken back from the tier, or declined ones a request would have taken
        back (decayed the same way)."""
        self.recomputed = 0
        """Declined blocks that a request would have taken back: computed again."""
        self._declined: OrderedDict[bytes, None] = OrderedDict()
        """Prefix hashes of the latest declined blocks (DECLINED_KEYS)."""
        self._keep: deque[float] = deque(maxlen=COST_SAMPLES)
        """Seconds a block took to copy into the tier, latest copies."""
        self._back: deque[float] = deque(maxlen=COST_SAMPLES)
        """Seconds a block took to come back, latest timed returns."""
        self.shut = 0
        """Candidates not kept because it did not pay."""
        self._asked = 0

    @property
    def share(self) -> float:
        """Candidate blocks that came back or would have, as a share (decayed)."""
        return min(self.returned / self.offered, 1.0)

    @property
    def keep_s(self) -> float | None:
        """Seconds to copy one block into the tier (COST_SAMPLES; None: fewer than
        MIN_SAMPLES copies timed)."""
        return _median(self._keep)

    @property
    def back_s(self) -> float | None:
        """Seconds to bring one block back (as keep_s; None: the copy in stands for it)."""
        return _median(self._back)

    def pays(self, recompute_s: float | None) -> bool:
        """Whether to keep a candidate whose blocks take `recompute_s` each to compute (None:
        not measured yet: keep)."""
        keep = self.keep_s
        if recompute_s is None or keep is None:
            return True
        back = self.back_s
        if self.share * (recompute_s - (keep if back is None else back)) > keep:
            return True
        self._asked += 1
        if self._asked % EXPLORE_EVERY == 0:
            return True
        self.shut += 1
        return False

    def kept_blocks(self, n: int, seconds: float) -> None:
        """`n` blocks were copied into the tier in `seconds`."""
        if n <= 0:
            return
        self._offer(n)
        self._keep.append(seconds / n)

    def declined(self, keys: Sequence[bytes]) -> None:
        """A candidate's blocks, by prefix hash, were not kept (pays said no)."""
        self._offer(len(keys))
        for key in keys:
            self._declined[key] = None
            self._declined.move_to_end(key)
        while len(self._declined) > DECLINED_KEYS:
            self._declined.popitem(last=False)

    def missed(self, keys: Sequence[bytes]) -> int:
        """A request's prefix hashes beyond what every tier holds, in order: those of a
        declined candidate, from the first on, would have come back; they count as returned
        (once) and are returned here."""
        n = 0
        for key in keys:
            if key not in self._declined:
                break
            del self._declined[key]
            n += 1
        self.returned += n
        self.recomputed += n
        return n

    def _offer(self, n: int) -> None:
        decay = 0.5 ** (n / HALF_LIFE_BLOCKS)
        self.offered = self.offered * decay + n
        self.returned *= decay

    def returned_blocks(self, n: int, seconds: float | None = None) -> None:
        """`n` kept blocks were taken back (in `seconds`, when timed)."""
        if n <= 0:
            return
        self.returned += n
        if seconds is not None:
            self._back.append(seconds / n)


def _median(timings: deque[float]) -> float | None:
    return statistics.median(timings) if len(timings) >= MIN_SAMPLES else None


@dataclass
class PrefixHits:
    """What the prefix cache served since start, by tier: requests that took blocks from a
    tier at their first admission, and the prompt tokens those blocks held (not computed)."""

    hot_hits: int = 0
    warm_hits: int = 0
    cold_hits: int = 0
    hot_tokens: int = 0
    warm_tokens: int = 0
    cold_tokens: int = 0

    def add(self, hot: int, warm: int, cold: int, block_size: int) -> None:
        """One admission's prefix: `hot`, `warm` and `cold` blocks from each tier."""
        self.hot_hits += hot > 0
        self.warm_hits += warm > 0
        self.cold_hits += cold > 0
        self.hot_tokens += hot * block_size
        self.warm_tokens += warm * block_size
        self.cold_tokens += cold * block_size

    def info(self) -> dict[str, int]:
        """The counters, keyed by GetModelInfo field names."""
        return {f"prefix_{k}": v for k, v in vars(self).items()}
