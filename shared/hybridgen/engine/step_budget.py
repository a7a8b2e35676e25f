"""Decode-first steps: a step that carries decodes stays under a latency target (where its
decodes alone overrun it, the prefill may take a share of the overrun: OVERRUN_SHARE).

Every decoding sequence streams one token per step, so a step's length is the gap its
readers see. A prefill chunk riding along makes that step longer in proportion to its work,
so when a step has decodes, the prefill it may carry is sized from measured step times
(as Sarathi-Serve's stall-free batching and vLLM's chunked prefill bound it by a token
budget, here by time). A step with no decodes takes the whole max_num_batched_tokens.

The cost model, fitted while serving:

    decode-only step  = decode(B)
    prefill-only step = max(launch, per_unit * sum over chunks of units(n, c))
    mixed step        = max(launch, mixed(B) + per_unit * sum over chunks of units(n, c))
    units(n, c)       = n * (1 + key_weight * (c + n / 2))

decode(B) is the measured time of a decode-only step of B rows (an average per power-of-two
bucket of B), per_unit that of prefill; n tokens of a chunk after c cached keys cost their
dense work plus attention over c + n/2 keys each on average, key_weight being one key's
attention flops against one token's dense flops (from the model's shape). mixed(B) is what a
step with B decodes costs beside its prefill, by bucket of B (a bucket not yet measured
takes decode(B)): where a step runs as it is called (a CPU; a MoE model, whose layers read
their expert picks back) its decodes' eager run costs more than their graphed decode-only
step, and that fixed cost is its own.

launch is the host time to queue one eager forward pass (every layer's kernels, the
sampler) on a device that runs behind the host, a floor under any step with prefill: on the
H100 ~20-30 ms for llama3-8b, against a 7 ms graphed decode step. A step whose device work
ends right after its launch returns was held by the host, so its time bounds its prefill's
cost from above and teaches nothing more; the prefill that fits under that floor is free,
so the room a step with decodes has is max(target, launch) - mixed(B). (Without the floor,
steps of 8 decodes and 16 prompt tokens took 30 ms, and 64 prompts of 512 waited 7 s for
their first tokens.)

Where a step that carries prefill pays a large cost whatever its size (a MoE model's first
touch of nearly every expert: B4c's steps with a 16-token chunk took 330 ms beside 14 ms
decodes), a prefill-only step's time over its units is its average cost, not what one more
token costs, and prefill beside decodes crept in small chunks (four 256-token prompts at
once: TTFT p50 2.9 s, p99 4.6 s on the H100). So once steps of one kind (the same bucket of
decode rows, or none) carried prefill whose units differ SPREAD-fold, per_unit is the slope
of their time against their units (a line per kind, one slope), where that is below the
average: the fixed part falls to mixed(B).

per_unit's average and mixed(B) are the low medians of their last WINDOW samples, launch
the least of its last WINDOW (noise only adds to a launch): a step that compiles a kernel
the first time (up to 1.7 s on the H100) must not set the budget for the bursts after it,
and prefill-only steps come once a burst (an average they entered first held B2's prefill
to MIN_TOKENS a step at 12x the true cost per token). A figure given at construction stands
until the first measurement replaces it.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field

from hybridgen.models.spec import ModelSpec

EMA = 0.2
"""Weight of a new measurement in the running average of decode-only steps."""
WINDOW = 5
"""Samples kept for each figure (module doc): one spike never sets it, and a real change takes
over after three samples (a launch's, at once if shorter)."""
HOST_BOUND = 0.25
"""A step whose device work ended within this share of its time after its launch returned
was held by the host (module doc)."""
MIN_TOKENS = 16
"""Prefill tokens a step with decodes may always carry, so that prompts keep moving."""
OVERRUN_SHARE = 1.0
"""Where a step's decodes alone overrun the target (a CPU's step of many rows: ~100 ms on a
2-core machine against 25), the target cannot be met, and holding prefill to MIN_TOKENS a
step only starves arrivals (64 streams at once: 27.3 s there, 11.6 s with this, 12.3 with no
limit; served SmolLM2, 8 tokens each): the
prefill beside them may then take this share of the overrun (0: MIN_TOKENS, as before)."""


SPREAD = 2.0
"""Least ratio of the largest prefill to the smallest, among one kind's recent steps, for
their slope to be a per-unit cost (module doc)."""
SLOPE_FLOOR = 0.01
"""A slope is taken down to this share of the average per unit (noise can make it zero)."""


def key_weight(spec: ModelSpec) -> float:
    """Attention flops of one query token over one key, against one token's dense flops."""
    h = spec.hidden_size
    experts = spec.num_experts_per_tok or 1
    dense = (
        h * (spec.q_size + 2 * spec.kv_size)
        + spec.q_size * h
        + 3 * h * (spec.expert_size * experts + spec.shared_expert_intermediate_size)
    )
    return 2 * spec.q_size / dense


class _Window:
    """The last WINDOW samples of a figure."""

    def __init__(self) -> None:
        self.samples: deque[float] = deque(maxlen=WINDOW)

    def median(self, value: float) -> float:
        """With `value`, the low median (of two, the lower: the first step of a kind may
        have compiled a kernel)."""
        self.samples.append(value)
        return statistics.median_low(self.samples)

    def least(self, value: float) -> float:
        """With `value`, the least."""
        self.samples.append(value)
        return min(self.samples)


@dataclass
class StepBudget:
    """The prefill a step with decodes may carry to stay under `target_s` (module doc)."""

    target_s: float
    """Longest a step with decodes should take (model.step_latency_ms)."""
    key_weight: float
    """One key's attention cost against one token's dense work (key_weight(spec))."""
    per_unit: float | None = None
    """Measured seconds per cost unit of prefill; None until prefill was measured."""
    decode: dict[int, float] = field(default_factory=dict)
    """Measured seconds of a decode-only step, by power-of-two bucket of its rows."""
    mixed: dict[int, float] = field(default_factory=dict)
    """Measured seconds of a step with decodes and prefill beyond its prefill's cost, by
    power-of-two bucket of its decode rows."""
    launch: float | None = None
    """Measured host seconds to queue an eager forward pass (the least of the last WINDOW,
    from the second on); None until measured, and where steps run as they are called."""
    average: float | None = field(default=None, init=False)
    """The low median of prefill-only steps' seconds per unit (per_unit where no slope is
    known, and its ceiling)."""
    _per_unit: _Window = field(default_factory=_Window, init=False, repr=False)
    _lines: dict[int, deque[tuple[float, float]]] = field(
        default_factory=dict, init=False, repr=False
    )
    _mixed: dict[int, _Window] = field(default_factory=dict, init=False, repr=False)
    _launch: _Window = field(default_factory=_Window, init=False, repr=False)

    def units(self, tokens: int, context: int) -> float:
        """Cost of a prefill chunk of `tokens` after `context` cached keys."""
        return tokens * (1.0 + self.key_weight * (context + tokens / 2))

    def tokens_for(self, units: float, context: int) -> int:
        """Most tokens of a chunk after `context` keys whose cost stays within `units`."""
        if units <= 0:
            return 0
        a, b = self.key_weight / 2, 1.0 + self.key_weight * context
        if a == 0:
            return int(units / b)
        return int((-b + math.sqrt(b * b + 4 * a * units)) / (2 * a))

    def allowance(self, decode_rows: int) -> float | None:
        """Cost units of prefill a step with `decode_rows` decodes may carry; None: no limit
        (no decodes, or nothing measured yet)."""
        if not decode_rows or self.per_unit is None:
            return None
        room = max(self.target_s, self.launch or 0.0) - self.mixed_s(decode_rows)  # < 0: overrun
        return max(room, -OVERRUN_SHARE * room) / self.per_unit

    def observe(
        self,
        decode_rows: int,
        chunks: list[tuple[int, int]],
        seconds: float,
        launch_s: float | None = None,
    ) -> None:
        """A measured step: its decode rows, its prefill chunks (tokens, cached keys), and
        for an eager forward on a device that runs behind the host, the host seconds its
        launch took (None: the step ran as it was called)."""
        if not chunks:
            if decode_rows:
                bucket = _bucket(decode_rows)
                self.decode[bucket] = _ema(self.decode.get(bucket), seconds)
            return
        units = sum(self.units(n, c) for n, c in chunks)
        host_bound = launch_s is not None and seconds - launch_s < HOST_BOUND * seconds
        if launch_s is not None:  # a floor once two launches were seen (one may compile)
            floor = self._launch.least(launch_s)
            self.launch = floor if len(self._launch.samples) > 1 else None
        if not host_bound:
            kind = _bucket(decode_rows) if decode_rows else 0
            line = self._lines.setdefault(kind, deque(maxlen=WINDOW))
            line.append((units, seconds - self._decode_s(decode_rows)))
        if not decode_rows or self.per_unit is None:
            # Prefill alone; or, with nothing else to go by, a mixed step's time beyond its
            # decodes (a noisy decode figure never makes the prefill free: at least a quarter).
            per = max(seconds - self._decode_s(decode_rows), seconds / 4) / units
            if host_bound:  # the prefill cost at most this: a bound on a figure, not one
                if self.per_unit is None:
                    return
                per = min(per, self.average or self.per_unit)
            self.average = self._per_unit.median(per)
            self.per_unit = self._marginal(self.average)
            return
        self.per_unit = self._marginal(self.average or self.per_unit)
        bucket = _bucket(decode_rows)
        fixed = max(seconds - self.per_unit * units, 0.0)
        if host_bound:
            fixed = min(fixed, self.mixed_s(decode_rows))
        self.mixed[bucket] = self._mixed.setdefault(bucket, _Window()).median(fixed)

    def _marginal(self, average: float) -> float:
        """`average`, or where it is higher, the slope of recent prefill steps' time against
        their units, fitted with one intercept per kind of step (module doc)."""
        sxx = sxy = 0.0
        spread = False
        for line in self._lines.values():
            if len(line) < 2:
                continue
            xs = [u for u, _ in line]
            spread = spread or max(xs) >= SPREAD * min(xs)
            mx, my = statistics.fmean(xs), statistics.fmean(t for _, t in line)
            sxx += sum((u - mx) ** 2 for u in xs)
            sxy += sum((u - mx) * (t - my) for u, t in line)
        if not spread or sxx <= 0:
            return average
        return min(average, max(sxy / sxx, SLOPE_FLOOR * average))

    def mixed_s(self, rows: int) -> float:
        """The part of a step with `rows` decodes and some prefill that is not the prefill's:
        its bucket's measured mixed time, else a decode-only step's."""
        measured = self.mixed.get(_bucket(rows)) if rows else None
        return self._decode_s(rows) if measured is None else measured

    def decode_step_s(self, rows: int) -> float | None:
        """A measured decode-only step of `rows` rows (its bucket's, else the nearest
        bucket's); None before any was measured."""
        return self._decode_s(rows) if self.decode else None

    def _decode_s(self, rows: int) -> float:
        """A decode-only step of `rows` rows: its bucket's time, else the nearest measured."""
        if not rows or not self.decode:
            return 0.0
        bucket = _bucket(rows)
        near = min(self.decode, key=lambda b: abs(math.log2(b) - math.log2(bucket)))
        return self.decode[near]


def _ema(old: float | None, new: float) -> float:
    return new if old is None else old + EMA * (new - old)


def _bucket(rows: int) -> int:
    return 1 << max(rows - 1, 0).bit_length()
