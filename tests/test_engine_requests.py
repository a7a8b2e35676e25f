"""Request validation (the edge's checks with the engine's limits, and the engine's assertion
of them) and lifecycle in the in-process engine (CPU, tiny preset)."""

from __future__ import annotations

import pytest
import torch

from hybridgen.config.engine import ConfigError, EngineConfig
from hybridgen.engine.engine import Engine
from hybridgen.engine.model_runner import computes_as_called
from hybridgen.engine.sequence import FinishReason
from hybridgen.engine.validation import InvalidRequest, UncheckedRequest
from hybridgen.models.presets import preset_spec
from hybridgen.sampling.params import InvalidSamplingParameter, SamplingParams


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(
        EngineConfig(model="tiny-llama", device="cpu", max_model_len=256, num_kv_blocks=64)
    )


@pytest.mark.parametrize(
    ("prompt", "params", "field"),
    [
        ([], SamplingParams(), "prompt"),
        ([1, 2, 512], SamplingParams(), "prompt_token_ids"),
        ([-1], SamplingParams(), "prompt_token_ids"),
        (list(range(1, 257)), SamplingParams(), "prompt"),
        ([1, 2, 3], SamplingParams(max_tokens=254), "max_tokens"),
    ],
)
def test_invalid_requests_name_the_field(engine: Engine, prompt, params, field) -> None:  # type: ignore[no-untyped-def]
    """The edge's checks name the field; the engine, given the request unchecked, refuses
    it as an internal error (whose cause is the edge's) and admits nothing."""
    with pytest.raises(InvalidRequest) as err:
        engine.validate(prompt, params)
    assert err.value.field == field
    with pytest.raises(UncheckedRequest) as unchecked:
        engine.add_request("bad", prompt, params)
    cause = unchecked.value.__cause__
    assert isinstance(cause, InvalidRequest) and cause.field == field
    assert not engine.has_unfinished()


def test_invalid_sampling_is_rejected_before_admission(engine: Engine) -> None:
    for params, field in [
        (SamplingParams(top_p=1.5), "top_p"),
        (SamplingParams(temperature=float("nan")), "temperature"),
    ]:
        with pytest.raises(InvalidSamplingParameter, match=field):
            engine.validate([1, 2], params)
        with pytest.raises(UncheckedRequest, match=field):
            engine.add_request("bad", [1, 2], params)
    assert not engine.has_unfinished()


def test_a_running_request_id_is_an_internal_error(engine: Engine) -> None:
    engine.add_request("twice", [1, 2], SamplingParams(max_tokens=1))
    with pytest.raises(UncheckedRequest, match="already running"):
        engine.add_request("twice", [3, 4], SamplingParams(max_tokens=1))
    assert engine.abort("twice") and not engine.has_unfinished()


def test_the_in_process_edges_name_the_field(
    engine: Engine, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The profiler and the offline CLI take requests from a file and a command line: they
    run the edge's checks before the engine (which only asserts them) and name the field."""
    from hybridgen.benchmarks.prompt_file import Prompt
    from hybridgen.cli import offline
    from hybridgen.tools import profiler

    with pytest.raises(
        profiler.ProfilerError, match=r"^prompt file line 3: max_tokens=1000 is out"
    ):
        profiler.replay(engine, [Prompt(3, "Hello", 1000)], 8)
    assert not engine.has_unfinished()
    # Its logging set-up (warnings only) would outlive the test and hide later tests' logs.
    monkeypatch.setattr(offline.log, "configure", lambda **_: None)
    assert offline.main(["Hello", "--max-tokens", "100000", "--device", "cpu"]) == 2
    # The engine's own info lines (the log set-up is patched out) come before the error's.
    last = capsys.readouterr().err.splitlines()[-1]
    assert last.startswith("error: max_tokens=100000 is out of range")


@pytest.mark.slow
def test_abort_frees_blocks_and_others_continue(engine: Engine) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    engine.add_request("keep", [5, 6, 7, 8], greedy)
    engine.add_request("drop", list(range(1, 100)), greedy)
    engine.step()
    engine.step()
    assert engine.abort("drop") and not engine.abort("drop")
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert {o.request_id for o in outputs} == {"keep"}
    assert outputs[-1].finish_reason is FinishReason.LENGTH and outputs[-1].output_tokens == 20
    assert engine.pool.num_free == engine.pool.num_blocks


def test_stop_token_and_eos_finish_with_stop(engine: Engine) -> None:
    first = engine.generate(
        [[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    )[0]
    stop_at = first.token_ids[2]
    params = SamplingParams(temperature=0.0, max_tokens=6, stop_token_ids=(stop_at,))
    stopped = engine.generate([[5, 6, 7]], params)[0]
    assert stopped.finish_reason is FinishReason.STOP
    assert stopped.token_ids == first.token_ids[: first.token_ids.index(stop_at) + 1]


def test_logprobs_are_returned_when_asked(engine: Engine) -> None:
    out = engine.generate(
        [[9, 10]], SamplingParams(temperature=0.0, max_tokens=4, logprobs=2, ignore_eos=True)
    )[0]
    assert out.logprobs is not None and len(out.logprobs) == 4
    assert all(lp <= 0.0 for lp in out.logprobs)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("block_size", 12),
        ("max_num_seqs", 0),
        ("dtype", "int8"),
        ("device", "tpu"),
        ("gpu_memory_mb", 1),
    ],
)
def test_bad_engine_config_names_the_key(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=f"^{field}="):
        EngineConfig(**{field: value})  # type: ignore[arg-type]


@pytest.mark.slow
@pytest.mark.parametrize("hot_codec", ["native", "int8", "int4"])
def test_budget_accounting_holds_on_cpu(hot_codec: str) -> None:
    """The plan never exceeds the budget, the KV tensors are exactly the planned pool (in
    each Hot codec's layout), and a budget too small for one sequence is refused with a
    message naming the key."""
    engine = Engine(
        EngineConfig(
            model="tiny-llama",
            device="cpu",
            gpu_memory_mb=160,
            max_model_len=1024,
            hot_codec=hot_codec,
        )
    )
    plan = engine.plan
    assert plan.planned_peak <= plan.budget
    assert engine.runner.kv_bytes() == plan.kv_pool
    weights = sum(p.numel() * p.element_size() for p in engine.loaded.model.parameters())
    assert weights == plan.weights
    prompts = [list(range(1, 300)) for _ in range(40)]
    engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
    assert engine.stats.peak_blocks_used <= plan.num_blocks
    from hybridgen.engine.memory import BudgetTooSmall

    with pytest.raises(BudgetTooSmall, match=r"device_topology\.gpu\.memory_mb=64"):
        Engine(EngineConfig(model="tiny-llama", device="cpu", gpu_memory_mb=64, max_model_len=1024))


@pytest.mark.slow
def test_decode_steps_do_not_change_outputs() -> None:
    """Running several decode steps per host sync gives the same tokens and logprobs as one,
    greedy and seeded alike, and drops tokens computed past a stop."""
    prompts = [[5, 6, 7], list(range(1, 40)), [300, 301]]
    params = [
        SamplingParams(temperature=0.0, max_tokens=13, ignore_eos=True, logprobs=1),
        SamplingParams(temperature=0.9, top_k=40, seed=7, max_tokens=9, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
    ]
    runs = []
    for steps in (1, 3, 4):
        engine = Engine(
            EngineConfig(
                model="tiny-llama",
                device="cpu",
                max_model_len=256,
                num_kv_blocks=64,
                decode_steps=steps,
            )
        )
        done = engine.generate(prompts, params)
        runs.append([(c.token_ids, c.logprobs) for c in done])
        assert engine.pool.num_free == engine.pool.num_blocks
    assert runs[0] == runs[1] == runs[2]
    stop_at = runs[0][2][0][5]
    engine = Engine(
        EngineConfig(
            model="tiny-llama", device="cpu", max_model_len=256, num_kv_blocks=64, decode_steps=4
        )
    )
    stopped = engine.generate(
        [prompts[2]], SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=(stop_at,))
    )[0]
    assert stopped.token_ids == runs[0][2][0][: runs[0][2][0].index(stop_at) + 1]
    assert engine.pool.num_free == engine.pool.num_blocks


@pytest.mark.parametrize("as_called", [True, False])
def test_decode_steps_hand_each_step_over_as_it_is_computed(monkeypatch, as_called: bool) -> None:  # type: ignore[no-untyped-def]
    """Where a decode step is computed when it is called (the CPU; a MoE model, whose
    layers read their expert ids back), several steps per sync hand each one's tokens over
    before the next is launched: the caller sees step 1's token after one forward pass, not
    two (which also made the measured step time two). Where steps only queue work (a dense
    model on CUDA), step j + 1 is queued before step j is handed over."""
    engine = Engine(
        EngineConfig(
            model="tiny-llama", device="cpu", max_model_len=256, num_kv_blocks=64, decode_steps=4
        )
    )
    engine.add_request(
        "a", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)
    )
    engine.step()  # the prefill and its token
    forwards = 0
    decode = engine.runner._decode_logits_any

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        nonlocal forwards
        forwards += 1
        return decode(*args, **kwargs)

    monkeypatch.setattr(engine.runner, "_decode_logits_any", counted)
    monkeypatch.setattr(engine.runner, "computes_as_called", as_called)
    seen = []
    for outputs in engine.steps():
        seen.append(forwards)
        assert len(outputs) == 1 and len(outputs[0].new_token_ids) == 1
    assert seen == ([1, 2, 3, 4] if as_called else [2, 3, 4, 4])


def test_which_decode_steps_are_computed_as_called() -> None:
    """A dense model on CUDA only queues a step; a CPU computes it, and a MoE model on any
    device waits for each layer's expert ids, so its step has run when the call returns."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    dense, moe = preset_spec("llama3-8b"), preset_spec("mixtral-8x7b")
    assert not computes_as_called(cuda, dense)
    assert computes_as_called(cuda, moe)
    assert computes_as_called(cuda, preset_spec("qwen3-30b-a3b"))
    assert computes_as_called(cpu, dense) and computes_as_called(cpu, moe)


@pytest.mark.slow
def test_warm_tier_reserves_in_place_reads_only_if_a_sequence_can_outgrow_hot() -> None:
    """A Warm tier reserves device room for a prefill that reads a Warm prefix in place, which
    happens only to a sequence too long for Hot alone. At 318 MiB Hot holds a 65536-token
    sequence anyway, so the plan is the one without Warm (B6 lost 318 blocks to this room);
    at 315 MiB it does not, and the room is reserved."""

    def plan(budget_mb: int, warm_mb: int) -> tuple[int, int]:
        config = EngineConfig(
            model="tiny-llama",
            device="cpu",
            gpu_memory_mb=budget_mb,
            max_model_len=65536,
            warm_pool_mb=warm_mb,
            max_num_batched_tokens=256,
            max_num_seqs=4,
        )
        engine = Engine(config)
        engine.release()
        return engine.plan.num_blocks, engine.plan.workspace

    assert plan(318, 64) == plan(318, 0)
    blocks, workspace = plan(315, 64)
    assert blocks * 16 < 65536 and workspace > plan(318, 0)[1]
    # A budget whose pure Hot holds max_model_len is enough with a Warm tier too, even when
    # the read room would not fit in it (a 4-layer model, where that room costs the most).
    lean = Engine(
        EngineConfig(
            model="tiny-llama", device="cpu", gpu_memory_mb=94, max_model_len=1024, warm_pool_mb=4
        )
    )
    lean.release()
    assert lean.plan.num_blocks * 16 >= 1024
