"""A step that fails ends only its own requests, with a status and a message, frees their KV,
and the engine (in process, and the GPU daemon under `hybridgen serve`) serves the rest with
the right tokens. The fault drill (HYBRIDGEN_FAULT_STEPS) raises at a chosen step: a real
failed allocation (oom) or an exception (error)."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from hybridgen.config.engine import EngineConfig
from hybridgen.engine.engine import Engine
from hybridgen.engine.step_errors import ErrorCode
from hybridgen.engine.step_faults import FAULT_ENV, FaultDrill
from hybridgen.sampling.params import SamplingParams
from hybridgen.v1 import generation_pb2 as pb
from tests.hf_reference import hf_greedy, sample_prompts
from tests.test_serving import Server, find_pid, wait_serving

NEW = 12


def _engine(path: Path, faults: str, **options: object) -> Engine:
    config = EngineConfig(
        model=str(path),
        device="cpu",
        max_model_len=128,
        max_num_batched_tokens=64,
        **{"max_num_seqs": 1, **options},  # type: ignore[arg-type]
    )
    engine = Engine(config)
    engine.faults = FaultDrill(faults)
    return engine


def _run(engine: Engine, prompts: list[list[int]]) -> dict[str, list]:  # type: ignore[type-arg]
    """Each request's tokens, and its error (or None), stepping until all have ended."""
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, greedy)
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    errors: dict[str, object] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            if out.error is not None:
                errors[out.request_id] = out.error
    return {"tokens": [tokens[f"r{i}"] for i in range(len(prompts))], "errors": errors}


@pytest.mark.parametrize(
    ("kind", "code"), [("error", ErrorCode.INTERNAL), ("oom", ErrorCode.RESOURCE_EXHAUSTED)]
)
def test_failed_step_ends_only_its_requests(checkpoint, kind: str, code: ErrorCode) -> None:  # type: ignore[no-untyped-def]
    path = checkpoint("llama3")
    prompts = sample_prompts(path, 3, 9)
    expected = hf_greedy(path, prompts, NEW)
    # One sequence at a time: steps 0-3 are r0's (its prefill, then decodes), so step 2
    # holds r0 alone while r1 and r2 wait.
    engine = _engine(path, f"2:{kind}", decode_steps=1)
    got = _run(engine, prompts)
    assert set(got["errors"]) == {"r0"}
    error = got["errors"]["r0"]
    assert error.code is code and "this request was stopped" in str(error)
    if kind == "oom":
        assert "max_num_batched_tokens" in str(error), "the message says what to change"
    assert got["tokens"][0] == expected[0][:2], "r0 streamed its first two tokens, then ended"
    assert got["tokens"][1:] == expected[1:], "the waiting requests are untouched"
    assert engine.pool.num_used == 0 and not engine.seqs, "the failed request's KV is freed"
    assert engine.stats.failed_steps == 1


def test_failed_step_in_a_mixed_batch_spares_the_queue(checkpoint) -> None:  # type: ignore[no-untyped-def]
    path = checkpoint("llama3")
    prompts = sample_prompts(path, 4, 7)
    expected = hf_greedy(path, prompts, NEW)
    engine = _engine(path, "0:error", max_num_seqs=2)  # r0 and r1 prefill together at step 0
    got = _run(engine, prompts)
    assert set(got["errors"]) == {"r0", "r1"}
    assert got["tokens"][:2] == [[], []]
    assert got["tokens"][2:] == expected[2:]
    assert engine.pool.num_used == 0


def test_multi_step_decode_yields_every_step(checkpoint) -> None:  # type: ignore[no-untyped-def]
    """With decode_steps 4, Engine.steps hands over each decode step's tokens on its own (so
    the GPU daemon streams them as made), and they are the tokens Engine.step would join."""
    path = checkpoint("llama3")
    prompts = sample_prompts(path, 2, 9)
    engine = _engine(path, "", max_num_seqs=2, decode_steps=4)
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, greedy)
    per_batch: list[list[list[int]]] = []
    tokens: dict[str, list[int]] = {"r0": [], "r1": []}
    while engine.has_unfinished():
        per_batch.append([])
        for outputs in engine.steps():
            per_batch[-1].append([len(o.new_token_ids) for o in outputs])
            for o in outputs:
                tokens[o.request_id] += o.new_token_ids
    assert [tokens["r0"], tokens["r1"]] == hf_greedy(path, prompts, NEW)
    assert [[1, 1]] * 4 in per_batch, "a 4-step decode batch yields 4 times, 1 token each"
    assert all(n == 1 for batch in per_batch for step in batch for n in step)


def test_fault_drill_spec_is_checked() -> None:
    assert FaultDrill("3:oom, 7:error").at == {3: "oom", 7: "error"}
    for bad in ("x:oom", "3:segv", "3"):
        with pytest.raises(ValueError, match=FAULT_ENV):
            FaultDrill(bad)


@pytest.mark.slow
def test_served_failed_step_keeps_the_daemon(checkpoint, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Under `hybridgen serve`: the request in the failing step gets RESOURCE_EXHAUSTED with
    the message, requests queued behind it finish with HF's tokens, and the GPU daemon is the
    same process throughout."""
    path = checkpoint("llama3")
    prompts = sample_prompts(path, 3, 9)
    expected = hf_greedy(path, prompts, NEW)
    engine_config = "model:\n  max_model_len: 128\n  max_num_seqs: 1\n  dtype: float32\n"
    srv = Server(path, tmp_path, engine_config=engine_config, env={FAULT_ENV: "2:oom"})
    try:
        wait_serving(srv.port, proc=srv.proc)
        pid = find_pid("hybridgen.gpu_daemon.main", srv.instance)
        greedy = pb.SamplingParams(temperature=0.0)
        requests = [
            pb.GenerateRequest(prompt_token_ids=p, max_tokens=NEW, ignore_eos=True, sampling=greedy)
            for p in prompts
        ]
        calls = [srv.stub.Generate(r, timeout=120) for r in requests]
        outcomes: list[list[int] | grpc.RpcError] = []
        for call in calls:  # which one the GPU daemon admits first is the gateway's race
            try:
                outcomes.append([t for reply in call for t in reply.token_ids])
            except grpc.RpcError as exc:
                outcomes.append(exc)
        failed = [i for i, o in enumerate(outcomes) if isinstance(o, grpc.RpcError)]
        assert len(failed) == 1, outcomes
        err = outcomes[failed[0]]
        assert isinstance(err, grpc.RpcError)
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "ran out of memory" in (err.details() or "")
        for i, o in enumerate(outcomes):
            assert i in failed or o == expected[i], "the others are untouched"
        assert srv.greedy(prompts[0], NEW) == expected[0], "served again, from scratch"
        assert find_pid("hybridgen.gpu_daemon.main", srv.instance) == pid, "no restart"
        info = srv.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
        assert info.kv_blocks_used == 0
    finally:
        assert srv.stop() == 0
