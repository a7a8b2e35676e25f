"""Tensor parallel 2 over gloo on the CPU (two processes): HF's greedy tokens on the tiny
checkpoints, in process and through `hybridgen serve`; the config checks; a lost rank."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
import torch
from yaml import safe_load

from hybridgen.config.engine import ConfigError, EngineConfig
from hybridgen.config.file import parse_config
from hybridgen.engine.engine import Engine
from hybridgen.models.spec import parse_config as parse_model_config
from hybridgen.parallel.launch import Workers, worker_device
from hybridgen.parallel.model import EXIT_WAIT_S, RankLost, ShardedCausalLM
from hybridgen.parallel.sharding import local_spec, shard_tensor, vocab_shard
from hybridgen.sampling.params import SamplingParams
from hybridgen.v1 import generation_pb2 as pb
from tests.hf_reference import hf_greedy, sample_prompts
from tests.served import DefaultServer
from tests.test_serving import find_pid, wait_serving

NEW_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def tp_engine(path: Path, **options: object) -> Engine:
    options = {"tensor_parallel": 2, **options}
    return Engine(EngineConfig(model=str(path), device="cpu", **options))  # type: ignore[arg-type]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama3", "qwen2", "mixtral"])
def test_tp2_greedy_matches_hf(checkpoint, kind: str) -> None:  # type: ignore[no-untyped-def]
    """Prompts of different lengths, run together and chunked, give HF's greedy tokens with
    the model split over two processes (multi-step decode included)."""
    path = checkpoint(kind)
    prompts = sample_prompts(path, 3, [7, 29, 53])
    expected = hf_greedy(path, prompts, NEW_TOKENS)
    engine = tp_engine(path, max_num_seqs=4, max_num_batched_tokens=32, decode_steps=4)
    try:
        assert isinstance(engine.loaded.model, ShardedCausalLM)
        assert engine.loaded.model.spec.num_kv_heads == engine.spec.num_kv_heads // 2
        got = engine.generate(prompts, GREEDY)
    finally:
        engine.release()
    assert [c.token_ids for c in got] == expected


@pytest.mark.slow
def test_tp2_pads_an_odd_vocabulary(checkpoint) -> None:  # type: ignore[no-untyped-def]
    """451 rows split 226 + 225 (the second rank's padded with a zero row, its logit cut
    off after the gather): still HF's tokens."""
    path = checkpoint("llama3", vocab_size=451, tie_word_embeddings=False)
    prompts = sample_prompts(path, 2, [11, 40])
    expected = hf_greedy(path, prompts, NEW_TOKENS)
    engine = tp_engine(path, max_num_seqs=4)
    try:
        assert engine.loaded.model.spec.vocab_size == 226
        assert engine.prompt_logits(prompts[0]).shape == (451,)
        got = engine.generate(prompts, GREEDY)
    finally:
        engine.release()
    assert [c.token_ids for c in got] == expected


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-mixtral"])
def test_tp2_draws_the_same_synthetic_model(preset: str) -> None:
    """A preset split over two ranks is the model one device draws: the same greedy tokens,
    and logits within fp32 summation noise."""
    prompt = list(range(3, 40))
    one = Engine(EngineConfig(model=preset, device="cpu", max_num_seqs=4))
    expected = one.generate([prompt], GREEDY)[0].token_ids
    logits = one.prompt_logits(prompt)
    one.release()
    engine = Engine(EngineConfig(model=preset, device="cpu", max_num_seqs=4, tensor_parallel=2))
    try:
        assert isinstance(engine.loaded.model, ShardedCausalLM)
        torch.testing.assert_close(engine.prompt_logits(prompt), logits, rtol=0, atol=1e-5)
        got = engine.generate([prompt], GREEDY)[0].token_ids
    finally:
        engine.release()
    assert got == expected


@pytest.mark.slow
def test_lost_rank_fails_the_step_not_hangs(checkpoint) -> None:  # type: ignore[no-untyped-def]
    """A worker killed between steps: the next step raises RankLost (the daemon then exits
    and its supervisor restarts it) instead of waiting on the dead rank; release() still
    returns."""
    path = checkpoint("llama3")
    prompt = sample_prompts(path, 1, [9])
    engine = tp_engine(path, max_num_seqs=4)
    try:
        engine.generate(prompt, GREEDY)
        model = engine.loaded.model
        assert isinstance(model, ShardedCausalLM) and isinstance(model.driver, Workers)
        worker = model.driver.procs[0]
        worker.send_signal(signal.SIGKILL)
        worker.wait(timeout=30)
        with pytest.raises(RankLost, match="rank 1"):
            engine.generate(prompt, GREEDY)
    finally:
        engine.release()


def test_workers_check_waits_for_an_exit() -> None:
    """A worker that exits a moment after a collective failed (its sockets close before it
    can be reaped): check() alone misses it, check(wait_s) names it."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.3)"])
    try:
        workers = Workers([proc])
        workers.check()  # still running
        with pytest.raises(RankLost, match=r"rank 1 \(pid \d+\) exited with code 0"):
            workers.check(wait_s=10.0)
    finally:
        proc.wait()


def test_failure_inside_a_tp_step_is_rank_lost() -> None:
    """Any exception inside rank 0's guarded block is RankLost (the workers wait in the
    step's collectives for good), after the driver had a moment to name a dead worker."""
    waits: list[float] = []

    class Alive:
        def check(self, wait_s: float = 0.0) -> None:
            waits.append(wait_s)

    rank0 = SimpleNamespace(driver=Alive())
    guarded = ShardedCausalLM._guard(rank0)  # type: ignore[arg-type]
    with pytest.raises(RankLost, match="out of step") as err, guarded:
        raise RuntimeError("Connection closed by peer")
    assert isinstance(err.value.__cause__, RuntimeError)
    assert waits == [0.0, EXIT_WAIT_S] and EXIT_WAIT_S > 0
    with ShardedCausalLM._guard(SimpleNamespace(driver=None)):  # type: ignore[arg-type]
        pass  # a worker rank: no driver, nothing checked


@pytest.mark.slow
def test_release_stops_the_workers(checkpoint) -> None:  # type: ignore[no-untyped-def]
    path = checkpoint("qwen2")
    engine = tp_engine(path, max_num_seqs=4)
    model = engine.loaded.model
    assert isinstance(model, ShardedCausalLM) and isinstance(model.driver, Workers)
    procs = model.driver.procs
    assert [p.poll() for p in procs] == [None]
    engine.release()
    assert [p.returncode for p in procs] == [0], "told to stop, the worker exits cleanly"
    assert not torch.distributed.is_initialized()


def test_model_widths_must_divide(checkpoint) -> None:  # type: ignore[no-untyped-def]
    """llama3's 2 KV heads do not split 4 ways: the error names the key and the width, and
    comes before any worker starts."""
    path = checkpoint("llama3")
    spec = parse_model_config(path / "config.json")
    with pytest.raises(ConfigError, match=r"tensor_parallel=4 .*num_key_value_heads \(2\)"):
        local_spec(spec, 4)
    with pytest.raises(ConfigError, match="num_key_value_heads"):
        tp_engine(path, tensor_parallel=4, max_num_seqs=4)


def test_latent_attention_is_refused() -> None:
    """DeepSeek-V2's multi-head latent attention does not split yet: the start fails naming
    the key, before any worker."""
    with pytest.raises(ConfigError, match=r"tensor_parallel=2 .*allowed 1 \(multi-head latent"):
        tp_engine(Path("tiny-deepseek-v2"), max_num_seqs=4)


def test_shard_rules() -> None:
    """Column-parallel rows, row-parallel columns, vocab rows padded, the rest whole."""
    w = torch.arange(24.0).view(4, 6)
    assert torch.equal(shard_tensor("model.layers.0.self_attn.q_proj.weight", w, 1, 2), w[2:])
    assert torch.equal(shard_tensor("model.layers.0.self_attn.k_proj.bias", w[0], 0, 2), w[0, :3])
    assert torch.equal(shard_tensor("model.layers.0.mlp.down_proj.weight", w, 1, 2), w[:, 3:])
    expert = "model.layers.0.block_sparse_moe.experts.3.w2.weight"
    assert torch.equal(shard_tensor(expert, w, 0, 2), w[:, :3])
    assert torch.equal(shard_tensor("model.layers.0.block_sparse_moe.gate.weight", w, 1, 2), w)
    assert torch.equal(shard_tensor("model.layers.0.input_layernorm.weight", w[0], 1, 2), w[0])
    odd = torch.ones(5, 2)
    assert vocab_shard(5, 2) == 3
    last = shard_tensor("model.embed_tokens.weight", odd, 1, 2)
    assert last.shape == (3, 2) and last[2].abs().sum() == 0 and last[:2].sum() == 4


@pytest.mark.parametrize(
    ("options", "key"),
    [
        ({"tensor_parallel": 0}, "tensor_parallel=0 is out of range: allowed 1..8"),
        ({"tensor_parallel": 9}, "tensor_parallel=9 is out of range: allowed 1..8"),
        ({"tensor_parallel": 2, "tensor_parallel_ids": (0,)}, "tensor_parallel_ids"),
        ({"tensor_parallel": 2, "tensor_parallel_ids": (1, 1)}, "tensor_parallel_ids"),
        ({"tensor_parallel": 2, "warm_pool_mb": 64}, "warm_pool_mb=64"),
        ({"tensor_parallel": 2, "gpu_layers": 1}, "gpu_layers=1"),
        ({"tensor_parallel": 2, "expert_cache_slots": 4}, "expert_cache_slots=4"),
        ({"tensor_parallel": 2, "weights_format": "int4"}, "weights_format='int4'"),
        ({"tensor_parallel": 2, "hot_codec": "int8"}, "hot_codec='int8'"),
    ],
)
def test_engine_config_refuses(options: dict[str, object], key: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(key)):
        EngineConfig(**options)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("yaml", "message"),
    [
        ("device_topology: {gpu: {tensor_parallel: 9}}", "device_topology.gpu.tensor_parallel=9"),
        ("device_topology: {gpu: {tensor_parallel: 2, ids: [0]}}", "device_topology.gpu.ids=[0]"),
        ("device_topology: {gpu: {tensor_parallel: 2, ids: [1, 1]}}", "distinct device ids"),
        ("device_topology: {gpu: {ids: [1]}}", "ids=[1] is out of range: allowed null with"),
        ("device_topology: {gpu: {tensor_parallel: 2, ids: '0,1'}}", "device_topology.gpu.ids"),
        (
            "device_topology: {gpu: {tensor_parallel: 2}}\nkv_cache: {warm_region_mb: 64}",
            "kv_cache.warm_region_mb=64 is out of range: allowed 0 with "
            "device_topology.gpu.tensor_parallel > 1",
        ),
        (
            "device_topology: {gpu: {tensor_parallel: 2}}\nweights: {gpu_layers: 1}",
            "weights.gpu_layers=1",
        ),
        (
            "device_topology: {gpu: {tensor_parallel: 2}}\ncold_weights: {expert_cache_slots: 2}",
            "cold_weights.expert_cache_slots=2",
        ),
        (
            "device_topology: {gpu: {tensor_parallel: 2}}\nweights: {format: int4}",
            "weights.format='int4'",
        ),
        (
            "device_topology: {gpu: {tensor_parallel: 2}}\nkv_cache: {hot_codec: int4}",
            "kv_cache.hot_codec='int4'",
        ),
    ],
)
def test_config_file_refuses(yaml: str, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_config(safe_load(yaml))


def test_config_file_sets_the_ranks() -> None:
    """tensor_parallel and ids reach the engine; rank 0 is ids[0]."""
    config = parse_config(safe_load("device_topology: {gpu: {tensor_parallel: 2, ids: [3, 1]}}"))
    engine = config.engine_config("cuda")
    assert (engine.tensor_parallel, engine.tensor_parallel_ids) == (2, (3, 1))
    assert engine.device == "cuda:3"
    assert worker_device(engine, 1) == "cuda:1"
    assert worker_device(config.engine_config("cpu"), 1) == "cpu"
    default = parse_config(safe_load("device_topology: {gpu: {tensor_parallel: 2}}"))
    assert default.device_topology.gpu.device_ids == (0, 1)
    assert parse_config({}).engine_config("cpu").tensor_parallel == 1


@pytest.mark.slow
def test_served_tp2_generate_matches_hf(checkpoint, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """`hybridgen serve` with device_topology.gpu.tensor_parallel: 2 on the CPU: the GPU
    daemon starts the worker rank, and a gRPC Generate gives HF's greedy tokens."""
    path = checkpoint("mixtral")
    prompts = sample_prompts(path, 2, [13, 37])
    expected = hf_greedy(path, prompts, NEW_TOKENS)
    topology = "device_topology:\n  gpu:\n    tensor_parallel: 2\n"
    server = DefaultServer(tmp_path, topology, model=path)
    try:
        got = [greedy(server, prompt) for prompt in prompts]
    finally:
        assert server.stop() == 0
    log = (tmp_path / "run" / server.instance / "gpu.log").read_text()
    assert '"ranks": 2, "backend": "gloo"' in log and '"tensor_parallel_worker_ready"' in log
    assert '"tensor_parallel_stopped"' in log, "the daemon stops its worker on the way out"
    assert "tensor_parallel_worker_failed" not in log
    assert "ignored a notification" not in server.log_path.read_text()
    assert got == expected


@pytest.mark.slow
def test_served_lost_rank_restarts_the_daemon(checkpoint, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A worker rank killed under `hybridgen serve`: the next call fails (UNAVAILABLE, no
    hang), the GPU daemon exits and its supervisor starts it again with a new worker, and
    the same call then gives the same tokens."""
    path = checkpoint("llama3")
    prompt = sample_prompts(path, 1, [21])[0]
    topology = "device_topology:\n  gpu:\n    tensor_parallel: 2\n"
    server = DefaultServer(tmp_path, topology, model=path)
    try:
        before = greedy(server, prompt)
        worker = _worker_of(server)
        os.kill(worker, signal.SIGKILL)
        with pytest.raises(grpc.RpcError) as err:
            greedy(server, prompt)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        wait_serving(server.port, timeout=30, want=False)  # health follows the dead daemon
        wait_serving(server.port, timeout=180, proc=server.proc)
        assert greedy(server, prompt) == before
        assert _worker_of(server) != worker
    finally:
        assert server.stop() == 0
    assert (
        "tensor_parallel_rank_lost" in (tmp_path / "run" / server.instance / "gpu.log").read_text()
    )


def _worker_of(server: DefaultServer) -> int:
    """The pid of the worker rank under the instance's GPU daemon."""
    gpu = find_pid("-m hybridgen.gpu_daemon.main", f"--instance {server.instance}")
    assert gpu is not None
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and _parent(entry) == gpu:
            cmd = (entry / "cmdline").read_bytes()
            if b"hybridgen.parallel.worker" in cmd:
                return int(entry.name)
    raise AssertionError("no worker rank under the GPU daemon")


def _parent(entry: Path) -> int | None:
    try:
        return int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def greedy(server: DefaultServer, prompt: list[int]) -> list[int]:
    request = pb.GenerateRequest(
        prompt_token_ids=prompt,
        max_tokens=NEW_TOKENS,
        ignore_eos=True,
        sampling=pb.SamplingParams(temperature=0.0),
    )
    return [t for reply in server.stub.Generate(request, timeout=120) for t in reply.token_ids]
