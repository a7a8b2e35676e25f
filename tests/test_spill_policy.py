"""kv_cache.spill_policy: what a waiting sequence that cannot fit Hot beside the running ones
does (wait, swap others out, take turns, spill to Warm), chosen from predicted completion
times; on constructed cases, first as the bare decision, then through the engine with fixed
costs, where whichever is chosen the tokens are HF's."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridgen.config.engine import ConfigError, EngineConfig
from hybridgen.engine.engine import Engine
from hybridgen.engine.spill_policy import Costs, Job, rule, weigh
from hybridgen.sampling.params import SamplingParams
from tests.engine_helpers import small_engine
from tests.hf_reference import hf_greedy, sample_prompts

T = 0.010  # a decode step, seconds


def costs(**kw: float) -> Costs:
    base = {
        "decode_step_s": T,
        "prefill_s": 0.02,
        "warm_step_s": 0.005,
        "warm_block_s": 1e-3,
        "move_block_s": 1e-3,
    }
    return Costs(**{**base, **kw})


def test_a_long_sequence_waits_for_one_about_to_finish() -> None:
    """The running one has 8 tokens left; the candidate has 32 and would overflow Hot by 6
    blocks for its whole run: waiting 8 steps beats reading Warm at every step, and nothing
    running has more left than it, so nothing may swap out for it."""
    running = [Job(remaining=8, hot_blocks=8, final_blocks=9)]
    cand = Job(remaining=32, hot_blocks=0, final_blocks=9)
    d = weigh(cand, running, free=4, c=costs(warm_block_s=0.01))
    assert d.choice == "wait" and "swap" not in d.predicted
    assert d.predicted["wait"] == pytest.approx(8 * T + (8 * T + 0.02 + 32 * T))
    assert d.predicted["spill"] > d.predicted["wait"]


def test_a_sequence_spills_when_waiting_is_long_and_warm_is_cheap() -> None:
    """The running one has 23 tokens left, the candidate 48 (more: no swap); their full
    lengths overflow Hot by 9 blocks, read at 1 ms a step: spilling wins over waiting."""
    running = [Job(remaining=23, hot_blocks=8, final_blocks=10)]
    cand = Job(remaining=48, hot_blocks=0, final_blocks=11)
    c = costs(prefill_s=0.01, warm_step_s=0.5e-3, warm_block_s=0.05e-3, move_block_s=0.1e-3)
    d = weigh(cand, running, free=4, c=c)
    over_step = T + 0.5e-3 + 9 * 0.05e-3
    assert d.choice == "spill" and "swap" not in d.predicted
    assert d.predicted["spill"] == pytest.approx(2 * (9 * 0.1e-3 + 0.01) + 71 * over_step)
    # The same with Warm 20x dearer to read: waiting wins.
    assert weigh(cand, running, 4, costs(warm_block_s=1e-3, prefill_s=0.01)).choice == "wait"


def test_a_short_sequence_swaps_a_long_one_out() -> None:
    """The running one has 45 tokens left, the candidate 4: swapping the long one out (6 of
    its blocks each way) and back costs less than the candidate waiting 45 steps or every
    step reading 6 Warm blocks for the long one's whole run."""
    running = [Job(remaining=45, hot_blocks=6, final_blocks=11)]
    cand = Job(remaining=4, hot_blocks=0, final_blocks=7)
    d = weigh(cand, running, free=5, c=costs())
    assert d.choice == "swap" and d.victims == (0,)
    move = 6 * 1e-3
    end = move + 0.02 + 4 * T
    assert d.predicted["swap"] == pytest.approx(end + end + move + 45 * T)


def test_turns_stand_in_for_waiting_and_swapping() -> None:
    """With hot_turn_tokens the operator asked for turns: they are weighed against spilling
    only (a turn ends when the running one has run `turn` tokens of it)."""
    running = [Job(remaining=45, hot_blocks=6, final_blocks=11, turn_ran=2)]
    cand = Job(remaining=4, hot_blocks=0, final_blocks=7)
    d = weigh(cand, running, free=5, c=costs(), turn=8)
    assert d.choice == "turns" and set(d.predicted) == {"turns", "spill"} and d.victims == (0,)
    cheap = costs(warm_step_s=0.0, warm_block_s=1e-6, move_block_s=0.01)
    assert weigh(cand, running, 5, cheap, turn=8).choice == "spill"


def test_rules_without_measurement() -> None:
    """always: spill only what cannot fit Hot alone (or into an idle engine), else wait (or
    take turns); never: never spill."""
    assert rule(fits=False, idle=False, turn=0, policy="always").choice == "spill"
    assert rule(fits=False, idle=False, turn=0, policy="always").reason == "too_long"
    assert rule(fits=True, idle=False, turn=0, policy="always").choice == "wait"
    assert rule(fits=True, idle=False, turn=8, policy="always").choice == "turns"
    assert rule(fits=True, idle=True, turn=0, policy="always").choice == "spill"
    assert rule(fits=False, idle=True, turn=0, policy="never").choice == "wait"


# -- through the engine: fixed costs, HF's tokens -------------------------------------------


def fixed_costs(engine: Engine, c: Costs, per_unit: float) -> None:
    """Give the engine's spill decision the costs `c` and keep them: its measurements are
    turned off (a 2-core machine's timings would decide otherwise from run to run)."""
    sc, st = engine.spill_costs, engine.step_times
    assert sc is not None
    st.decode = {1 << i: c.decode_step_s for i in range(8)}
    st.per_unit = per_unit
    sc.warm_step_s, sc.warm_block_s, sc.move_block_s = c.warm_step_s, c.warm_block_s, c.move_block_s
    st.observe = lambda *a, **k: None  # type: ignore[method-assign]
    sc.observe_warm_step = lambda *a, **k: None  # type: ignore[method-assign]
    sc.observe_move = lambda *a, **k: None  # type: ignore[method-assign]


def run_pair(
    engine: Engine, first: tuple[list[int], int], second: tuple[list[int], int]
) -> dict[str, list[int]]:
    """`first` alone until its prompt is computed, then `second` beside it; to the end."""
    tokens: dict[str, list[int]] = {"a": [], "b": []}
    greedy = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in (first, second)
    ]
    engine.add_request("a", first[0], greedy[0])
    while not tokens["a"]:
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    engine.add_request("b", second[0], greedy[1])
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    return tokens


def hf_pair(path: Path, prompts: list[list[int]], new: tuple[int, int]) -> dict[str, list[int]]:
    ref = hf_greedy(path, prompts, max(new))  # a greedy run's first n tokens: its n-token run
    return {"a": ref[0][: new[0]], "b": ref[1][: new[1]]}


SPILL_COSTS = costs(warm_step_s=0.5e-3, warm_block_s=0.05e-3, move_block_s=0.1e-3)
CASES = {
    # name: (prompt lengths, new tokens, costs, the auto choice)
    "wait": ((56, 40), (8, 32), costs(warm_block_s=0.01), "wait"),
    "spill": ((56, 40), (24, 48), SPILL_COSTS, "spill"),
    "swap": ((40, 50), (48, 4), costs(), "swap"),
}


@pytest.mark.parametrize("policy", ["auto", "always", "never"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_each_choice_gives_hf_tokens(checkpoint, case: str, policy: str) -> None:  # type: ignore[no-untyped-def]
    """Hot holds 12 blocks of 8 tokens. The first sequence runs; the second cannot fit
    beside it. With the costs fixed, auto makes the case's choice for it (always and never
    make it wait), and the tokens of both are HF's whichever it is."""
    path = checkpoint("llama3")
    lengths, new, c, choice = CASES[case]
    prompts = sample_prompts(path, 2, list(lengths))
    engine = small_engine(
        path,
        num_kv_blocks=12,
        max_model_len=96,
        max_num_batched_tokens=64,  # each prompt in one step: decided at its first admission
        warm_pool_mb=2,
        step_latency_ms=0,
        spill_policy=policy,
    )
    fixed_costs(engine, c, per_unit=c.prefill_s / 40)
    policy_state = engine.scheduler.policy
    assert policy_state is not None
    made: list[tuple[str, str]] = []
    decide = policy_state.decide

    def recorded(cand, *args):  # type: ignore[no-untyped-def]
        decision = decide(cand, *args)
        made.append((cand.request_id, decision.choice))
        return decision

    policy_state.decide = recorded  # type: ignore[method-assign]
    got = run_pair(engine, (prompts[0], new[0]), (prompts[1], new[1]))
    assert got == hf_pair(path, prompts, new)
    expected = choice if policy == "auto" else "wait"
    assert made[0] == ("b", expected), made
    assert policy_state.counts[expected] >= 1
    warm = engine.warm
    assert warm is not None
    assert (warm.stats.spilled_blocks > 0) == (expected == "spill")
    assert (warm.stats.swapped_blocks > 0) == (expected == "swap")
    check_model_info_and_metrics(engine, policy, expected)
    engine.release()


def check_model_info_and_metrics(engine: Engine, policy: str, choice: str) -> None:
    """The decisions, the last one with its predictions and inputs, survive GetModelInfo's
    protobuf and land in the Prometheus gauges."""
    from hybridgen.cli.explain import spill_lines
    from hybridgen.engine.info import engine_info
    from hybridgen.serving.metrics import Metrics
    from hybridgen.serving.service import model_info_to_pb

    stats = engine.tier_stats()
    pb = model_info_to_pb({**engine_info(engine), **stats, "max_queue": 1})
    assert pb.spill_policy == policy
    assert getattr(pb, f"spill_decisions_{choice}") == stats[f"spill_decisions_{choice}"] >= 1
    assert pb.spill_last_choice == stats["spill_last_choice"] != ""
    if policy == "auto":  # weighed from the fixed costs
        assert pb.spill_decode_step_ms == pytest.approx(T * 1e3)
        assert pb.spill_predicted_spill_s == pytest.approx(stats["spill_predicted_spill_s"])
        assert pb.spill_predicted_spill_s > 0
    else:
        assert pb.spill_predicted_spill_s == -1 and pb.spill_last_choice == "wait (policy)"
    explained = spill_lines(pb)  # what `hybridgen serve --explain` prints
    assert explained[0].startswith(f"spill policy: {policy}; decisions so far: wait ")
    assert explained[1].startswith(f"  last: {stats['spill_last_choice']}")
    assert ("predicted completion sums" in explained[1]) == (policy == "auto")
    assert ("decode step 10 ms" in explained[2]) == (policy == "auto")
    metrics = Metrics()
    metrics.set_kv_tiers(stats)
    value = metrics.registry.get_sample_value
    for c in ("wait", "swap", "turns", "spill"):
        assert value("hybridgen_spill_decisions", {"choice": c}) == stats[f"spill_decisions_{c}"]


def test_never_keeps_max_model_len_within_hot(checkpoint) -> None:  # type: ignore[no-untyped-def]
    """spill_policy never: Hot must hold a whole sequence (the memory plan refuses a
    max_model_len beyond it); the other policies let Warm hold what Hot cannot."""
    path = checkpoint("llama3")
    spill = small_engine(path, num_kv_blocks=8, warm_pool_mb=2, spill_policy="always")
    assert spill.max_model_len == 256
    spill.release()
    with pytest.raises(Exception, match="max_model_len"):
        small_engine(path, num_kv_blocks=8, warm_pool_mb=2, spill_policy="never")
    with pytest.raises(ConfigError, match=r"^spill_policy='sometimes' .* auto, always or never"):
        EngineConfig(spill_policy="sometimes")


def test_serve_flag_and_variable_set_the_policy() -> None:
    """kv_cache.spill_policy is `hybridgen serve --kv-spill-policy` and
    HYBRIDGEN_KV_SPILL_POLICY (the flag over the variable), down to the engine's config; a bad
    value names the flag and the allowed ones."""
    from hybridgen.config.layers import flag_for, layered_config

    assert flag_for("kv_cache.spill_policy") == "--kv-spill-policy"
    env = {"HYBRIDGEN_KV_SPILL_POLICY": "always"}
    by_env = layered_config(None, env, {})
    assert by_env.config.engine_config("cpu").spill_policy == "always"
    assert by_env.sources["kv_cache.spill_policy"] == "env HYBRIDGEN_KV_SPILL_POLICY"
    by_flag = layered_config(None, env, {"kv_cache.spill_policy": "never"})
    assert by_flag.config.engine_config("cpu").spill_policy == "never"
    assert by_flag.sources["kv_cache.spill_policy"] == "flag --kv-spill-policy"
    with pytest.raises(ConfigError, match=r"spill_policy.*auto, always, never.*--kv-spill-policy"):
        layered_config(None, {}, {"kv_cache.spill_policy": "sometimes"})
