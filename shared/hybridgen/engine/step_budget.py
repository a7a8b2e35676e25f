"""Decode-first steps: a step that carries decodes stays under a latency target (where its
decodes alone overrun it, the prefill may take a share of the overrun: OVERRUN_SHARE).

Every decoding sequence streams one token per step, so a step's length is the gap its
readers see. A prefill chunk riding along makes that step longer in proportion to its work,
so when a step has decodes, the prefill it may carry is sized from measured step times
(as Sarathi-Serve's stall-free batching and vLLM's chunked prefill bound it by a token
budget, here by time). A step with no decodes takes the whole max_num_batched_tokens.

The cost model, fitted while serving:

    decode-only step  = decode(B)
    prefill-only step = per_unit * sum over chunks of units(n, c)
    mixed step        = mixed(B) + per_unit * sum over chunks of units(n, c)
    units(n, c)       = n * (1 + key_weight * (c + n / 2))

decode(B) is the measured time of a decode-only step of B rows (an average per power-of-two
bucket of B), per_unit that of prefill alone (steps without decodes); n tokens of a chunk
after c cached keys cost their dense work plus attention over c + n/2 keys each on average,
key_weight being one key's attention flops against one token's dense flops (from the model's
shape). A step with decodes and prefill costs more than decode(B) beside its prefill (its
decodes run eagerly, not from CUDA graphs: launches whose host time can exceed the device's
work), so mixed(B), the measured time of such steps less their prefill, is its own average
per bucket of B; a bucket not yet measured takes decode(B). Until prefill was measured, a
step's prefill is not limited.

The extra cost is added, not multiplied: one factor over (decode + prefill) for every batch
size made small chunks look dear wherever that cost was large, and held a burst's prefill to
a few tokens a step once the burst before had pushed the factor to its cap (B2 on the H100:
TTFT p50 0.9 s in one run, 12 s in the next; bench/NOTES.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from hybridgen.models.spec import ModelSpec

EMA = 0.2
"""Weight of a new measurement in the running averages of decode and prefill cost."""
MIXED_EMA = 0.5
"""Weight of a new step in mixed(B): the prefill phase of a burst of arrivals is only some
tens of steps, and the batch grows through it, so each bucket must follow fast."""
MIN_TOKENS = 16
"""Prefill tokens a step with decodes may always carry, so that prompts keep moving."""
OVERRUN_SHARE = 1.0
"""Where a step's decodes alone overrun the target (a CPU's step of many rows: ~100 ms on a
2-core machine against 25), the target cannot be met, and holding prefill to MIN_TOKENS a
step only starves arrivals (64 streams at once: 27.3 s there, 11.6 s with this, 12.3 with no
limit; served SmolLM2, 8 tokens each): the
prefill beside them may then take this share of the overrun (0: MIN_TOKENS, as before)."""


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
        room = self.target_s - self.mixed_s(decode_rows)  # < 0: overrun
        return max(room, -OVERRUN_SHARE * room) / self.per_unit

    def observe(self, decode_rows: int, chunks: list[tuple[int, int]], seconds: float) -> None:
        """A measured step: its decode rows, its prefill chunks (tokens, cached keys)."""
        if not chunks:
            if decode_rows:
                bucket = _bucket(decode_rows)
                self.decode[bucket] = _ema(self.decode.get(bucket), seconds)
            return
        units = sum(self.units(n, c) for n, c in chunks)
        if not decode_rows or self.per_unit is None:
            # Prefill alone; or, with nothing else to go by, a mixed step's time beyond its
            # decodes (a noisy decode figure never makes the prefill free: at least a quarter).
            per = max(seconds - self._decode_s(decode_rows), seconds / 4) / units
            self.per_unit = _ema(self.per_unit, per)
            return
        bucket = _bucket(decode_rows)
        fixed = max(seconds - self.per_unit * units, 0.0)
        self.mixed[bucket] = _ema(self.mixed.get(bucket), fixed, MIXED_EMA)

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


def _ema(old: float | None, new: float, weight: float = EMA) -> float:
    return new if old is None else old + weight * (new - old)


def _bucket(rows: int) -> int:
    return 1 << max(rows - 1, 0).bit_length()
