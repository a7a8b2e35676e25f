"""The spill/wait decision: what the scheduler does when the first waiting sequence cannot fit
Hot beside the running ones (kv_cache.spill_policy).

The options, each predicted from measured costs:

    wait   first come, first served: it starts when enough running sequences have finished
    swap   the newest running sequences that have more tokens left than it are preempted to
           Warm (their KV copied, loaded back when room returns); it runs now
    turns  with hot_turn_tokens set: the running ones swap out at the end of their turn, and
           it takes turns with them (the operator asked for that fairness, so turns stand in
           for both waiting and swapping)
    spill  it runs now, and the oldest Hot blocks of the sequences holding the most move to
           Warm; every decode step then reads them over PCIe (or the CPU attends them)

`auto` (the default) picks the option with the smallest predicted sum of completion times
of the requests it affects: the running ones and the candidate. The requests queued behind
the candidate wait for room in every option (FCFS), so they do not change the choice.
`always` is the rule before measurement (spill only a sequence too long for Hot alone, or
into an idle engine); `never` never spills (pure_gpu's behaviour: a sequence too long for
Hot alone is refused at validation, as the memory plan then sizes max_model_len to Hot).

The prediction, with T the decode step time of the batch with the candidate in it, P the
candidate's prefill time, r_i the tokens each has left, M one block's move Hot <-> Warm, and
R and W a Warm read's cost per step (fixed, and per block):

    wait:  the k shortest running ones finish first, until their blocks let the candidate's
           full length in: it starts at t = r_(k) T and ends at t + P + r_c T; the others end
           at r_i T, plus P for each still running when it prefills
    swap:  victims V (newer, with more left than the candidate) go out now (M per Hot block),
           come back after it (M per block again): the candidate ends at M_V + P + r_c T,
           each victim at M_V + P + r_c T + M h_v + r_v T, the others at M_V + P + r_i T
    turns: like swap, each victim sharing Hot with it in turns of `turn` tokens, with a
           load of its blocks at every switch
    spill: S = the blocks their full lengths overflow Hot by, moved once (S M); every step of
           everyone costs T + R + S W from then on

The inputs are measured: T from the decode-only steps (engine/step_budget.py), P from
its prefill cost per unit, W from the start-up probe of attn_warm over Warm blocks (per
block, all layers, in its placement), R from the decode steps that read Warm (what a step
holding Warm pays beyond its blocks: no CUDA graph, the merge), M from the stores to Warm
(a probe at start, then every store). Until T and P are measured, `auto` decides as `always`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from hybridgen.engine.sequence import Sequence
from hybridgen.engine.step_budget import StepBudget

Choice = Literal["wait", "swap", "turns", "spill"]
CHOICES: tuple[Choice, ...] = ("wait", "swap", "turns", "spill")
POLICIES = ("auto", "always", "never")
MEASURE_EMA = 0.2
"""Weight of a new measurement in the running averages of R and M."""


@dataclass(frozen=True)
class Job:
    """A sequence as the decision sees it."""

    remaining: int
    """Tokens it has still to generate (its max_tokens bound)."""
    hot_blocks: int
    """Hot blocks it holds now (the candidate: of its cached prefix)."""
    final_blocks: int
    """Hot blocks it holds at its full length."""
    turn_ran: int = 0
    """Tokens it generated since its turn in Hot began (time slicing)."""


@dataclass(frozen=True)
class Costs:
    """The measured costs one decision uses, in seconds."""

    decode_step_s: float
    """T: one decode step of the batch with the candidate in it, from Hot alone."""
    prefill_s: float
    """P: the candidate's prefill."""
    warm_step_s: float
    """R: what a decode step holding Warm blocks pays beyond reading them."""
    warm_block_s: float
    """W: reading one Warm block (all layers) in one decode step."""
    move_block_s: float
    """M: one block moved Hot -> Warm, or back."""


@dataclass(frozen=True)
class Decision:
    """One decision and why."""

    choice: Choice
    predicted: dict[Choice, float] = field(default_factory=dict)
    """Predicted sum of completion seconds of the affected requests, per option weighed."""
    victims: tuple[int, ...] = ()
    """swap / turns: indices into the running list, in the order they make room."""
    reason: str = "measured"
    """measured (the smallest prediction), too_long (it cannot fit Hot alone: spilling is the
    only way), idle (nothing runs: spilling costs nobody else), unmeasured (costs not yet
    measured: decided as `always`), or policy (always / never)."""


def _wait_s(cand: Job, running: list[Job], free: int, c: Costs) -> float | None:
    """Sum of completions if the candidate waits; None when it never fits."""
    t, p = c.decode_step_s, c.prefill_s
    growth = sum(j.final_blocks - j.hot_blocks for j in running)
    room, total = free - growth, sum(j.remaining for j in running) * t
    for k, job in enumerate(sorted(running, key=lambda j: j.remaining), 1):
        room += job.final_blocks
        if room >= cand.final_blocks - cand.hot_blocks:  # it starts when the k-th has ended
            still = len(running) - k  # ... and its prefill slows down those still running
            return total + still * p + job.remaining * t + p + cand.remaining * t
    return None


def _victims(
    cand: Job, running: list[Job], free: int, order: list[int], longer_only: bool
) -> list[int] | None:
    """Running jobs, in `order`, whose Hot blocks make room for the candidate's full length
    (with `longer_only`, only jobs with more tokens left than it, so that a swap never comes
    straight back); None when they cannot."""
    growth = sum(j.final_blocks - j.hot_blocks for j in running)
    room, out, need = free - growth, [], cand.final_blocks - cand.hot_blocks
    for i in order:
        if room >= need:
            break
        if running[i].remaining > cand.remaining or not longer_only:
            out.append(i)
            room += running[i].final_blocks
    return out if room >= need and out else None


def _swap_s(cand: Job, running: list[Job], victims: list[int], c: Costs) -> float:
    """Sum of completions if `victims` swap out now and come back after the candidate."""
    move = sum(running[i].hot_blocks for i in victims) * c.move_block_s
    cand_end = move + c.prefill_s + cand.remaining * c.decode_step_s
    total = cand_end
    for i, job in enumerate(running):
        if i in victims:
            total += cand_end + job.hot_blocks * c.move_block_s + job.remaining * c.decode_step_s
        else:
            total += move + c.prefill_s + job.remaining * c.decode_step_s
    return total


def _turns_s(cand: Job, running: list[Job], victims: list[int], turn: int, c: Costs) -> float:
    """Sum of completions if the candidate takes turns of `turn` tokens with `victims`: it
    comes in when the first of them has run its turn; while both sides have tokens left each
    runs every other turn, and each switch loads the incoming side's blocks."""
    t, p = c.decode_step_s, c.prefill_s
    wait = min(max(turn - running[i].turn_ran, 0) for i in victims) * t
    blocks = sum(running[i].hot_blocks for i in victims) + cand.final_blocks
    shared = min(cand.remaining, max(running[i].remaining for i in victims))
    switches = 2 * shared / turn + 1
    both = wait + p + 2 * shared * t + switches * blocks / 2 * c.move_block_s
    total = both + (cand.remaining - shared) * t
    for i, job in enumerate(running):
        if i in victims:
            total += both + (job.remaining - min(job.remaining, shared)) * t
        else:
            total += p + job.remaining * t
    return total


def _spill_s(cand: Job, running: list[Job], free: int, c: Costs) -> float:
    """Sum of completions if the candidate runs now and the overflow lives in Warm."""
    capacity = free + sum(j.hot_blocks for j in [*running, cand])
    over = max(0, sum(j.final_blocks for j in running) + cand.final_blocks - capacity)
    step = c.decode_step_s + c.warm_step_s + over * c.warm_block_s
    start = over * c.move_block_s + c.prefill_s
    return sum(start + j.remaining * step for j in [*running, cand])


def weigh(cand: Job, running: list[Job], free: int, c: Costs, turn: int = 0) -> Decision:
    """The option with the smallest predicted sum of completion times (module doc); `turn`:
    hot_turn_tokens (0: none), when set turns replace both wait and swap."""
    predicted: dict[Choice, float] = {"spill": _spill_s(cand, running, free, c)}
    newest_first = list(range(len(running)))[::-1]
    victims: list[int] | None
    if turn:
        by_turn = sorted(newest_first, key=lambda i: -running[i].turn_ran)
        victims = _victims(cand, running, free, by_turn, longer_only=False)
        if victims is not None:
            predicted["turns"] = _turns_s(cand, running, victims, turn, c)
    else:
        wait = _wait_s(cand, running, free, c)
        if wait is not None:
            predicted["wait"] = wait
        victims = _victims(cand, running, free, newest_first, longer_only=True)
        if victims is not None:
            predicted["swap"] = _swap_s(cand, running, victims, c)
    choice = min(predicted, key=predicted.__getitem__)
    kept = tuple(victims) if choice in ("swap", "turns") and victims else ()
    return Decision(choice, predicted, kept)


def rule(fits: bool, idle: bool, turn: int, policy: str, reason: str = "policy") -> Decision:
    """The decision without measurement: `always` spills only a sequence too long for Hot
    alone or into an idle engine, else waits (turns with hot_turn_tokens); `never` never
    spills."""
    if policy != "never" and (idle or not fits):
        return Decision("spill", reason="too_long" if not fits else "idle")
    return Decision("turns" if turn else "wait", reason=reason)


class SpillCosts:
    """The measured inputs of the decision (module doc), kept up to date while serving."""

    def __init__(self, step_times: StepBudget) -> None:
        self.step_times = step_times
        """Decode-only steps from Hot by batch bucket, and prefill per unit (step_budget.py)."""
        self.warm_block_s: float | None = None
        """W: one Warm block read in one decode step, all layers (start-up probe)."""
        self.warm_step_s: float | None = None
        """R: a decode step holding Warm beyond its blocks' reads (measured steps)."""
        self.move_block_s: float | None = None
        """M: one block Hot -> Warm or back (start-up probe, then every store)."""

    def observe_warm_step(self, rows: int, warm_blocks: int, seconds: float) -> None:
        """A measured decode-only step of `rows` rows holding `warm_blocks` Warm blocks."""
        hot = self.step_times.decode_step_s(rows)
        if hot is None or self.warm_block_s is None:
            return
        extra = max(seconds - hot - warm_blocks * self.warm_block_s, 0.0)
        self.warm_step_s = _ema(self.warm_step_s, extra)

    def observe_move(self, blocks: int, seconds: float) -> None:
        """`blocks` blocks moved between Hot and Warm in `seconds`."""
        if blocks > 0:
            self.move_block_s = _ema(self.move_block_s, seconds / blocks)

    def costs(self, rows: int, prefill_tokens: int, context: int) -> Costs | None:
        """The costs for a candidate joining `rows` running ones with `prefill_tokens` left
        after `context` cached ones; None until T, P, W and M were measured."""
        st = self.step_times
        step = st.decode_step_s(rows + 1)
        if None in (step, st.per_unit, self.warm_block_s, self.move_block_s):
            return None
        assert step is not None and st.per_unit is not None
        # Until a step holding Warm was measured, it is taken to cost one more Hot step:
        # spilling must show it wins, not be assumed to.
        return Costs(
            decode_step_s=step,
            prefill_s=st.per_unit * st.units(prefill_tokens, context),
            warm_step_s=self.warm_step_s if self.warm_step_s is not None else step,
            warm_block_s=self.warm_block_s or 0.0,
            move_block_s=self.move_block_s or 0.0,
        )


def _ema(old: float | None, new: float) -> float:
    return new if old is None else old + MEASURE_EMA * (new - old)


def _scaled(value: float | None, scale: float) -> float:
    return -1.0 if value is None else value * scale


class SpillPolicy:
    """kv_cache.spill_policy for one scheduler: its decisions, counted, and the last one."""

    def __init__(
        self,
        policy: str,
        turn_tokens: int,
        costs: SpillCosts | None,
        block_size: int,
        max_model_len: int,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"spill_policy={policy!r} is out of range: allowed {POLICIES}")
        self.policy, self.turn, self.costs = policy, turn_tokens, costs
        self.block_size, self.max_model_len = block_size, max_model_len
        self.counts: dict[str, int] = dict.fromkeys(CHOICES, 0)
        """Decisions since start, by choice (a candidate waiting over many steps counts once)."""
        self.last: Decision | None = None
        self.last_costs: Costs | None = None
        """The inputs of the last decision weighed from measured costs."""
        self._counted: tuple[str, str] | None = None  # (request id, choice) last counted

    def decide(self, cand: Sequence, running: list[Sequence], free: int, fits: bool) -> Decision:
        """What to do for `cand`, which cannot be admitted into `free` Hot blocks beside
        `running`; `fits`: it fits Hot alone at its full length."""
        idle = not running
        measured = None
        if self.policy == "auto" and fits and not idle and self.costs is not None:
            todo = cand.num_tokens - cand.num_computed_tokens
            measured = self.costs.costs(len(running), todo, cand.num_computed_tokens)
        if measured is None:
            reason = "unmeasured" if self.policy == "auto" else "policy"
            policy = "always" if self.policy == "auto" else self.policy
            decision = rule(fits, idle, self.turn, policy, reason)
        else:
            self.last_costs = measured
            jobs = [self.job(s) for s in running]
            decision = weigh(self.job(cand, final=True), jobs, free, measured, self.turn)
        self.last = decision
        if self._counted != (cand.request_id, decision.choice):
            self._counted = (cand.request_id, decision.choice)
            self.counts[decision.choice] += 1
        return decision

    def job(self, seq: Sequence, final: bool = False) -> Job:
        """`seq` as the decision sees it; `final`: all of it in Hot (the candidate)."""
        length = min(seq.prompt_len + seq.params.max_tokens, self.max_model_len)
        blocks = -(-length // self.block_size) - (0 if final else len(seq.warm_slots))
        return Job(
            remaining=max(length - seq.num_tokens, 0),
            hot_blocks=len(seq.block_ids),
            final_blocks=blocks,
            turn_ran=seq.num_output_tokens - seq.turn_start,
        )

    def info(self) -> dict[str, float | int | str]:
        """Counts, the last decision and its inputs, keyed by GetModelInfo field names (-1:
        not an option, or not measured)."""
        last, c = self.last, self.last_costs
        out: dict[str, float | int | str] = {
            f"spill_decisions_{choice}": n for choice, n in self.counts.items()
        }
        out["spill_last_choice"] = "" if last is None else f"{last.choice} ({last.reason})"
        for option in CHOICES:
            value = None if last is None else last.predicted.get(option)
            out[f"spill_predicted_{option}_s"] = -1.0 if value is None else value
        m = self.costs
        out["spill_decode_step_ms"] = -1.0 if c is None else c.decode_step_s * 1e3
        out["spill_prefill_ms"] = -1.0 if c is None else c.prefill_s * 1e3
        out["spill_warm_step_ms"] = _scaled(None if m is None else m.warm_step_s, 1e3)
        out["spill_warm_block_us"] = _scaled(None if m is None else m.warm_block_s, 1e6)
        out["spill_move_block_us"] = _scaled(None if m is None else m.move_block_s, 1e6)
        return out
